"""One layer's FAISS index file: built from the store (streaming, memory-bounded, resumable), read back checked
against the store, and searched (:class:`LayerIndex`).

While building, ``<layer>.index.partial`` (+ ``.json``) is a checkpoint of the layer in progress, written every
``checkpoint_seconds``; a re-run resumes from its vector count. FAISS ids are store rows ``0..N-1``, added in order.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
import torch

from gradindex.errors import CorruptFileError
from gradindex.index import gpu
from gradindex.index.config import IndexConfig
from gradindex.index.factory import apply_search_params, make_index, train_size
from gradindex.index.files import index_command, layer_path, write_index, write_json
from gradindex.index.space import Preconditioners, index_vectors
from gradindex.spec.manifest import IndexMismatchError
from gradindex.store import Store
from gradindex.store.rows import RowReader, iter_layer

log = logging.getLogger("gradindex")

SQ_TRAIN_ROWS = 4096
"""Rows a scalar quantizer without IVF trains on by default (its per-dimension ranges)."""


def rebuild_hint(index_dir: str | os.PathLike) -> str:
    return f"rebuild the indices with `{index_command(index_dir)}`"


@dataclass
class LayerIndex:
    """One layer's index, plus its vectors as an array when it is flat (exhaustive)."""

    name: str
    path: Path
    factory: str
    index: faiss.Index | None
    search_params: dict[str, int] = field(default_factory=dict)
    vectors: np.ndarray | None = None
    """``[N, D]`` float32 view of a flat index's storage (exhaustive scoring)."""
    device_vectors: list[torch.Tensor] = field(default_factory=list)
    """Row shards of ``vectors`` on the GPUs, when there are any."""
    coded: bool = False
    """A scalar-quantizer index scanned whole (``SQ4``...): every score, from the codes (approximate)."""
    tier: str | None = None
    """The tier's name when the layer has no FAISS file (``store``, ``sketch``...): the store's rows are its vectors."""

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


def block_rows(cfg: IndexConfig, dim: int) -> int:
    """Rows per step: at most ``cfg.block`` and ``cfg.block_bytes`` of float32 (16384 rows of 66k
    numbers were 4.3 GB a step, and their training sample as large again: the 50-70 vectors/s)."""
    return max(1, min(cfg.block, cfg.block_bytes // (4 * max(1, dim))))


def _resumed(partial: Path, side: Path, key: dict, layer: str, n: int) -> faiss.Index | None:
    """The checkpoint of an interrupted build of the same ``key`` (None: none, or a torn one)."""
    if not (partial.exists() and side.exists()):
        return None
    try:
        if json.loads(side.read_text()) == key:
            index = faiss.read_index(str(partial))
            log.info("resuming %s at %d/%d vectors", layer, index.ntotal, n)
            return index if index.ntotal <= n else None
    except (RuntimeError, json.JSONDecodeError):  # a torn checkpoint: start the layer over
        pass
    return None


def _trained(store: Store, layer: str, factory: str, cfg: IndexConfig, pre: Preconditioners,
             inv: np.ndarray | None) -> faiss.Index:
    """An empty index of ``factory``, trained on a seeded sample of the layer's rows where it needs training."""
    N, D = len(store), store.dims[layer]
    index = make_index(factory, D)
    n_train = train_size(index, N, cfg.train_size)
    if n_train and cfg.train_size <= 0 and not gpu.is_ivf(index):  # a scalar quantizer learns ranges only
        n_train = min(n_train, SQ_TRAIN_ROWS, block_rows(cfg, D) * 4)
    if n_train:
        rng = np.random.default_rng(cfg.seed)
        rows = np.sort(rng.choice(N, size=n_train, replace=False))
        x = RowReader(store, [layer]).read(rows)[layer]
        x = index_vectors(cfg.space, pre, layer, x, None if inv is None else inv[rows])
        gpu.train(index, x, cfg.gpu)
    return index


def build_layer(store: Store, layer: str, factory: str, cfg: IndexConfig, pre: Preconditioners,
                inv: np.ndarray | None, final: Path, key: dict, bar) -> tuple[faiss.Index, int]:
    """Train (on a sample), add every row in order with checkpoints, write ``final`` atomically."""
    N, D = len(store), store.dims[layer]
    partial = final.with_name(final.name + ".partial")
    side = partial.with_name(partial.name + ".json")
    index = _resumed(partial, side, key, layer, N)
    if index is None:
        index = _trained(store, layer, factory, cfg, pre, inv)
        write_index(index, partial)
        write_json(side, key)
    start = int(index.ntotal)
    bar.update(start)
    work = gpu.for_adding(index, cfg.gpu)
    last = time.perf_counter()
    for s, x in iter_layer(store, layer, start, block_rows(cfg, D)):
        work.add(index_vectors(cfg.space, pre, layer, x, None if inv is None else inv[s:s + len(x)]))
        bar.update(len(x))
        if time.perf_counter() - last >= cfg.checkpoint_seconds and s + len(x) < N:
            write_index(work, partial)
            last = time.perf_counter()
    index = gpu.to_cpu(work)
    if index.ntotal != N:
        raise RuntimeError(f"index of {layer!r} holds {index.ntotal} vectors, the store {N}")
    write_index(index, final, final.parent.parent)
    partial.unlink(missing_ok=True)
    side.unlink(missing_ok=True)
    return index, N - start
