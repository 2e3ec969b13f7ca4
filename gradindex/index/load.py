"""Open an index directory's per-layer FAISS indices for search, checking they fit the store."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
import torch

from gradindex.checksum import damage_error
from gradindex.errors import CorruptFileError
from gradindex.index import gpu
from gradindex.index.cost import TIERS
from gradindex.index.factory import apply_search_params, is_coded_exhaustive, is_exhaustive
from gradindex.index.files import NORMS, check_faiss, index_command, layer_path, live_dir, read_meta_at, staging_dir
from gradindex.index.scan import StoreScan
from gradindex.index.sketch import SketchIndex
from gradindex.index.space import IndexSpace
from gradindex.index.tier import load_sketch, sketch_files
from gradindex.manifest import IndexMismatchError, identity_differences, refuse_unfinished_transcode
from gradindex.store.rows import RowReader


def rebuild_hint(index_dir: str | os.PathLike) -> str:
    return f"rebuild the indices with `{index_command(index_dir)}`"


@dataclass
class LayerIndex:
    """One layer's index, plus its vectors as an array when it is flat (exhaustive)."""

    name: str
    path: Path
    factory: str
    index: faiss.Index
    search_params: dict[str, int] = field(default_factory=dict)
    vectors: np.ndarray | None = None
    """``[N, D]`` float32 view of a flat index's storage (exhaustive scoring)."""
    device_vectors: list[torch.Tensor] = field(default_factory=list)
    """Row shards of ``vectors`` on the GPUs, when there are any."""

    coded: bool = False
    """A scalar-quantizer index scanned whole (``SQ4``...): every score, from the codes (approximate)."""
    tier: str | None = None
    """``store`` or ``sketch``: no FAISS file for the layer; the store's codes are its vectors."""

    @property
    def exhaustive(self) -> bool:
        return self.vectors is not None or self.coded or self.tier == "store"

    def scores(self, u: np.ndarray) -> np.ndarray:
        """``[Q, N]`` float32 inner products of queries ``u`` ``[Q, D]`` with every vector."""
        if self.coded:  # FAISS's SIMD scan of the codes, every example returned
            n = self.index.ntotal
            d, i = self.index.search(np.ascontiguousarray(u, np.float32), n)
            out = np.zeros((len(u), n), np.float32)
            np.put_along_axis(out, np.where(i >= 0, i, 0), np.where(i >= 0, d, 0.0), axis=1)
            return out
        if self.device_vectors:
            parts = [(torch.from_numpy(u).to(x.device) @ x.T).cpu() for x in self.device_vectors]
            return torch.cat(parts, dim=1).numpy()
        return u @ self.vectors.T

    def search(self, u: np.ndarray, k: int, params: dict[str, int] | None = None) -> np.ndarray:
        """``[Q, k]`` ids of the approximate top-``k`` inner products (-1 where fewer)."""
        params = {**self.search_params, **(params or {})}
        if "efSearch" in params:  # HNSW returns at most efSearch results
            params["efSearch"] = max(params["efSearch"], int(k))
        apply_search_params(self.index, params)
        _, ids = self.index.search(np.ascontiguousarray(u, dtype=np.float32), int(k))
        return ids


def _check(meta: dict | None, d: Path, index_dir: str | os.PathLike, manifest: dict, n: int) -> dict:
    refuse_unfinished_transcode(index_dir, manifest, "query it")
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
    diffs = identity_differences(meta["key"]["identity"], manifest["build"])
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


def read_layer(index_dir: str | os.PathLike, folder: Path, layer: str, entry: dict, n: int) -> faiss.Index:
    """Read one layer's index file; a missing, truncated or corrupt file is a clear error."""
    p = layer_path(folder, layer)
    if not p.exists():
        raise FileNotFoundError(f"FAISS index file {str(p)!r} is missing; {rebuild_hint(index_dir)}")
    size = p.stat().st_size
    if entry.get("bytes") and size != entry["bytes"]:
        raise CorruptFileError(f"FAISS index file {str(p)!r} has {size} bytes, {entry['bytes']} were written "
                      f"(truncated or replaced); {rebuild_hint(index_dir)}")
    try:
        index = faiss.read_index(str(p))
    except RuntimeError as e:
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
        raise CorruptFileError(f"FAISS index file {str(p)!r} is corrupt ({msg}); {rebuild_hint(index_dir)}") from None
    if index.ntotal != n or index.d != entry["dim"]:
        raise IndexMismatchError(
            f"FAISS index file {str(p)!r} holds {index.ntotal} vectors of dimension {index.d}, "
            f"the store {n} of dimension {entry['dim']}; {rebuild_hint(index_dir)}")
    return index


class IndexSet:
    """The per-layer indices of an index directory, loaded once and kept in memory."""

    def __init__(self, index_dir: str | os.PathLike, manifest: dict, n: int,
                 layers: Sequence[str] | None = None, use_gpu: bool = True, rows: RowReader | None = None):
        self.dir = Path(index_dir)
        self.folder = live_dir(index_dir)
        self.meta = _check(read_meta_at(self.folder), self.folder, index_dir, manifest, n)
        self.space = IndexSpace.from_dict(self.meta["space"])
        self.n = n
        self.all_layers = list(manifest["build"]["layers"])
        chosen = list(layers) if layers is not None else self.all_layers
        self.layers: dict[str, LayerIndex] = {}
        files = [layer_path(self.folder, n).name for n in chosen
                 if self.meta["layers"].get(n, {}).get("factory") not in TIERS]
        damage = [x for x in check_faiss(index_dir, True, files + [NORMS] + sketch_files(self.meta))
                  if x.problem != "missing"]  # a missing file gets its own error below
        if damage:
            raise damage_error(index_dir, damage)
        for name in chosen:
            entry = self.meta["layers"].get(name)
            if entry is None:
                raise FileNotFoundError(f"no FAISS index for layer {name!r} in "
                                        f"{str(self.folder)!r}; " + rebuild_hint(index_dir))
            if entry["factory"] in TIERS:
                self.layers[name] = LayerIndex(name, self.folder, entry["factory"], None, tier=entry["factory"])
                continue
            index = read_layer(index_dir, self.folder, name, entry, n)
            li = LayerIndex(name, layer_path(self.folder, name), entry["factory"], index,
                            dict(entry.get("search", {})))
            if is_exhaustive(index):
                flat = faiss.downcast_index(index)
                li.vectors = faiss.rev_swig_ptr(flat.get_xb(), n * index.d).reshape(n, index.d)
                if use_gpu and gpu.num_gpus() > 0 and torch.cuda.is_available():
                    shards = np.array_split(np.arange(n), min(gpu.num_gpus(), torch.cuda.device_count()))
                    li.device_vectors = [torch.from_numpy(li.vectors[s[0]:s[-1] + 1]).to(f"cuda:{i}")
                                         for i, s in enumerate(shards) if len(s)]
            else:
                li.coded = is_coded_exhaustive(index)
                li.index = gpu.for_search(index, use_gpu)
            self.layers[name] = li
        self.sq_norms = self._norms(index_dir)
        self.kind = self.meta.get("kind") or ("sketch" if self.meta.get("sketch") else "faiss")
        """``store`` (exhaustive scan of the store), ``sketch`` (two tiers) or ``faiss`` (per-layer indices)."""
        self.sketch: SketchIndex | None = None
        if self.meta.get("sketch"):
            try:
                self.sketch = load_sketch(self.folder, self.meta, n)
            except (OSError, ValueError) as e:
                raise CorruptFileError(f"the sketch tier in {str(self.folder)!r} is unreadable ({e}); "
                              + rebuild_hint(index_dir)) from None
        self._rows = rows
        self._scan: StoreScan | None = None

    def store_scan(self) -> StoreScan:
        """The exhaustive scan of the store's codes (needs the store's row reader)."""
        if self._scan is None:
            if self._rows is None:
                raise RuntimeError("this index set was opened without the store's rows; open it through OpenIndex")
            self._scan = StoreScan(self._rows)
        return self._scan

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
        cols = [self.all_layers.index(n) for n in (layers or self.all_layers)]
        return np.sqrt(self.sq_norms[:, cols].sum(axis=1, dtype=np.float64))

    def nbytes(self) -> int:
        """Bytes of the index files on disk (the sketch's included)."""
        files = [li.path for li in self.layers.values() if li.tier is None]
        files += [self.folder / f for f in sketch_files(self.meta)]
        return int(sum(p.stat().st_size for p in files))
