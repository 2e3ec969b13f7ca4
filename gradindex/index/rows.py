"""Moved to :mod:`gradindex.store.rows` (the store owns every byte of its shards); this name stays an alias."""

from gradindex.store.rows import RowReader, iter_layer

__all__ = ["RowReader", "iter_layer"]
