"""FAISS factory strings: the default for a layer, search-time knobs, and what an index holds.

Every index is inner-product (``METRIC_INNER_PRODUCT``) over one layer's vectors. The default is
a pure function of the number of examples ``N`` and the layer's dimension ``D``:

* ``Flat`` while ``N·D ≤ 2^24`` (64 MB of float32 per layer), and also while ``N < 50,000`` as
  long as the layer's vectors take at most 2 GiB: exhaustive, hence exact, and built in the time
  it takes to read the store (an IVF-PQ over 512 rows of 16k-66k numbers took 190-290 s to
  train against 2.6 s for Flat, and answered approximately over data that fits in memory);
* beyond, ``IVF{nlist},PQ{D/2}x4fs``: ``nlist`` the power of two nearest ``√N``, 4-bit
  fast-scan product codes of 2 dimensions each (``D/4`` bytes per vector; cheap to train, SIMD to
  scan); ``IVF{nlist},SQ8`` for an odd ``D``. Candidates are always re-ranked exactly from the
  store, so the codes only have to put the true top of each layer among its candidates. Recall
  depends most on the share of lists visited, so the default ``nprobe`` is ``nlist/4``, then on
  the code precision (8-bit PQ trains ~50x slower on a CPU for little gain; benchmarks/query.py).

Over a store of low-bit codes the exhaustive index holds scalar codes of the same width instead
of ``Flat`` (``SQfp16``, ``SQ8``, ``SQ4`` for ``fp16``, ``int8``, ``int4`` rows: 2×, 4×, 8×
smaller), so the index does not undo the store's saving; its candidates are re-ranked exactly
from the store like an IVF's.

GPU FAISS has no fast-scan codes: there, pass a factory string such as ``IVF1024,PQ64``.
"""

from __future__ import annotations

import math

import faiss

FLAT_MAX_FLOATS = 1 << 24
"""Flat whenever a layer holds at most this many numbers (64 MB of float32)."""
FLAT_MAX_ROWS = 50_000
"""Flat below this many examples ..."""
FLAT_MAX_BYTES = 2 << 30
"""... as long as a layer's float32 vectors fit in this many bytes."""


def default_nlist(n: int) -> int:
    """Power of two nearest ``√n``, at least 16, with ≥ 39 training points per list."""
    nlist = 2 ** round(math.log2(max(1.0, math.sqrt(n))))
    return int(max(16, min(nlist, 65536, max(16, n // 39))))


EXHAUSTIVE = {"fp32": "Flat", "fp16": "SQfp16", "int8": "SQ8", "int4": "SQ4"}
"""The exhaustive index over a store of each row code."""


def default_factory(n: int, dim: int, storage: str = "fp32") -> str:
    """The factory string gradindex uses for ``n`` vectors of dimension ``dim`` stored as ``storage`` (module doc)."""
    if n * dim <= FLAT_MAX_FLOATS or (n < FLAT_MAX_ROWS and 4 * n * dim <= FLAT_MAX_BYTES):
        return EXHAUSTIVE.get(storage, "Flat")
    if dim % 2 == 0:
        return f"IVF{default_nlist(n)},PQ{dim // 2}x4fs"
    return f"IVF{default_nlist(n)},SQ8"


def resolve_factory(factory: str, n: int, dim: int, storage: str = "fp32") -> str:
    """``auto`` (or empty) → :func:`default_factory`; otherwise the string itself, checked
    against the dimension and against ``n`` (an IVF needs a point per list to train on)."""
    if not factory or factory.lower() == "auto":
        return default_factory(n, dim, storage)
    need = min_train_points(make_index(factory, dim))
    if n < need:
        raise ValueError(
            f"index type {factory!r} needs at least {need} examples to train on, the data set has {n}; "
            f"use --index-type auto (Flat at this size) or fewer IVF lists (e.g. 'IVF{max(1, n // 39)},Flat')"
        )
    return factory


def min_train_points(index: faiss.Index) -> int:
    """The fewest training points FAISS accepts: one per IVF list and per PQ/SQ centroid (0: no training)."""
    if index.is_trained:
        return 0
    need = 1
    ivf = _ivf(index)
    if ivf is not None:
        need = max(need, int(ivf.nlist))
    pq = _pq(index)
    if pq is not None:
        need = max(need, 1 << int(pq.nbits))
    return need


def quiet_training(index: faiss.Index) -> faiss.Index:
    """Stop FAISS's k-means from printing a warning per clustering (one per PQ sub-quantizer:
    147,691 stderr lines for one IVF-PQ build of 512 rows) when it trains on few points per
    centroid; the result is unchanged, only the message goes. Returns ``index``."""
    index.verbose = False
    ivf = _ivf(index)
    if ivf is not None:
        ivf.cp.min_points_per_centroid = 1
        ivf.cp.verbose = False
    pq = _pq(index)
    if pq is not None:
        pq.cp.min_points_per_centroid = 1
        pq.cp.verbose = False
        pq.verbose = False
    return index


def make_index(factory: str, dim: int) -> faiss.Index:
    """An empty inner-product index (:func:`quiet_training`); errors name the factory string and the dimension."""
    try:
        return quiet_training(faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT))
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        pq = max(d for d in range(1, 65) if dim % d == 0)  # (PQ's sub-vectors must divide the dimension)
        raise ValueError(
            f"FAISS factory string {factory!r} does not work for {dim}-dimensional vectors ({msg}); use e.g. "
            f"'Flat', 'SQ8', 'IVF256,Flat', 'IVF256,PQ{pq}' (PQ's sub-vectors must divide {dim}; an IVF's lists are "
            "at most the examples) or 'HNSW32', or 'auto'"
        ) from None


def is_exhaustive(index: faiss.Index) -> bool:
    """Whether the index is a plain flat index (its search is exact and exhaustive)."""
    return type(faiss.downcast_index(index)) in (faiss.IndexFlat, faiss.IndexFlatIP)


def is_coded_exhaustive(index: faiss.Index) -> bool:
    """Whether the index scans every vector's scalar codes (``SQ8``, ``SQ4``, ``SQfp16``): exhaustive, approximate."""
    return type(faiss.downcast_index(index)) is faiss.IndexScalarQuantizer


def train_size(index: faiss.Index, n: int, requested: int = 0) -> int:
    """Rows sampled for training: ``requested`` if set, else 64 per IVF list (≥ 16384), ≤ n."""
    if index.is_trained:
        return 0
    if requested > 0:
        return min(n, requested)
    ivf = _ivf(index)
    per_list = 64 * ivf.nlist if ivf is not None else 0
    return min(n, max(per_list, 16384))


def default_search_params(index: faiss.Index) -> dict[str, int]:
    """Structural search knobs of an index: IVF ``nprobe``, HNSW ``efSearch`` (raised to ``k`` per search)."""
    out: dict[str, int] = {}
    ivf = _ivf(index)
    if ivf is not None:
        out["nprobe"] = int(min(ivf.nlist, max(8, ivf.nlist // 4)))
    hnsw = _hnsw(index)
    if hnsw is not None:
        out["efSearch"] = 64
    return out


def apply_search_params(index: faiss.Index, params: dict[str, int]) -> None:
    """Set ``nprobe`` / ``efSearch`` on an index (CPU or GPU, plain or wrapped)."""
    for key, value in params.items():
        if key == "nprobe" and _ivf(index) is None and not _is_gpu(index):
            continue
        if key == "efSearch" and _hnsw(index) is None:
            continue
        ps = faiss.GpuParameterSpace() if _is_gpu(index) else faiss.ParameterSpace()
        ps.set_index_parameter(index, key, int(value))


def _ivf(index: faiss.Index):
    try:
        return faiss.extract_index_ivf(index)
    except (RuntimeError, AttributeError):
        return None


def _pq(index: faiss.Index):
    """The product quantizer of a PQ or IVF-PQ index (plain or fast-scan), if any."""
    ivf = _ivf(index)
    for idx in (index, ivf):
        if idx is not None:
            idx = faiss.downcast_index(idx)
            if hasattr(idx, "pq"):
                return idx.pq
    return None


def _hnsw(index: faiss.Index):
    idx = faiss.downcast_index(index)
    return idx.hnsw if hasattr(idx, "hnsw") else None


def _is_gpu(index: faiss.Index) -> bool:
    return "Gpu" in type(faiss.downcast_index(index)).__name__ or type(index).__name__ == "IndexShards"
