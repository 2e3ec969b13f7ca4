"""Index: one FAISS inner-product index per layer, built from the store (DESIGN.md, "On disk")."""

from gradindex.index.builder import IndexBuildResult, IndexConfig, build_indices
from gradindex.index.factory import default_factory, resolve_factory
from gradindex.index.files import FAISS_DIR, faiss_dir, layer_file, read_meta
from gradindex.index.load import IndexSet, LayerIndex
from gradindex.index.rows import RowReader, iter_layer
from gradindex.index.space import IndexSpace, Preconditioners, query_vectors

__all__ = [
    "FAISS_DIR",
    "IndexBuildResult",
    "IndexConfig",
    "IndexSet",
    "IndexSpace",
    "LayerIndex",
    "Preconditioners",
    "RowReader",
    "build_indices",
    "default_factory",
    "faiss_dir",
    "iter_layer",
    "layer_file",
    "query_vectors",
    "read_meta",
    "resolve_factory",
]
