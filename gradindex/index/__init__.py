"""Index: the store scan, the sketch tier or per-layer FAISS indices, built from the store (docs/design.md, "On disk");
:class:`OpenIndex`, an index directory opened once (manifest, store, preconditioners, indices)."""

try:
    import faiss  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "faiss":
        raise
    from gradindex.deps import FAISS_MISSING

    raise ModuleNotFoundError(FAISS_MISSING, name="faiss") from None

from gradindex.index.builder import IndexBuildResult, IndexConfig, build_indices
from gradindex.index.factory import default_factory, resolve_factory
from gradindex.index.files import FAISS_DIR, faiss_dir, layer_file, live_dir, read_meta
from gradindex.index.load import IndexSet, LayerIndex
from gradindex.index.opened import IndexReplacedError, OpenIndex, open_index
from gradindex.index.space import IndexSpace, Preconditioners, query_vectors
from gradindex.store.rows import RowReader, iter_layer

__all__ = ["FAISS_DIR", "IndexBuildResult", "IndexConfig", "IndexSet", "IndexReplacedError", "IndexSpace", "LayerIndex",
           "OpenIndex", "Preconditioners", "RowReader", "build_indices", "default_factory", "faiss_dir", "iter_layer",
           "layer_file", "live_dir", "open_index", "query_vectors", "read_meta", "resolve_factory"]
