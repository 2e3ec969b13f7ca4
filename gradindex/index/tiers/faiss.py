"""The FAISS tier: one inner-product index per layer, of the factory string given (``Flat``, ``SQ4``,
``IVF1024,PQ64x4fs``, ``HNSW32``...; ``auto``: :func:`gradindex.index.factory.default_factory` per layer). It takes
every factory string no other tier claims, and is ``auto``'s choice in a whitened or normalized space.

Its candidates: when every chosen layer's index is exhaustive (flat, or scalar codes scanned whole) the per-layer
inner products with every vector are summed in one pass (scalar codes' scores are approximate, so a wider
shortlist of them, :func:`coded_shortlist`, goes on); otherwise each layer's index returns its approximate top
``candidates`` for ``u`` (and ``-u`` for the lowest), those rows of that layer are scored exactly and the best
``shortlist`` per layer kept, the union over layers being the candidate set.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import faiss
import numpy as np
import torch

from gradindex.index import gpu
from gradindex.index.factory import default_search_params, is_coded_exhaustive, is_exhaustive, resolve_factory
from gradindex.index.files import layer_path
from gradindex.index.tiers.base import (
    BuildJob,
    CandidateRequest,
    Candidates,
    RowShape,
    Tier,
    TierSource,
    dots,
    register_tier,
    too_few_to_train,
    top_and_bottom,
    with_factors,
)
from gradindex.index.tiers.faiss_layers import LayerIndex, build_layer, read_layer
from gradindex.progress import progress_bar
from gradindex.store.codes import has_scale, row_bytes

DEFAULT_CANDIDATES = 2000
"""ANN results per layer (queries' ``candidates``)."""
DEFAULT_SHORTLIST = 100
"""Of those, kept per layer after exact per-layer scoring (queries' ``shortlist``)."""
EXACT_SHARE = 0.25
"""When a query asks for at least this share of the examples, approximate layers are not searched:
every example is scored exactly, streaming the store (an IVF search at the default ``nprobe``
returned 289-511 of 512 rows for ``k = 512``); so is a query the ANN search found too few for."""


def coded_shortlist(k: int) -> int:
    """Examples re-ranked exactly after an exhaustive scan of scalar codes (``SQ4``...): ``max(3k, 30)``.

    On the demo's default index (int4 eigenbasis rows, 1,107 examples, 13 queries) the exact top 10
    was always within the codes' top 13."""
    return max(3 * k, 30)


@register_tier
class FaissTier(Tier):
    """Per-layer FAISS indices (module doc)."""

    name = "faiss"
    auto_order = 2
    catch_all = True

    @classmethod
    def matches(cls, factory: str) -> bool:
        return True

    def check_examples(self, n: int) -> None:
        """More IVF lists or PQ centroids than ``n`` rows to train them on (read from the string, before any
        index is made) is refused."""
        need = []
        m = re.search(r"IVF(\d+)", self.factory)
        if m:
            need.append((int(m.group(1)), f"{m.group(1)} lists"))
        m = re.search(r"PQ\d+(?:x(\d+))?", self.factory)
        if m:
            need.append((1 << int(m.group(1) or 8), f"{1 << int(m.group(1) or 8)} PQ centroids"))
        for rows, what in need:
            if rows > n:
                raise ValueError(f"--index-type {self.factory} has {what}, more than the {n} examples to train it "
                                 "on; use --index-type Flat (exact) or fewer lists")
            too_few_to_train(self.factory, what, rows, self.cfg.train_size)

    def disk_bytes(self, rows: RowShape) -> int:
        """At most codes of every row (an exhaustive index holds codes as wide as the store's)."""
        per_layer = rows.layer_numbers or (rows.numbers,)
        return rows.n * sum(row_bytes(rows.storage, x) - 4 * has_scale(rows.storage) for x in per_layer)

    def layer_factories(self, n: int, dims: dict[str, int], storage: str) -> dict[str, str]:
        return {layer: resolve_factory(self.factory, n, d, storage) for layer, d in dims.items()}

    def build(self, job: BuildJob) -> int:
        store, meta, added = job.store, job.meta, 0
        bar = progress_bar(total=job.n * len(store.layers), unit="vec", desc="index", disable=not job.progress)
        try:
            for n in store.layers:
                path, entry, factory = layer_path(job.out, n), meta["layers"].get(n), job.factories[n]
                if entry and entry["factory"] == factory and path.exists():
                    bar.update(job.n)
                    continue
                bar.set_postfix_str(n)
                index, k = build_layer(store, n, factory, job.cfg, job.pre, job.inv, path,
                                       {**job.key, "factory": factory}, bar)
                added += k
                meta["layers"][n] = {"file": path.name, "factory": factory, "dim": store.dims[n],
                                     "ntotal": int(index.ntotal), "bytes": path.stat().st_size,
                                     "search": default_search_params(index)}
                job.save()
                del index
        finally:
            bar.close()
        return added

    @classmethod
    def files(cls, meta: dict, layers: Sequence[str] | None = None) -> list[str]:
        return [e["file"] for n, e in meta["layers"].items() if e.get("file") and (layers is None or n in layers)]

    def open(self, source: TierSource) -> None:
        self.layers: dict[str, LayerIndex] = {}
        for name in source.layers:
            entry = source.meta["layers"][name]
            index = read_layer(source.index_dir, source.folder, name, entry, source.n)
            li = LayerIndex(name, layer_path(source.folder, name), entry["factory"], index,
                            dict(entry.get("search", {})))
            if is_exhaustive(index):
                _flat_vectors(li, source.n, source.use_gpu)
            else:
                li.coded = is_coded_exhaustive(index)
                li.index = gpu.for_search(index, source.use_gpu)
            self.layers[name] = li
        self.exhaustive = all(li.exhaustive for li in self.layers.values())

    def candidates(self, req: CandidateRequest) -> Candidates:
        chosen = [self.layers[n] for n in req.layers]
        if all(li.exhaustive for li in chosen):
            # scores from scalar codes are approximate: a shortlist of them goes to the exact re-rank
            wide = (req.shortlist or coded_shortlist(req.want)) if any(li.coded for li in chosen) else 0
            s = None
            for li in chosen:
                part = li.scores(req.u[li.name]).astype(np.float64)  # [Q, N]
                s = part if s is None else s + part
            s = with_factors(self.source, s, req.layers, req.cosine, req.scale)
            return Candidates.of(top_and_bottom(s, max(req.k, wide), max(req.lowest, wide if req.lowest else 0)))
        n = self.source.n
        if req.want >= EXACT_SHARE * n and req.exact is not None:
            return Candidates.of(req.exact(list(range(len(req.u[req.layers[0]])))),
                                 [f"k={req.want} is {req.want / n:.0%} of the index's {n} examples: every example "
                                  "was scored exactly instead of searching the approximate indices"])
        return self._searched(req)

    def _searched(self, req: CandidateRequest) -> Candidates:
        """The approximate per-layer searches' union; queries it found fewer than ``req.want`` for, every example
        scored exactly instead (``req.exact``)."""
        kc = max(req.candidates or DEFAULT_CANDIDATES, req.k, req.lowest)
        keep = max(req.shortlist or DEFAULT_SHORTLIST, req.k, req.lowest)
        params = {"nprobe": req.nprobe} if req.nprobe else None
        sel = req.scale
        if req.cosine:  # a layer's contribution's factor: 1/‖t‖ for cosine, times the scale
            t = self.source.norms(req.layers)
            inv = np.where(t > 0, 1.0 / np.where(t > 0, t, 1.0), 0.0)
            sel = inv if sel is None else inv * sel
        ids = self.ann_candidates(req, kc, kc if req.lowest else 0, keep, params, sel)
        out = Candidates.of(ids)
        short = [j for j, c in enumerate(ids) if len(c) < req.want]
        if short and req.exact is not None:
            for j, c in zip(short, req.exact(short), strict=True):
                out.ids[j], out.widened[j] = c, True
        return out

    def ann_candidates(self, req: CandidateRequest, n_top: int, n_low: int, shortlist: int,
                       params: dict[str, int] | None, scale: np.ndarray | None = None) -> list[np.ndarray]:
        """Per query, the union over layers of each layer's shortlist.

        Each layer's index returns its approximate top ``n_top`` ids for ``u_l`` (and bottom
        ``n_low``, searched with ``-u_l``). Those rows of that layer are read and scored exactly
        (``⟨m_l, t_l⟩``, times ``scale``), and the best ``shortlist`` of them stay: the union is then
        as good as an exact per-layer search to that depth, which the codes alone are not.
        """
        rows = self.source.reader()
        Q = len(req.u[req.layers[0]])
        found: list[list[np.ndarray]] = [[] for _ in range(Q)]
        for n in req.layers:
            li = self.layers[n]
            for sign, kk in ((1.0, n_top), (-1.0, n_low)):
                if not kk:
                    continue
                ids = li.search(sign * req.u[n], min(kk, self.source.n), params)  # [Q, kk]
                if shortlist >= ids.shape[1]:
                    found = [f + [row[row >= 0]] for f, row in zip(found, ids, strict=True)]
                    continue
                uniq = np.unique(ids[ids >= 0])
                contrib = dots(rows.read(uniq, [n])[n], req.m[n])  # [A, Q]
                if scale is not None:
                    contrib *= scale[uniq][:, None]
                for j, row in enumerate(ids):
                    row = row[row >= 0]
                    sc = sign * contrib[np.searchsorted(uniq, row), j]
                    found[j].append(row[np.argsort(-sc, kind="stable")[:shortlist]])
        return [np.unique(np.concatenate(f)) for f in found]


def _flat_vectors(li: LayerIndex, n: int, use_gpu: bool) -> None:
    """A flat index's storage as ``li.vectors`` ``[N, D]`` (a view), and its row shards on the GPUs if any."""
    flat = faiss.downcast_index(li.index)
    li.vectors = faiss.rev_swig_ptr(flat.get_xb(), n * li.index.d).reshape(n, li.index.d)
    if use_gpu and gpu.num_gpus() > 0 and torch.cuda.is_available():
        shards = np.array_split(np.arange(n), min(gpu.num_gpus(), torch.cuda.device_count()))
        li.device_vectors = [torch.from_numpy(li.vectors[s[0]:s[-1] + 1]).to(f"cuda:{i}")
                             for i, s in enumerate(shards) if len(s)]
