"""Store: row-sharded HDF5 files of per-example gradients (:mod:`.shards`), written by :mod:`.builder`."""

from gradindex.store.shards import SCALARS, STORE_DIR, ShardWriter, Store, shard_name

__all__ = ["SCALARS", "STORE_DIR", "ShardWriter", "Store", "shard_name"]
