"""Build one FAISS index per layer from the store: streaming, memory-bounded, resumable.

Files under ``INDEX_DIR/faiss/``:

* ``index.json``: the space (raw/whitened, normalized), the store identity it was built from,
  and per layer the factory string, file, vector count, size and default search knobs; its
  ``status`` is ``complete`` only when every layer is written;
* ``<layer>.index``: the layer's index (FAISS ids are store rows ``0..N-1``, added in order);
* ``norms.npy``: ``[N, L]`` float32 squared norms of each example's raw vectors per layer (cosine);
* while building, ``<layer>.index.partial`` (+ ``.json``): a checkpoint of the layer in progress,
  written every ``checkpoint_seconds``; a re-run resumes from its vector count.
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
from tqdm.auto import tqdm

from gradindex.checksum import damage_error, move_aside
from gradindex.index import gpu
from gradindex.index.factory import default_search_params, make_index, resolve_factory, train_size
from gradindex.index.files import (
    META,
    NORMS,
    check_faiss,
    faiss_dir,
    layer_file,
    read_meta,
    write_index,
    write_json,
    write_norms,
)
from gradindex.index.rows import RowReader, iter_layer
from gradindex.index.space import IndexSpace, Preconditioners, index_vectors
from gradindex.lock import index_lock
from gradindex.manifest import FORMAT_VERSION, read_complete_manifest, read_manifest, write_manifest
from gradindex.store import Store
from gradindex.store.repair import check_store

log = logging.getLogger("gradindex")

@dataclass(frozen=True)
class IndexConfig:
    """Settings of an index build; serialized into ``faiss/index.json``."""

    factory: str = "auto"
    """FAISS factory string for every layer (``Flat``, ``IVF1024,PQ64``, ``HNSW32``...), or
    ``auto`` for the per-layer default of :func:`gradindex.index.factory.default_factory`."""
    space: IndexSpace = field(default_factory=IndexSpace)
    """Raw or whitened vectors, normalized or not (:mod:`gradindex.index.space`)."""
    train_size: int = 0
    """Rows sampled (uniformly, seeded) to train IVF/PQ; 0 = 64 per IVF list, at least 16384."""
    seed: int = 0
    """Seed of the training sample."""
    block: int = 16384
    """Rows read from the store and added per step (memory: one block plus the index)."""
    checkpoint_seconds: float = 60.0
    """Write a resumable checkpoint of the layer in progress this often."""
    gpu: bool = True
    """Build on a GPU when FAISS sees one."""


@dataclass
class IndexBuildResult:
    faiss_dir: Path
    meta: dict
    seconds: float
    rows_added: int
    up_to_date: bool = False


def build_indices(index_dir: str | os.PathLike, cfg: IndexConfig = IndexConfig(),
                  progress: bool = True, force: bool = False) -> IndexBuildResult:
    """Write ``faiss/<layer>.index`` for every stored layer (resuming an interrupted build)."""
    with index_lock(index_dir, "gradindex index"):
        return _build_indices(index_dir, cfg, progress, force)


def _build_indices(index_dir: str | os.PathLike, cfg: IndexConfig, progress: bool, force: bool) -> IndexBuildResult:
    t0 = time.perf_counter()
    manifest = read_complete_manifest(index_dir, "build the indices")
    damage = check_store(index_dir, full=True, manifest=manifest)
    if damage:
        raise damage_error(index_dir, damage, then=f"`gradindex index {index_dir}`")
    for p in move_aside(index_dir, [x.file for x in check_faiss(index_dir) if x.problem != "missing"]):
        log.warning("%s is damaged; moved to %s and rebuilt", p.name, p.parent)
    with Store(index_dir) as store:
        N = len(store)
        if N == 0:
            raise ValueError(f"the store in {str(index_dir)!r} holds no examples; nothing to index")
        space = cfg.space
        pre = Preconditioners(index_dir)
        if space.whiten != "none":
            pre.check(space.whiten)
        factories = {n: resolve_factory(cfg.factory, N, store.dims[n]) for n in store.layers}
        key = {"identity": manifest["build"], "examples": N, "space": space.to_dict(),
               "preconditioner": manifest.get("preconditioners", {}).get(space.whiten),
               "train_size": cfg.train_size, "seed": cfg.seed}
        out = faiss_dir(index_dir)
        out.mkdir(exist_ok=True)
        old = read_meta(index_dir)
        if (not force and old and old.get("status") == "complete" and old.get("key") == key
                and {n: e["factory"] for n, e in old["layers"].items()} == factories
                and all(layer_file(index_dir, n).exists() for n in factories)):
            return IndexBuildResult(out, old, time.perf_counter() - t0, 0, up_to_date=True)
        same_key = old is not None and old.get("key") == key and not force
        meta = {"format_version": FORMAT_VERSION, "status": "building", "key": key, "space": space.to_dict(),
                "examples": N, "layers": dict(old["layers"]) if same_key else {},
                "norms": old.get("norms") if same_key else None}
        write_json(out / META, meta)
        norms = _norms(store, out / NORMS, meta, progress)
        write_json(out / META, meta)
        inv = np.where(norms > 0, 1.0 / np.sqrt(np.maximum(norms, 1e-300)), 0.0).astype(np.float32)
        bar = tqdm(total=N * len(store.layers), unit="vec", desc="index", disable=not progress,
                   dynamic_ncols=True)
        added = 0
        try:
            for n in store.layers:
                entry = meta["layers"].get(n)
                if entry and entry["factory"] == factories[n] and layer_file(index_dir, n).exists():
                    bar.update(N)
                    continue
                bar.set_postfix_str(n)
                index, k = _build_layer(store, n, factories[n], cfg, pre, inv if space.normalize else None,
                                        layer_file(index_dir, n), {**key, "factory": factories[n]}, bar)
                added += k
                meta["layers"][n] = {
                    "file": layer_file(index_dir, n).name, "factory": factories[n], "dim": store.dims[n],
                    "ntotal": int(index.ntotal), "bytes": layer_file(index_dir, n).stat().st_size,
                    "search": default_search_params(index)}
                write_json(out / META, meta)
                del index
        finally:
            bar.close()
    meta["status"] = "complete"
    meta["seconds"] = time.perf_counter() - t0
    write_json(out / META, meta)
    _register(index_dir, meta)
    return IndexBuildResult(out, meta, meta["seconds"], added)


def _norms(store: Store, path: Path, meta: dict, progress: bool) -> np.ndarray:
    """``[N, L]`` per-layer squared norms of the raw store vectors (one pass, cached)."""
    if meta.get("norms") and path.exists():
        try:
            arr = np.load(path)
            if arr.shape == (len(store), len(store.layers)):
                return arr.sum(axis=1)
        except (OSError, ValueError):
            pass
    sq = np.zeros((len(store), len(store.layers)), dtype=np.float32)
    for j, n in enumerate(tqdm(store.layers, desc="norms", disable=not progress, leave=False)):
        for s, x in iter_layer(store, n):
            sq[s:s + len(x), j] = np.einsum("ij,ij->i", x, x, dtype=np.float64)
    write_norms(store.dir.parent, sq)
    meta["norms"] = {"file": path.name, "layers": list(store.layers)}
    return sq.sum(axis=1)


def _build_layer(store: Store, layer: str, factory: str, cfg: IndexConfig, pre: Preconditioners,
                 inv: np.ndarray | None, final: Path, key: dict, bar) -> tuple[faiss.Index, int]:
    """Train (on a sample), add every row in order with checkpoints, write ``final`` atomically."""
    N, D = len(store), store.dims[layer]
    partial = final.with_name(final.name + ".partial")
    side = partial.with_name(partial.name + ".json")
    index = None
    if partial.exists() and side.exists():
        try:
            if json.loads(side.read_text()) == key:
                index = faiss.read_index(str(partial))
                log.info("resuming %s at %d/%d vectors", layer, index.ntotal, N)
        except (RuntimeError, json.JSONDecodeError):  # a torn checkpoint: start the layer over
            index = None
    if index is None or index.ntotal > N:
        index = make_index(factory, D)
        n_train = train_size(index, N, cfg.train_size)
        if n_train:
            rng = np.random.default_rng(cfg.seed)
            rows = np.sort(rng.choice(N, size=n_train, replace=False))
            x = RowReader(store, [layer]).read(rows)[layer]
            x = index_vectors(cfg.space, pre, layer, x, None if inv is None else inv[rows])
            gpu.train(index, x, cfg.gpu)
        write_index(index, partial)
        write_json(side, key)
    start = int(index.ntotal)
    bar.update(start)
    work = gpu.for_adding(index, cfg.gpu)
    last = time.perf_counter()
    for s, x in iter_layer(store, layer, start, cfg.block):
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


def _register(index_dir: str | os.PathLike, meta: dict) -> None:
    """Record the index types in the manifest (re-read first: other stages write it too)."""
    manifest = read_manifest(index_dir)
    manifest["index"] = {"space": meta["space"], "status": meta["status"],
                         "factories": sorted({e["factory"] for e in meta["layers"].values()}),
                         "bytes": int(sum(e["bytes"] for e in meta["layers"].values()))}
    write_manifest(index_dir, manifest)
