"""Build the index of a store: the tier its factory string picks (:mod:`gradindex.index.tiers`), resumable.

Files under ``INDEX_DIR/faiss/`` (written into ``faiss.new/`` and swapped in when complete:
:mod:`gradindex.index.files`):

* ``index.json``: the tier (``kind``), the space (raw/whitened, normalized), the store identity it was
  built from, and per layer the factory string, file, vector count, size and default search knobs;
  its ``status`` is ``complete`` only when the tier's build is;
* ``norms.npy``: ``[N, L]`` float32 squared norms of each example's raw vectors per layer (cosine);
* the tier's own files: the FAISS tier's ``<layer>.index`` (:mod:`gradindex.index.tiers.faiss_layers`),
  the sketch tier's ``sketch.*`` (:mod:`gradindex.index.tiers.sketch_files`); the store tier has none.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gradindex.checksum import damage_error, forget, move_aside, record, recorded
from gradindex.distributed import SOLO, Share, Team
from gradindex.index.config import IndexConfig
from gradindex.index.files import (
    META,
    NORMS,
    check_faiss,
    faiss_dir,
    link_or_copy,
    read_meta_at,
    settle_swap,
    staging_dir,
    swap_in,
    write_json,
    write_norms,
)
from gradindex.index.opened import OpenIndex
from gradindex.index.tiers import BuildJob, RowShape, Tier, make_tier
from gradindex.lock import index_lock
from gradindex.progress import progress_bar
from gradindex.spec.manifest import FORMAT_VERSION, refuse_unfinished_transcode, write_manifest
from gradindex.store import Store
from gradindex.store.opened import opened
from gradindex.store.repair import check_store

__all__ = ["IndexBuildResult", "IndexConfig", "build_indices"]

log = logging.getLogger("gradindex")

@dataclass
class IndexBuildResult:
    faiss_dir: Path
    meta: dict
    seconds: float
    rows_added: int
    up_to_date: bool = False


def build_indices(index_dir: str | os.PathLike | OpenIndex, cfg: IndexConfig = IndexConfig(),
                  progress: bool = True, force: bool = False,
                  share: Share | None = None) -> IndexBuildResult:
    """Write ``faiss/<layer>.index`` for every stored layer (resuming an interrupted build).

    The new set is written into ``faiss.new/`` and swapped in only when complete, so a failed or
    killed build (``force`` included) leaves the previous indices answering queries.
    ``index_dir``: a path, or an :class:`OpenIndex` (its manifest and store are used as they are).
    ``share``: a torchrun build's rank 0 hands a per-file pass to the other ranks with it, ``share(kind, *args)``
    (``"norms"``: they run :func:`row_norms` over the same store with the :class:`~gradindex.distributed.Team` it
    returns; ``"sketch"``: :func:`~gradindex.index.tiers.sketch_files.encode_files`; ``"ivf"``:
    :func:`~gradindex.index.tiers.ivf_sketch.assign`).
    """
    t0 = time.perf_counter()
    with opened(index_dir, "build the indices", OpenIndex) as ix:
        with index_lock(ix.dir, "gradindex index"):
            return _build(ix, cfg, progress, force, t0, share)


def _build(ix: OpenIndex, cfg: IndexConfig, progress: bool, force: bool, t0: float,
           share: Share | None = None) -> IndexBuildResult:
    index_dir, store, manifest, N = ix.dir, ix.store, ix.manifest, ix.n
    _refuse(ix)
    space = cfg.space
    if space.whiten != "none":
        ix.pre.check(space.whiten)
    storage = ix.described.storage
    tier = make_tier(cfg, RowShape.of(N, list(store.dims.values()), store.storage))
    factories = tier.layer_factories(N, {n: store.dims[n] for n in store.layers}, storage)
    key = {"identity": ix.described.build, "examples": N, "space": space.to_dict(),
           "preconditioner": ix.described.preconditioners.get(space.whiten),
           "train_size": cfg.train_size, "seed": cfg.seed, **tier.key()}
    settle_swap(index_dir)
    for p in move_aside(index_dir, [x.file for x in check_faiss(index_dir) if x.problem != "missing"]):
        log.warning("%s is damaged; moved to %s and rebuilt", p.name, p.parent)
    live, out = faiss_dir(index_dir), staging_dir(index_dir)
    old = read_meta_at(live)
    if (not force and old and old.get("status") == "complete" and old.get("key") == key
            and {n: e["factory"] for n, e in old["layers"].items()} == factories
            and all((live / f).exists() for f in tier.files(old))):
        return IndexBuildResult(live, old, time.perf_counter() - t0, 0, up_to_date=True)
    meta = _staged_meta(index_dir, live, out, old, key, factories, tier.name, space, N, force)
    write_json(out / META, meta)
    norms = _norms(store, out / NORMS, meta, progress, share)
    write_json(out / META, meta)
    inv = np.where(norms > 0, 1.0 / np.sqrt(np.maximum(norms, 1e-300)), 0.0).astype(np.float32)
    job = BuildJob(store, ix.pre, cfg, out, meta, key, factories, inv if space.normalize else None, progress, share)
    added = tier.build(job)
    meta["status"] = "complete"
    meta["seconds"] = time.perf_counter() - t0
    write_json(out / META, meta)
    swap_in(index_dir)
    _register(index_dir, manifest, meta, type(tier))
    return IndexBuildResult(live, meta, meta["seconds"], added)


def _refuse(ix: OpenIndex) -> None:
    """Refuse to index an unfinished transcode, a damaged store or an empty one."""
    refuse_unfinished_transcode(ix.dir, ix.manifest, f"index it with `gradindex index {ix.dir}` if need be")
    damage = check_store(ix.dir, full=True, manifest=ix.manifest)
    if damage:
        raise damage_error(ix.dir, damage, then=f"`gradindex index {ix.dir}`")
    if ix.n == 0:
        raise ValueError(f"the store in {str(ix.dir)!r} holds no examples; nothing to index")


def _staged_meta(index_dir, live, out, old: dict | None, key: dict, factories: dict, kind: str, space, N: int,
                 force: bool) -> dict:
    """The staging directory's ``index.json`` to build on: an interrupted build of the same key resumed, else
    a fresh staging directory holding what the live indices still have valid."""
    staged = read_meta_at(out) if out.exists() else None
    meta = {"format_version": FORMAT_VERSION, "status": "building", "key": key, "space": space.to_dict(),
            "examples": N, "layers": {}, "norms": None, "kind": kind}
    if staged is not None and staged.get("key") == key and not force:  # resume the interrupted build
        meta["layers"], meta["norms"] = dict(staged["layers"]), staged.get("norms")
        meta.update({k: v for k, v in staged.items() if k not in meta})  # the tier's own entries (a sketch's rows)
        return meta
    shutil.rmtree(out, ignore_errors=True)
    forget(index_dir, recorded(index_dir, f"{out.name}/"))
    out.mkdir()
    if old is not None and old.get("key") == key and not force:  # keep what is still valid
        meta["norms"] = old.get("norms") if _carry(live, out, NORMS if old.get("norms") else None) else None
        meta["layers"] = {n: e for n, e in old["layers"].items()
                          if e["factory"] == factories.get(n) and _carry(live, out, e["file"])}
    return meta


def _carry(src: Path, dst: Path, name: str | None) -> bool:
    """Hard-link (else copy) ``src/name`` into ``dst`` and record its hash there; whether there was one."""
    if not name or not (src / name).exists():
        return False
    link_or_copy(src / name, dst / name)
    record(dst.parent, [dst / name], [f"{dst.name}/{name}"])
    return True


def _norms(store: Store, path: Path, meta: dict, progress: bool, share: Share | None = None) -> np.ndarray:
    """``[N, L]`` per-layer squared norms of the raw store vectors (one pass, cached; ``share``: with the ranks
    it hands the pass to)."""
    if meta.get("norms") and path.exists():
        try:
            arr = np.load(path)
            if arr.shape == (len(store), len(store.layers)):
                return arr.sum(axis=1)
        except (OSError, ValueError):
            pass
    sq = row_norms(store, progress, share("norms") if share is not None else SOLO)
    write_norms(path.parent, sq)
    meta["norms"] = {"file": path.name, "layers": list(store.layers)}
    return sq.sum(axis=1)


def row_norms(store: Store, progress: bool = False, team: Team = SOLO) -> np.ndarray:
    """``[N, L]`` float32 squared norms of every stored row per layer, a store file at a time (``team``: each rank
    its own files; the lead gets every row, the others their own files' rows)."""
    sq = np.zeros((len(store), len(store.layers)), dtype=np.float32)
    with progress_bar(total=len(store), unit="ex", desc="norms", disable=not progress, leave=False) as bar:
        def work(k: int) -> np.ndarray:
            first, size = store.first_ids[k], store.sizes[k]
            out = np.zeros((size, len(store.layers)), dtype=np.float32)
            for j, n in enumerate(store.layers):
                block = max(1, (64 << 20) // (4 * max(1, store.dims[n])))  # 64 MB a block
                for ids, x in store.iter_blocks([n], block, first, first + size):
                    out[ids - first, j] = np.einsum("ij,ij->i", x[n], x[n], dtype=np.float64)
            return out

        def combine(k: int, rows: np.ndarray) -> None:
            if team.lead or team.owns(k):
                sq[store.first_ids[k]:store.first_ids[k] + store.sizes[k]] = rows
            bar.update(int(store.sizes[k]))

        team.rounds(len(store.paths), work, combine)
    return sq


def _register(index_dir: Path, manifest: dict, meta: dict, tier: type[Tier]) -> None:
    """Record the index types in the manifest (the open index's copy, then the file)."""
    manifest["index"] = {"space": meta["space"], "status": meta["status"],
                         "factories": sorted({e["factory"] for e in meta["layers"].values()}),
                         "kind": meta.get("kind", "faiss"), "bytes": tier.written_bytes(meta)}
    if meta["key"].get("sketch_bytes"):  # (a sketch tier's --sketch-bytes: manifest.index_args prints it)
        manifest["index"]["sketch_bytes"] = int(meta["key"]["sketch_bytes"])
    write_manifest(index_dir, manifest)
