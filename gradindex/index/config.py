"""The settings of an index build (:class:`IndexConfig`), serialized into ``faiss/index.json``."""

from __future__ import annotations

from dataclasses import dataclass, field

from gradindex.index.sketch import SKETCH_BYTES
from gradindex.index.space import IndexSpace


@dataclass(frozen=True)
class IndexConfig:
    """Settings of an index build; serialized into ``faiss/index.json``."""

    factory: str = "auto"
    """The index tier, by one factory string (:mod:`gradindex.index.tiers`): ``store`` (exhaustive: queries scan
    the store's own codes, no FAISS copy), ``sketch`` (two tiers: an in-RAM sketch of every whole-model row, then
    an exact re-rank of its top candidates), ``auto`` (the first registered tier that suits ``N``, the row size,
    RAM and the space: :func:`gradindex.index.tiers.make_tier`), a FAISS factory string for every layer
    (``Flat``, ``IVF1024,PQ64``, ``HNSW32``...), or any registered tier's string."""
    sketch_bytes: int = SKETCH_BYTES
    """Bytes per example of the sketch tier (int8 numbers plus a 4-byte scale)."""
    space: IndexSpace = field(default_factory=IndexSpace)
    """Raw or whitened vectors, normalized or not (:mod:`gradindex.index.space`)."""
    train_size: int = 0
    """Rows sampled (uniformly, seeded) to train IVF/PQ; 0 = 64 per IVF list, at least 16384."""
    seed: int = 0
    """Seed of the training sample."""
    block: int = 16384
    """Most rows read from the store and added per step ..."""
    block_bytes: int = 64 << 20
    """... and most bytes of float32 rows per step (memory: one block plus the index)."""
    checkpoint_seconds: float = 60.0
    """Write a resumable checkpoint of the layer in progress this often."""
    gpu: bool = True
    """Build on a GPU when FAISS sees one."""
