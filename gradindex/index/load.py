"""Open an index directory's index for search (its tier, :mod:`gradindex.index.tiers`), checking it fits the store."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gradindex.checksum import damage_error
from gradindex.errors import CorruptFileError
from gradindex.index.files import NORMS, check_faiss, live_dir, read_meta_at, staging_dir
from gradindex.index.sketch import SketchIndex
from gradindex.index.space import IndexSpace
from gradindex.index.tiers import CandidateRequest, Candidates, TierSource, kind_of, tier_named
from gradindex.index.tiers.faiss_layers import LayerIndex, rebuild_hint
from gradindex.spec.manifest import IndexMismatchError, identity_differences, refuse_unfinished_transcode
from gradindex.store.opened import OpenStore

__all__ = ["IndexSet", "LayerIndex"]


def _check(meta: dict | None, d: Path, ix: OpenStore) -> dict:
    index_dir, n = ix.dir, ix.n
    refuse_unfinished_transcode(index_dir, ix.manifest, "query it")
    if meta is None and staging_dir(index_dir).exists():
        raise ValueError(f"the first index build in {str(staging_dir(index_dir))!r} did not finish; "
                         f"resume it with `gradindex index {index_dir}`")
    if meta is None:
        raise FileNotFoundError(
            f"no FAISS indices in {str(d)!r} (index.json is missing): searching needs them (exact scores, "
            f"QueryEngine.scores / score_matrix, do not); build them with `gradindex index {index_dir}`"
        )
    if meta.get("status") != "complete":
        raise ValueError(
            f"the index build in {str(d)!r} did not finish; resume it with `gradindex index {index_dir}`"
        )
    diffs = identity_differences(meta["key"]["identity"], ix.described.build)
    if diffs:
        raise IndexMismatchError(
            f"the FAISS indices in {str(d)!r} were built from another store: " + "; ".join(diffs)
            + f"; {rebuild_hint(index_dir)}"
        )
    if meta["examples"] != n:
        raise IndexMismatchError(
            f"the FAISS indices in {str(d)!r} cover {meta['examples']} examples but the store holds {n}; "
            + rebuild_hint(index_dir)
        )
    if n == 0:
        raise ValueError(f"the index in {str(index_dir)!r} is empty (0 examples); "
                         "build it from a non-empty data set")
    return meta


class IndexSet:
    """The index of an index directory, loaded once and kept in memory: its tier (:mod:`gradindex.index.tiers`,
    by the ``kind`` its ``index.json`` records) and the raw vectors' norms."""

    def __init__(self, ix: OpenStore, layers: Sequence[str] | None = None, use_gpu: bool = True):
        index_dir = self.dir = ix.dir
        self.folder = live_dir(index_dir)
        self.meta = _check(read_meta_at(self.folder), self.folder, ix)
        self.space = IndexSpace.from_dict(self.meta["space"])
        n = self.n = ix.n
        self.all_layers = list(ix.layers)
        chosen = list(layers) if layers is not None else self.all_layers
        self.kind = kind_of(self.meta)
        """The tier's name: ``store`` (exhaustive scan of the store), ``sketch`` (two stages), ``faiss``..."""
        cls = tier_named(self.kind)
        damage = [x for x in check_faiss(index_dir, True, cls.files(self.meta, chosen) + [NORMS])
                  if x.problem != "missing"]  # a missing file gets its own error below
        if damage:
            raise damage_error(index_dir, damage)
        for name in chosen:
            if name not in self.meta["layers"]:
                raise FileNotFoundError(f"no FAISS index for layer {name!r} in "
                                        f"{str(self.folder)!r}; " + rebuild_hint(index_dir))
        self.source = TierSource(self.dir, self.folder, self.meta, n, chosen, self.all_layers, self.space,
                                 self._norms(index_dir), ix.rows, use_gpu)
        self.tier = cls.load(self.source)
        self.layers: dict[str, LayerIndex] = getattr(self.tier, "layers", None) or {
            name: LayerIndex(name, self.folder, self.meta["layers"][name]["factory"], None, tier=self.kind)
            for name in chosen}
        """Per layer: its FAISS index, or (no FAISS file) a placeholder naming the tier."""

    @property
    def sq_norms(self) -> np.ndarray:
        """``[N, L]`` squared norms of the raw store vectors per layer."""
        return self.source.sq_norms

    @property
    def sketch(self) -> SketchIndex | None:
        """The sketch of a tier that has one (the ``sketch`` tier's first stage), else None."""
        return getattr(self.tier, "sketch", None)

    def candidates(self, req: CandidateRequest) -> Candidates:
        """The tier's first stage: per query, the ids the exact re-rank scores."""
        return self.tier.candidates(req)

    def _norms(self, index_dir) -> np.ndarray:
        p = self.folder / NORMS
        try:
            arr = np.load(p, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise CorruptFileError(f"{str(p)!r} is missing or corrupt ({e}); {rebuild_hint(index_dir)}") from None
        if arr.shape != (self.n, len(self.all_layers)):
            raise CorruptFileError(f"{str(p)!r} has shape {arr.shape}, expected {(self.n, len(self.all_layers))}; "
                          + rebuild_hint(index_dir))
        return np.asarray(arr)

    def norms(self, layers: Sequence[str] | None = None) -> np.ndarray:
        """``[N]`` float64 norms of the raw store vectors over ``layers`` (all by default)."""
        return self.source.norms(layers)

    def nbytes(self) -> int:
        """Bytes of the index files on disk (the sketch's included)."""
        return self.tier.nbytes()
