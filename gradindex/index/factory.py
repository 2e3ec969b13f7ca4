"""FAISS factory strings: the default for a layer, search-time knobs, and what an index holds.

Every index is inner-product (``METRIC_INNER_PRODUCT``) over one layer's vectors. The default is
a pure function of the number of examples ``N`` and the layer's dimension ``D``:

* ``Flat`` while ``N·D ≤ 2^24`` (64 MB of float32 per layer): exhaustive, hence exact;
* beyond, ``IVF{nlist},PQ{D/2}x4fs``: ``nlist`` the power of two nearest ``√N``, 4-bit
  fast-scan product codes of 2 dimensions each (``D/4`` bytes per vector; cheap to train, SIMD to
  scan); ``IVF{nlist},SQ8`` for an odd ``D``. Candidates are always re-ranked exactly from the
  store, so the codes only have to put the true top of each layer among its candidates. Recall
  depends most on the share of lists visited, so the default ``nprobe`` is ``nlist/4``, then on
  the code precision (8-bit PQ trains ~50x slower on a CPU for little gain; benchmarks/query.py).

GPU FAISS has no fast-scan codes: there, pass a factory string such as ``IVF1024,PQ64``.
"""

from __future__ import annotations

import math

import faiss

FLAT_MAX_FLOATS = 1 << 24


def default_nlist(n: int) -> int:
    """Power of two nearest ``√n``, at least 16, with ≥ 39 training points per list."""
    nlist = 2 ** round(math.log2(max(1.0, math.sqrt(n))))
    return int(max(16, min(nlist, 65536, max(16, n // 39))))


def default_factory(n: int, dim: int) -> str:
    """The factory string gradindex uses for ``n`` vectors of dimension ``dim`` (module doc)."""
    if n * dim <= FLAT_MAX_FLOATS:
        return "Flat"
    if dim % 2 == 0:
        return f"IVF{default_nlist(n)},PQ{dim // 2}x4fs"
    return f"IVF{default_nlist(n)},SQ8"


def resolve_factory(factory: str, n: int, dim: int) -> str:
    """``auto`` (or empty) → :func:`default_factory`; otherwise the string itself, checked."""
    if not factory or factory.lower() == "auto":
        return default_factory(n, dim)
    make_index(factory, dim)
    return factory


def make_index(factory: str, dim: int) -> faiss.Index:
    """An empty inner-product index; errors name the factory string and the dimension."""
    try:
        return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        raise ValueError(
            f"FAISS factory string {factory!r} does not work for {dim}-dimensional vectors ({msg}); "
            "use e.g. 'Flat', 'IVF1024,Flat', 'IVF1024,PQ64', 'IVF1024,SQ8' or 'HNSW32', or 'auto'"
        ) from None


def is_exhaustive(index: faiss.Index) -> bool:
    """Whether the index is a plain flat index (its search is exact and exhaustive)."""
    return type(faiss.downcast_index(index)) in (faiss.IndexFlat, faiss.IndexFlatIP)


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


def _hnsw(index: faiss.Index):
    idx = faiss.downcast_index(index)
    return idx.hnsw if hasattr(idx, "hnsw") else None


def _is_gpu(index: faiss.Index) -> bool:
    return "Gpu" in type(faiss.downcast_index(index)).__name__ or type(index).__name__ == "IndexShards"
