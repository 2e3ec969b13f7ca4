"""What an index tier is: one class that is chosen, costed, built, opened and searched, and the registry that holds
them (:func:`register_tier`). One factory string (``IndexConfig.factory``) picks the tier: a registered tier's name
(``store``, ``sketch``), a string a tier claims (:meth:`Tier.matches`: FAISS takes any other, ``Flat``,
``IVF1024,PQ64``...), or ``auto``: the first tier by :attr:`Tier.auto_order` that :meth:`Tier.suits` the rows.

A tier sees the examples of one store (ids ``0..n-1``); its candidates are ids of that row range, so a set of
tiers over contiguous shards of the rows answers by offsetting and merging them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from gradindex.distributed import Share
from gradindex.index.config import IndexConfig
from gradindex.index.cost import LookupCost, memory_bytes
from gradindex.index.files import META, write_json
from gradindex.index.space import IndexSpace, Preconditioners
from gradindex.store import Store
from gradindex.store.codes import has_scale, row_bytes
from gradindex.store.rows import RowReader

EXHAUSTIVE_MARGIN = 16
"""Extra candidates taken from exhaustive (float32) scores before the float64 re-rank."""


@dataclass(frozen=True)
class RowShape:
    """The rows a tier is built over, for choosing and costing: ``n`` examples of ``numbers`` stored numbers in
    ``layers`` layers (``layer_numbers`` each, where known), coded as ``storage``."""

    n: int
    numbers: int
    storage: str
    layers: int = 1
    layer_numbers: tuple[int, ...] = ()

    @classmethod
    def of(cls, n: int, layer_numbers: Sequence[int], storage: str) -> RowShape:
        return cls(n, int(sum(layer_numbers)), storage, len(layer_numbers), tuple(int(x) for x in layer_numbers))

    @property
    def row_bytes(self) -> int:
        """Bytes of one example's stored row (its codes and, for a scaled code, a scale per layer)."""
        return row_bytes(self.storage, self.numbers) + (4 * (self.layers - 1) if has_scale(self.storage) else 0)


@dataclass
class BuildJob:
    """One index build as a tier sees it: the store, the staging folder ``out`` and its ``index.json`` (``meta``,
    written as the build goes so that a killed build resumes), the build's ``key`` and each layer's factory."""

    store: Store
    pre: Preconditioners
    cfg: IndexConfig
    out: Path
    meta: dict
    key: dict
    factories: dict[str, str]
    inv: np.ndarray | None
    """``[N]`` ``1/‖t‖`` of each example when the space is normalized, else None."""
    progress: bool = True
    share: Share | None = None
    """A torchrun build's hand-out of a per-file pass to the other ranks (:data:`gradindex.distributed.Share`)."""

    @property
    def n(self) -> int:
        return len(self.store)

    def save(self) -> None:
        """Write ``meta`` to the staging folder's ``index.json``."""
        write_json(self.out / META, self.meta)


@dataclass
class TierSource:
    """What a tier opens from: the live folder and its complete ``index.json``, the examples, the layers asked for,
    the space, the raw vectors' squared norms ``[N, L]`` and the store's rows (``None``: opened without them)."""

    index_dir: Path
    folder: Path
    meta: dict
    n: int
    layers: list[str]
    all_layers: list[str]
    space: IndexSpace
    sq_norms: np.ndarray
    rows: RowReader | None = None
    use_gpu: bool = True

    def norms(self, layers: Sequence[str] | None = None) -> np.ndarray:
        """``[N]`` float64 norms of the raw store vectors over ``layers`` (all by default)."""
        cols = [self.all_layers.index(n) for n in (layers or self.all_layers)]
        return np.sqrt(self.sq_norms[:, cols].sum(axis=1, dtype=np.float64))

    def reader(self) -> RowReader:
        if self.rows is None:
            raise RuntimeError("this index set was opened without the store's rows; open it through OpenIndex")
        return self.rows


@dataclass
class CandidateRequest:
    """A batch of queries as a tier's first stage sees it: per chosen layer the index-space vectors ``u`` (what the
    tier searches) and the method-space vectors ``m`` (dotted with the raw stored rows), and what is asked."""

    layers: list[str]
    u: dict[str, np.ndarray]
    m: dict[str, np.ndarray]
    k: int
    lowest: int = 0
    cosine: bool = False
    scale: np.ndarray | None = None
    """``[N]`` a per-example factor of the score (self-normalization), if any."""
    candidates: int | None = None
    shortlist: int | None = None
    nprobe: int | None = None
    exact: Callable[[list[int]], list[np.ndarray]] | None = None
    """Candidates from every example's exact score, for the queries at these positions (an approximate tier's
    fallback; None: there is none)."""

    @property
    def want(self) -> int:
        return max(self.k, self.lowest)


@dataclass
class Candidates:
    """Per query, the ids a tier hands to the exact re-rank; ``widened``: the ones the tier found too few for and
    scored every example instead; ``notes`` for every query."""

    ids: list[np.ndarray]
    widened: list[bool]
    notes: list[str]

    @classmethod
    def of(cls, ids: list[np.ndarray], notes: Sequence[str] = ()) -> Candidates:
        return cls(ids, [False] * len(ids), list(notes))


class Tier:
    """One kind of index. A subclass sets :attr:`name` and overrides what differs; :func:`register_tier` adds it.

    Choosing and costing use an instance made from the factory string and the build's settings (``cfg``);
    :meth:`load` makes the instance that searches, from an index directory's files.
    """

    name: ClassVar[str] = ""
    """The kind recorded in ``index.json`` (``kind``) and the manifest."""
    auto_order: ClassVar[float | None] = None
    """``auto`` tries the tiers by this, lowest first, and builds the first that :meth:`suits`; None: never."""
    catch_all: ClassVar[bool] = False
    """Tried after every other tier (FAISS: any string no other tier takes is a FAISS factory string)."""
    exhaustive: bool = False
    """Whether the candidates are the top of every example's (exact or coded) score, not an approximate search."""

    def __init__(self, factory: str = "", cfg: IndexConfig | None = None):
        self.factory = factory or self.name
        self.cfg = cfg if cfg is not None else IndexConfig(factory=self.factory)
        self.source: TierSource | None = None

    @classmethod
    def matches(cls, factory: str) -> bool:
        """Whether ``factory`` names this tier (default: its :attr:`name`, in any case)."""
        return factory.strip().lower() == cls.name

    # -- choosing and costing (before any build) ------------------------------------------------------------
    def suits(self, rows: RowShape, space: IndexSpace, ram_bytes: int) -> bool:
        """Whether ``auto`` builds this tier over ``rows`` in ``space`` on a machine of ``ram_bytes``."""
        return True

    def check_space(self, space: IndexSpace) -> None:
        """Refuse a space this tier cannot hold (a ValueError naming the options)."""

    def check_examples(self, n: int) -> None:
        """Refuse, before any work, a build over ``n`` examples that cannot succeed (a ValueError)."""

    def cost(self, rows: RowShape, candidates: int | None = None) -> LookupCost | None:
        """One lookup's estimated cost over ``rows`` (None: no estimate)."""
        return None

    def disk_bytes(self, rows: RowShape) -> int:
        """Bytes the build writes beyond the store (the plan's estimate)."""
        c = self.cost(rows)
        return c.index_bytes if c is not None else 0

    # -- building ---------------------------------------------------------------------------------------------
    def key(self) -> dict:
        """Settings beyond the layers' factory strings that make two builds differ (in ``index.json``'s key)."""
        return {}

    def layer_factories(self, n: int, dims: dict[str, int], storage: str) -> dict[str, str]:
        """The factory string recorded for each layer (default: the tier's own, in lower case)."""
        return {layer: self.factory.strip().lower() for layer in dims}

    def build(self, job: BuildJob) -> int:
        """Write the tier's files into ``job.out`` and its entries into ``job.meta``; the vectors added. The default
        writes no file: each layer's entry says the store's rows are its vectors."""
        for layer, factory in job.factories.items():
            job.meta["layers"][layer] = {"file": None, "factory": factory, "dim": job.store.dims[layer],
                                         "ntotal": job.n, "bytes": 0, "search": {}}
        return 0

    @classmethod
    def files(cls, meta: dict, layers: Sequence[str] | None = None) -> list[str]:
        """The tier's files in the index folder (beside ``index.json`` and ``norms.npy``), of ``layers`` (all)."""
        return []

    @classmethod
    def written_bytes(cls, meta: dict) -> int:
        """Bytes of the tier's files, as ``index.json`` records them."""
        return int(sum(e["bytes"] for e in meta["layers"].values()))

    @classmethod
    def describe(cls, meta: dict) -> str:
        """What the index holds, in words (``gradindex index``'s report)."""
        return ", ".join(sorted({e["factory"] for e in meta["layers"].values()}))

    # -- opening and searching -------------------------------------------------------------------------------
    @classmethod
    def load(cls, source: TierSource) -> Tier:
        """The tier of an index directory, ready to search (:meth:`open` reads its files)."""
        factories = {source.meta["layers"][n]["factory"] for n in source.layers}
        tier = cls(factories.pop() if len(factories) == 1 else "")
        tier.source = source
        tier.open(source)
        return tier

    def open(self, source: TierSource) -> None:
        """Read the tier's files for search (default: none)."""

    def candidates(self, req: CandidateRequest) -> Candidates:
        """Per query, the ids whose exact scores the re-rank computes (``req.k`` best, ``req.lowest`` worst)."""
        raise NotImplementedError(f"the {self.name!r} tier does not search")

    def nbytes(self) -> int:
        """Bytes of the open tier's files on disk."""
        src = self.source
        return int(sum((src.folder / f).stat().st_size for f in self.files(src.meta, src.layers))) if src else 0


TIERS: dict[str, type[Tier]] = {}
"""The registered tiers by name (:func:`register_tier`)."""


def register_tier(cls: type[Tier]) -> type[Tier]:
    """Add (or replace) a tier class in the registry; usable as a class decorator."""
    if not cls.name:
        raise ValueError(f"tier class {cls.__name__} has no name")
    TIERS[cls.name] = cls
    return cls


def unregister_tier(name: str) -> None:
    """Remove a tier from the registry (a test's cleanup)."""
    TIERS.pop(name, None)


def tier_class(factory: str) -> type[Tier]:
    """The tier that takes ``factory`` (a tier's name or a string it claims; catch-all tiers last)."""
    for cls in sorted(TIERS.values(), key=lambda c: c.catch_all):
        if cls.matches(factory):
            return cls
    raise ValueError(f"no index tier takes {factory!r}; the tiers are {sorted(TIERS)} and FAISS factory strings")


def tier_named(name: str) -> type[Tier]:
    """The tier an ``index.json`` records by ``kind``."""
    if name not in TIERS:
        raise ValueError(f"this index was built by the {name!r} index tier, which is not registered here "
                         f"(registered: {sorted(TIERS)}); rebuild it with `gradindex index`")
    return TIERS[name]


def kind_of(meta: dict) -> str:
    """The tier that wrote an ``index.json`` (one written before the kinds: ``sketch`` with a sketch, else FAISS)."""
    return meta.get("kind") or ("sketch" if meta.get("sketch") else "faiss")


def make_tier(cfg: IndexConfig, rows: RowShape, ram_bytes: int | None = None) -> Tier:
    """The tier ``cfg.factory`` names, checked against ``cfg.space``; ``auto`` (or empty): the first tier by
    :attr:`Tier.auto_order` that :meth:`Tier.suits` ``rows`` in that space (``ram_bytes``: this machine's)."""
    f = (cfg.factory or "auto").strip()
    if f.lower() != "auto":
        tier = tier_class(f)(f, cfg)
        tier.check_space(cfg.space)
        tier.check_examples(rows.n)  # (and its --train-size: before any work)
        return tier
    ram = memory_bytes() if ram_bytes is None else ram_bytes
    for cls in sorted((c for c in TIERS.values() if c.auto_order is not None), key=lambda c: c.auto_order):
        tier = cls("auto" if cls.catch_all else "", cfg)
        if tier.suits(rows, cfg.space, ram):
            return tier
    raise ValueError(f"no index tier suits {rows.n} examples in this space; name one with --index-type")


def too_few_to_train(factory: str, what: str, rows: int, train_size: int) -> None:
    """Refuse a ``--train-size`` (``train_size`` > 0) below the ``rows`` that training ``what`` of ``factory`` takes
    (FAISS's k-means stops on it with a traceback, after the build's capture and fit)."""
    if 0 < train_size < rows:
        raise ValueError(f"--train-size {train_size} is fewer than the {what} of --index-type {factory} (k-means "
                         f"needs a row per centroid); give --train-size {rows} or more, or leave it out (the default "
                         "samples enough)")


def with_factors(source: TierSource, s: np.ndarray, layers: Sequence[str], cosine: bool,
                 scale: np.ndarray | None, ids: np.ndarray | None = None) -> np.ndarray:
    """Index-space scores ``s`` ``[Q, N]`` times the per-example factors of the method: the norms a normalized
    index divided by, ``1/‖t‖`` for cosine, ``scale``. ``ids``: the examples of ``s``'s columns (default all)."""
    def at(v: np.ndarray) -> np.ndarray:
        return (v if ids is None else v[ids])[None, :]

    if source.space.normalize:
        s *= at(source.norms())
    if cosine:
        t = at(source.norms(layers))
        s = np.where(t > 0, s / np.where(t > 0, t, 1.0), 0.0)
    if scale is not None:
        s *= at(scale)
    return s


def top_and_bottom(s: np.ndarray, n_top: int, n_low: int, margin: int = EXHAUSTIVE_MARGIN) -> list[np.ndarray]:
    """Per row of summed scores ``s`` ``[Q, N]``, the ids of its top ``n_top`` and bottom ``n_low``
    (each with ``margin`` more, :data:`EXHAUSTIVE_MARGIN` by default, for the float64 re-rank to settle)."""
    N = s.shape[1]
    out = []
    for row in s:
        parts = []
        if n_top:
            kk = min(N, n_top + margin)
            parts.append(np.argpartition(-row, kk - 1)[:kk] if kk < N else np.arange(N))
        if n_low:
            kk = min(N, n_low + margin)
            parts.append(np.argpartition(row, kk - 1)[:kk] if kk < N else np.arange(N))
        out.append(np.unique(np.concatenate(parts)))
    return out


def dots(t: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``[C, Q]`` float64 ``t @ m.T`` for rows ``t`` ``[C, D]`` and queries ``m`` ``[Q, D]``.

    A few queries go through ``einsum``: at this size BLAS threads cost more than they save
    (10x on a busy 2-core machine); batches go through BLAS.
    """
    if len(m) <= 4:
        return np.einsum("cd,qd->cq", t, m, dtype=np.float64)
    return t.astype(np.float64) @ m.T
