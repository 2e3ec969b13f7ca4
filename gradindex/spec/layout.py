"""Every path inside an index directory, named once (docs/design.md, "On disk: an index directory").

::

    INDEX_DIR/
      manifest.json          what built it (gradindex.spec.manifest)
      checksums.json         content hashes of the data files (gradindex.checksum)
      store/shard-NNNNN.h5   per-example rows (gradindex.store.shards)
      basis.h5               the row basis of whitened rows (gradindex.store.basis)
      precond/<method>.h5    fitted preconditioners (gradindex.precondition.files)
      faiss/<layer>.index    one FAISS index per layer, faiss/index.json, faiss/norms.npy (gradindex.index.files)
      optimizer/step-N.safetensors   Adam second moments saved during training
      capture/               rows captured during training, before assembly
      damaged/<time>/        files moved aside by a repair
      transcode.json         present while an in-place transcode swaps its rows in
      rotated.partial/       the fused transcode's rotated rows, while it runs (gradindex.precondition.rotated)
      fit-sample.partial/    a sampled build's fit sample and its fit, while it runs (gradindex.precondition.sampled)
      trajectory.json        a TracIn index over checkpoints (gradindex.apps.tracin)

A sharded index directory (gradindex.index.sharded) holds instead ``shards.json`` and ``part-NNNNN/`` index
directories; while ``gradindex build --parts`` runs (gradindex.index.build_parts), also ``unsplit.partial/`` (the
build before its split) and ``split.json`` (the split's plan, written before a file moves).

Modules that own a file keep writing and reading it; they take its name from here, so no other
module spells a file name as a string literal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
CHECKSUMS = "checksums.json"
STORE_DIR = "store"
SHARD_GLOB = "shard-*.h5"
BASIS_FILE = "basis.h5"
PRECOND_DIR = "precond"
FAISS_DIR = "faiss"
FAISS_META = "index.json"
FAISS_NORMS = "norms.npy"
OPTIMIZER_DIR = "optimizer"
CAPTURE_LOG_DIR = "capture"
DAMAGED_DIR = "damaged"
TRANSCODE_JOURNAL = "transcode.json"
TRANSCODE_STAGING = "eigenbasis.partial"
TRANSCODE_ROTATED = "rotated.partial"
FIT_SAMPLE_DIR = "fit-sample.partial"
TRAJECTORY = "trajectory.json"
SHARDS_FILE = "shards.json"
UNSPLIT_DIR = "unsplit.partial"
SPLIT_PLAN = "split.json"


def shard_name(k: int) -> str:
    """``shard-NNNNN.h5``: the ``k``-th committed shard of ``store/``."""
    return f"shard-{k:05d}.h5"


def faiss_name(layer: str) -> str:
    """The FAISS file name of one layer (path separators in the layer name replaced)."""
    return layer.replace(os.sep, "_") + ".index"


@dataclass(frozen=True)
class IndexLayout:
    """The paths of one index directory (nothing is read or created by building one)."""

    root: Path

    @classmethod
    def of(cls, index_dir: str | os.PathLike) -> IndexLayout:
        return cls(Path(index_dir))

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def checksums(self) -> Path:
        return self.root / CHECKSUMS

    @property
    def store(self) -> Path:
        return self.root / STORE_DIR

    def shard(self, k: int) -> Path:
        return self.store / shard_name(k)

    @property
    def basis(self) -> Path:
        return self.root / BASIS_FILE

    @property
    def precond(self) -> Path:
        return self.root / PRECOND_DIR

    def precond_file(self, method: str) -> Path:
        return self.precond / f"{method}.h5"

    @property
    def faiss(self) -> Path:
        return self.root / FAISS_DIR

    @property
    def damaged(self) -> Path:
        return self.root / DAMAGED_DIR

    @property
    def optimizer(self) -> Path:
        return self.root / OPTIMIZER_DIR

    def optimizer_state(self, step: int) -> Path:
        return self.optimizer / f"step-{step:07d}.safetensors"
