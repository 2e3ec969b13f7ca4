"""Deduplication in gradient space: groups of examples that teach the model the same thing.

Two examples are near-duplicates when the cosine of their per-example gradients (concatenated
over the chosen layers; with ``method='kfac'|'ekfac'`` first whitened by ``H^{-1/2}``, so the
cosine is the one the influence geometry sees) is at least ``threshold``. Exact text duplicates
(identical tokens and labels, by the 16-byte token hash the build stored) are grouped too.

Scales to millions of rows with bounded memory: one pass over the store writes a seeded Gaussian
sketch of each unit vector (``sketch`` numbers, a JL projection: sketched cosines are within about
``2/√sketch`` of the true ones); a FAISS k-nearest-neighbour search over the sketches proposes
pairs whose sketched cosine clears ``threshold - margin``; each proposed pair is then checked
exactly on the stored rows; union-find over the confirmed pairs gives the groups. With
``sketch=0`` the candidates come from the full vectors (exact kNN while they fit in memory).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import faiss
import numpy as np
import torch
from tqdm.auto import tqdm

from gradindex.index.factory import default_nlist
from gradindex.index.rows import RowReader
from gradindex.index.space import Preconditioners
from gradindex.manifest import read_complete_manifest, row_basis
from gradindex.methods import parse_method, row_base
from gradindex.precondition.preconditioner import selected_layers
from gradindex.store import Store

log = logging.getLogger("gradindex")


@dataclass(frozen=True)
class DedupConfig:
    threshold: float | None = None
    """Cosine at or above which two examples' gradients count as near-duplicates; None: 0.6 for
    ``graddot``, 0.5 for whitened gradients (``kfac``/``ekfac``, and the rows of an index stored in
    the EK-FAC eigenbasis). 0.6 groups 90% of planted near copies (two words replaced) and no pair
    of different paragraphs on one topic (benchmarks/audit.py; with ``method='ekfac'``, 0.5 groups
    all near copies and no topic pair)."""
    method: str = "graddot"
    """``graddot`` (raw gradients) or ``kfac``/``ekfac`` (whitened by ``H^{-1/2}`` first)."""
    damping: float = 0.1
    """Relative damping of the whitening."""
    neighbors: int = 16
    """Nearest neighbours proposed per example (a group larger than this is still found through
    chains of pairs)."""
    sketch: int = 256
    """Numbers per example in the candidate sketch; 0 = search the full vectors."""
    margin: float = 0.05
    """Candidates need a sketched cosine of at least ``threshold - margin``. A sketched cosine
    ``c`` errs by about ``(1 - c²)/√sketch`` (0.006 at c = 0.95, 0.02 at c = 0.8 with 256 numbers),
    so 0.05 loses almost no pair above the threshold."""
    seed: int = 0
    block: int = 8192

    @property
    def cut(self) -> float:
        """The cosine threshold in use (``threshold``, or the method's default)."""
        if self.threshold is not None:
            return float(self.threshold)
        return 0.6 if parse_method(self.method)[0] == "graddot" else 0.5

    def __post_init__(self) -> None:
        if not -1.0 <= self.cut <= 1.0:
            raise ValueError(f"--threshold is a cosine in [-1, 1], got {self.threshold}")
        if self.neighbors < 1 or self.sketch < 0:
            raise ValueError("--neighbors must be >= 1 and --sketch >= 0")
        base, selfnorm = parse_method(self.method)
        if selfnorm or base == "cosine":
            raise ValueError(f"dedup compares normalised gradients; --method is graddot, kfac or ekfac, "
                             f"not {self.method!r}")


@dataclass
class Group:
    ids: list[int]
    kind: str
    """``exact`` (identical tokens), ``near`` (gradient cosine ≥ threshold) or ``exact+near``."""
    min_cosine: float | None
    """Smallest confirmed cosine of a pair joining the group (``None`` for exact-only groups)."""

    @property
    def keep(self) -> int:
        return min(self.ids)

    def to_dict(self) -> dict:
        return {"ids": self.ids, "keep": self.keep, "drop": [i for i in self.ids if i != self.keep],
                "kind": self.kind, "min_cosine": self.min_cosine}


@dataclass
class DedupResult:
    groups: list[Group]
    n: int
    config: DedupConfig
    pairs_proposed: int = 0
    pairs_confirmed: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def keep_mask(self) -> np.ndarray:
        """``[N]`` bool: the suggested keep-list (all but one member of each group dropped)."""
        keep = np.ones(self.n, dtype=bool)
        for g in self.groups:
            keep[[i for i in g.ids if i != g.keep]] = False
        return keep


class _UnionFind:
    def __init__(self, n: int):
        self.parent = np.arange(n)

    def find(self, i: int) -> int:
        p = self.parent
        root = i
        while p[root] != root:
            root = p[root]
        while p[i] != root:
            p[i], i = root, p[i]
        return root

    def union(self, i: int, j: int) -> None:
        a, b = self.find(i), self.find(j)
        if a != b:
            self.parent[max(a, b)] = min(a, b)


def _unit_rows(rows: dict[str, np.ndarray], layers: Sequence[str], pre: Preconditioners, method: str,
               damping: float) -> np.ndarray:
    """``[n, D_total]`` float32 unit vectors of store rows (concatenated over layers, whitened for kfac/ekfac)."""
    parts = []
    for n in layers:
        x = torch.from_numpy(np.ascontiguousarray(rows[n], dtype=np.float32))
        if method != "graddot":
            x = pre.apply(method, n, x, -0.5, damping)
        parts.append(x.numpy())
    v = np.concatenate(parts, axis=1)
    norm = np.linalg.norm(v, axis=1, keepdims=True)
    return np.where(norm > 0, v / np.where(norm > 0, norm, 1.0), 0.0).astype(np.float32)


def find_duplicates(index_dir: str | os.PathLike, cfg: DedupConfig = DedupConfig(),
                    layers: Sequence[str] | None = None, progress: bool = False) -> DedupResult:
    """Groups of exact and near-duplicate training examples (module doc)."""
    import time

    t0 = time.perf_counter()
    manifest = read_complete_manifest(index_dir, "deduplicate")
    layers = selected_layers(manifest, layers)
    base, _ = parse_method(cfg.method)
    base = row_base(base, row_basis(manifest), cfg.method)  # whitened rows: ekfac is their plain cosine
    pre = Preconditioners(index_dir, manifest)
    if base != "graddot":
        pre.check(base)
    with Store(index_dir) as store:
        N = len(store)
        total = sum(store.dims[n] for n in layers)
        d = cfg.sketch if 0 < cfg.sketch < total else total
        R = None
        if d < total:
            rng = np.random.default_rng(cfg.seed)
            R = (rng.standard_normal((total, d)) / np.sqrt(d)).astype(np.float32)
        vecs = np.empty((N, d), dtype=np.float32)
        nonzero = np.zeros(N, dtype=bool)
        with tqdm(total=N, unit="ex", desc="dedup: vectors", disable=not progress) as bar:
            for ids, blk in store.iter_blocks(layers, cfg.block):
                u = _unit_rows(blk, layers, pre, base, cfg.damping)
                nonzero[ids] = np.abs(u).sum(1) > 0
                if R is not None:
                    u = u @ R
                    nrm = np.linalg.norm(u, axis=1, keepdims=True)
                    u = np.where(nrm > 0, u / np.where(nrm > 0, nrm, 1.0), 0.0)
                vecs[ids] = u
                bar.update(len(ids))
        t1 = time.perf_counter()
        pairs = _candidate_pairs(vecs, nonzero, cfg, cfg.cut - (cfg.margin if R is not None else 1e-4))
        del vecs
        t2 = time.perf_counter()
        confirmed, cosines = _confirm(store, layers, pre, base, cfg, pairs)
        hashes = store.column("token_hash")
    t3 = time.perf_counter()
    groups = _groups(N, confirmed, cosines, hashes)
    secs = {"vectors": t1 - t0, "search": t2 - t1, "confirm": t3 - t2, "total": time.perf_counter() - t0}
    log.info("dedup: %d pairs proposed, %d confirmed, %d groups", len(pairs), len(confirmed), len(groups))
    return DedupResult(groups, N, cfg, len(pairs), len(confirmed), secs)


def _candidate_pairs(vecs: np.ndarray, nonzero: np.ndarray, cfg: DedupConfig, floor: float) -> np.ndarray:
    """``[P, 2]`` unique pairs ``i < j`` among each row's neighbours with cosine ≥ ``floor``."""
    N, d = vecs.shape
    live = np.nonzero(nonzero)[0]
    if len(live) < 2:
        return np.zeros((0, 2), dtype=np.int64)
    x = np.ascontiguousarray(vecs[live])
    k = min(cfg.neighbors + 1, len(live))
    if len(live) <= 50_000:
        index = faiss.IndexFlatIP(d)
    else:
        nlist = default_nlist(len(live))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(cfg.seed)
        index.train(x[rng.choice(len(live), min(len(live), 64 * nlist), replace=False)])
        index.nprobe = max(8, nlist // 64)
    index.add(x)
    out = []
    for s in range(0, len(live), cfg.block):
        sims, nbr = index.search(x[s:s + cfg.block], k)
        rows = np.repeat(np.arange(s, s + len(sims)), k)
        ok = (nbr.ravel() >= 0) & (sims.ravel() >= floor) & (nbr.ravel() != rows)
        a, b = live[rows[ok]], live[nbr.ravel()[ok]]
        out.append(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1))
    pairs = np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)
    return np.unique(pairs, axis=0) if len(pairs) else pairs


def _confirm(store: Store, layers, pre, method, cfg: DedupConfig, pairs: np.ndarray):
    """The pairs whose exact cosine (from the stored rows) is ≥ the threshold, and those cosines."""
    if len(pairs) == 0:
        return pairs, np.zeros(0)
    keep, cos = [], []
    reader = RowReader(store, list(layers))
    step = max(1, cfg.block // 2)
    for s in range(0, len(pairs), step):
        p = pairs[s:s + step]
        ids, inv = np.unique(p.ravel(), return_inverse=True)
        u = _unit_rows(reader.read(ids), layers, pre, method, cfg.damping)
        inv = inv.reshape(-1, 2)
        c = np.einsum("ij,ij->i", u[inv[:, 0]].astype(np.float64), u[inv[:, 1]].astype(np.float64))
        ok = c >= cfg.cut
        keep.append(p[ok])
        cos.append(c[ok])
    return np.concatenate(keep), np.concatenate(cos)


def _groups(n: int, pairs: np.ndarray, cosines: np.ndarray, hashes: np.ndarray) -> list[Group]:
    """Union-find over confirmed pairs and identical token hashes → groups of two or more."""
    uf = _UnionFind(n)
    for i, j in pairs.tolist():
        uf.union(i, j)
    h = np.ascontiguousarray(hashes).view(np.dtype((np.void, hashes.shape[1]))).ravel()
    _, inv, counts = np.unique(h, return_inverse=True, return_counts=True)
    exact = counts[inv] > 1  # [N] rows whose tokens occur more than once
    by_hash = np.argsort(inv, kind="stable")
    bounds = np.nonzero(np.diff(inv[by_hash]))[0] + 1
    for members in np.split(by_hash, bounds):
        for m in members[1:]:
            uf.union(int(members[0]), int(m))
    roots = np.array([uf.find(i) for i in range(n)])
    near_min: dict[int, float] = {}
    for (i, _), c in zip(pairs.tolist(), cosines.tolist(), strict=True):
        r = int(roots[i])
        near_min[r] = min(near_min.get(r, 1.0), float(c))
    order = np.argsort(roots, kind="stable")
    out = []
    for members in np.split(order, np.nonzero(np.diff(roots[order]))[0] + 1):
        if len(members) < 2:
            continue
        r = int(roots[members[0]])
        ex = bool(exact[members].any())
        kind = "exact+near" if ex and r in near_min else ("exact" if ex else "near")
        out.append(Group(sorted(int(m) for m in members), kind, near_min.get(r)))
    return sorted(out, key=lambda g: g.ids[0])
