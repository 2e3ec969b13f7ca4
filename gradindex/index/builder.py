"""Build one FAISS index per layer from the store: streaming, memory-bounded, resumable.

Files under ``INDEX_DIR/faiss/`` (written into ``faiss.new/`` and swapped in when complete:
:mod:`gradindex.index.files`):

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
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from gradindex.checksum import damage_error, forget, move_aside, record, recorded
from gradindex.index import gpu
from gradindex.index.cost import TIERS, choose_kind
from gradindex.index.factory import default_search_params, make_index, resolve_factory, train_size
from gradindex.index.files import (
    META,
    NORMS,
    check_faiss,
    faiss_dir,
    layer_path,
    read_meta_at,
    settle_swap,
    staging_dir,
    swap_in,
    write_index,
    write_json,
    write_norms,
)
from gradindex.index.opened import OpenIndex, open_index
from gradindex.index.sketch import SKETCH_BYTES
from gradindex.index.space import IndexSpace, Preconditioners, index_vectors
from gradindex.index.tier import build_sketch, sketch_files
from gradindex.lock import index_lock
from gradindex.manifest import FORMAT_VERSION, refuse_unfinished_transcode, write_manifest
from gradindex.progress import progress_bar
from gradindex.store import Store
from gradindex.store.repair import check_store
from gradindex.store.rows import RowReader, iter_layer

log = logging.getLogger("gradindex")

@dataclass(frozen=True)
class IndexConfig:
    """Settings of an index build; serialized into ``faiss/index.json``."""

    factory: str = "auto"
    """The index kind: ``store`` (exhaustive: queries scan the store's own codes, no FAISS copy),
    ``sketch`` (two tiers: an in-RAM sketch of every whole-model row, then an exact re-rank of its
    top candidates), ``auto`` (:func:`gradindex.index.cost.choose_kind` by ``N``, row size and RAM),
    or a FAISS factory string for every layer (``Flat``, ``IVF1024,PQ64``, ``HNSW32``...)."""
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


@dataclass
class IndexBuildResult:
    faiss_dir: Path
    meta: dict
    seconds: float
    rows_added: int
    up_to_date: bool = False


def build_indices(index_dir: str | os.PathLike | OpenIndex, cfg: IndexConfig = IndexConfig(),
                  progress: bool = True, force: bool = False) -> IndexBuildResult:
    """Write ``faiss/<layer>.index`` for every stored layer (resuming an interrupted build).

    The new set is written into ``faiss.new/`` and swapped in only when complete, so a failed or
    killed build (``force`` included) leaves the previous indices answering queries.
    ``index_dir``: a path, or an :class:`OpenIndex` (its manifest and store are used as they are).
    """
    t0 = time.perf_counter()
    ix, opened = open_index(index_dir, then="build the indices")
    try:
        with index_lock(ix.dir, "gradindex index"):
            return _build(ix, cfg, progress, force, t0)
    finally:
        if opened:
            ix.close()


def _build(ix: OpenIndex, cfg: IndexConfig, progress: bool, force: bool, t0: float) -> IndexBuildResult:
    index_dir, store, manifest, N = ix.dir, ix.store, ix.manifest, ix.n
    refuse_unfinished_transcode(index_dir, manifest, f"index it with `gradindex index {index_dir}` if need be")
    damage = check_store(index_dir, full=True, manifest=manifest)
    if damage:
        raise damage_error(index_dir, damage, then=f"`gradindex index {index_dir}`")
    if N == 0:
        raise ValueError(f"the store in {str(index_dir)!r} holds no examples; nothing to index")
    space = cfg.space
    if space.whiten != "none":
        ix.pre.check(space.whiten)
    storage = manifest["build"].get("storage", "fp32")
    kind = index_kind(cfg.factory, N, store, space)
    factories = {n: kind if kind in TIERS else resolve_factory(cfg.factory, N, store.dims[n], storage)
                 for n in store.layers}
    key = {"identity": manifest["build"], "examples": N, "space": space.to_dict(),
           "preconditioner": manifest.get("preconditioners", {}).get(space.whiten),
           "train_size": cfg.train_size, "seed": cfg.seed}
    if kind == "sketch":
        key["sketch_bytes"] = cfg.sketch_bytes
    settle_swap(index_dir)
    for p in move_aside(index_dir, [x.file for x in check_faiss(index_dir) if x.problem != "missing"]):
        log.warning("%s is damaged; moved to %s and rebuilt", p.name, p.parent)
    live, out = faiss_dir(index_dir), staging_dir(index_dir)
    old = read_meta_at(live)
    if (not force and old and old.get("status") == "complete" and old.get("key") == key
            and {n: e["factory"] for n, e in old["layers"].items()} == factories
            and all(layer_path(live, n).exists() for n, f in factories.items() if f not in TIERS)
            and all((live / f).exists() for f in sketch_files(old))):
        return IndexBuildResult(live, old, time.perf_counter() - t0, 0, up_to_date=True)
    meta = _staged_meta(index_dir, live, out, old, key, factories, kind, space, N, force)
    write_json(out / META, meta)
    norms = _norms(store, out / NORMS, meta, progress)
    write_json(out / META, meta)
    inv = np.where(norms > 0, 1.0 / np.sqrt(np.maximum(norms, 1e-300)), 0.0).astype(np.float32)
    bar = progress_bar(total=N * len(store.layers), unit="vec", desc="index", disable=not progress)
    added = 0
    try:
        for n in store.layers:
            path = layer_path(out, n)
            entry = meta["layers"].get(n)
            if factories[n] in TIERS:  # nothing per layer: the store's codes are the vectors
                meta["layers"][n] = {"file": None, "factory": factories[n], "dim": store.dims[n], "ntotal": N,
                                     "bytes": 0, "search": {}}
                bar.update(N)
                continue
            if entry and entry["factory"] == factories[n] and path.exists():
                bar.update(N)
                continue
            bar.set_postfix_str(n)
            index, k = _build_layer(store, n, factories[n], cfg, ix.pre, inv if space.normalize else None,
                                    path, {**key, "factory": factories[n]}, bar)
            added += k
            meta["layers"][n] = {"file": path.name, "factory": factories[n], "dim": store.dims[n],
                                 "ntotal": int(index.ntotal), "bytes": path.stat().st_size,
                                 "search": default_search_params(index)}
            write_json(out / META, meta)
            del index
    finally:
        bar.close()
    if kind == "sketch":
        build_sketch(ix, cfg, out, meta, inv if space.normalize else None, progress)
    meta["status"] = "complete"
    meta["seconds"] = time.perf_counter() - t0
    write_json(out / META, meta)
    swap_in(index_dir)
    _register(index_dir, manifest, meta)
    return IndexBuildResult(live, meta, meta["seconds"], added)


def _staged_meta(index_dir, live, out, old: dict | None, key: dict, factories: dict, kind: str, space, N: int,
                 force: bool) -> dict:
    """The staging directory's ``index.json`` to build on: an interrupted build of the same key resumed, else
    a fresh staging directory holding what the live indices still have valid."""
    staged = read_meta_at(out) if out.exists() else None
    meta = {"format_version": FORMAT_VERSION, "status": "building", "key": key, "space": space.to_dict(),
            "examples": N, "layers": {}, "norms": None, "kind": kind}
    if staged is not None and staged.get("key") == key and not force:  # resume the interrupted build
        meta["layers"], meta["norms"] = dict(staged["layers"]), staged.get("norms")
        if staged.get("sketch"):
            meta["sketch"] = staged["sketch"]
        return meta
    shutil.rmtree(out, ignore_errors=True)
    forget(index_dir, recorded(index_dir, f"{out.name}/"))
    out.mkdir()
    if old is not None and old.get("key") == key and not force:  # keep what is still valid
        meta["norms"] = old.get("norms") if _carry(live, out, NORMS if old.get("norms") else None) else None
        meta["layers"] = {n: e for n, e in old["layers"].items()
                          if e["factory"] == factories.get(n) and _carry(live, out, e["file"])}
    return meta


SQ_TRAIN_ROWS = 4096
"""Rows a scalar quantizer without IVF trains on by default (its per-dimension ranges)."""


def block_rows(cfg: IndexConfig, dim: int) -> int:
    """Rows per step: at most ``cfg.block`` and ``cfg.block_bytes`` of float32 (16384 rows of 66k
    numbers were 4.3 GB a step, and their training sample as large again: the 50-70 vectors/s)."""
    return max(1, min(cfg.block, cfg.block_bytes // (4 * max(1, dim))))


def _ivf_free(index: faiss.Index) -> bool:
    try:
        faiss.extract_index_ivf(index)
        return False
    except RuntimeError:
        return True


def index_kind(factory: str, n: int, store: Store, space: IndexSpace = IndexSpace()) -> str:
    """``store``, ``sketch`` or ``faiss`` (a factory string per layer) for ``IndexConfig.factory``.

    ``store`` scans the stored rows as they are, so it needs the raw space; ``auto`` in a whitened
    or normalized space is the per-layer FAISS default (:func:`gradindex.index.factory.default_factory`).
    """
    f = (factory or "auto").strip().lower()
    raw = space.whiten == "none" and not space.normalize
    if f == "auto":
        return choose_kind(n, sum(store.dims.values()), store.storage) if raw else "faiss"
    if f == "store" and not raw:
        raise ValueError("--index-type store scans the stored rows as they are, so it cannot hold whitened "
                         "or normalized vectors; use --index-type sketch (or a FAISS type) with --whiten/--normalize")
    return f if f in TIERS else "faiss"


def _carry(src: Path, dst: Path, name: str | None) -> bool:
    """Hard-link (else copy) ``src/name`` into ``dst`` and record its hash there; whether there was one."""
    if not name or not (src / name).exists():
        return False
    try:
        os.link(src / name, dst / name)
    except OSError:
        shutil.copy2(src / name, dst / name)
    record(dst.parent, [dst / name], [f"{dst.name}/{name}"])
    return True


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
    for j, n in enumerate(progress_bar(store.layers, desc="norms", disable=not progress, leave=False)):
        for s, x in iter_layer(store, n, 0, max(1, (64 << 20) // (4 * max(1, store.dims[n])))):  # 64 MB a block
            sq[s:s + len(x), j] = np.einsum("ij,ij->i", x, x, dtype=np.float64)
    write_norms(path.parent, sq)
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
        if n_train and cfg.train_size <= 0 and _ivf_free(index):  # a scalar quantizer learns ranges only
            n_train = min(n_train, SQ_TRAIN_ROWS, block_rows(cfg, D) * 4)
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


def _register(index_dir: Path, manifest: dict, meta: dict) -> None:
    """Record the index types in the manifest (the open index's copy, then the file)."""
    manifest["index"] = {"space": meta["space"], "status": meta["status"],
                         "factories": sorted({e["factory"] for e in meta["layers"].values()}),
                         "kind": meta.get("kind", "faiss"),
                         "bytes": int(sum(e["bytes"] for e in meta["layers"].values())
                                      + (meta.get("sketch") or {}).get("bytes", 0))}
    write_manifest(index_dir, manifest)
