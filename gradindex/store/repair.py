"""Is the store intact? Damaged shards name their repair, ``gradindex build ... --repair``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from gradindex.checksum import Damage, check_files, recorded, shard_of
from gradindex.spec.build import batch_size_of
from gradindex.spec.manifest import Manifest, build_command
from gradindex.store.shards import STORE_DIR, shard_name

log = logging.getLogger("gradindex")


def check_store(index_dir: str | os.PathLike, full: bool, manifest: dict) -> list[Damage]:
    """Damaged or missing shards of the store of ``index_dir``, whose manifest is ``manifest`` (``full``:
    whole-file hashes, else the cheap check)."""
    m = manifest
    repair = build_command(index_dir, m)
    names = set(recorded(index_dir, f"{STORE_DIR}/"))
    if m.get("status") == "complete":
        names |= {f"{STORE_DIR}/{shard_name(k)}" for k in range(int(m.get("counts", {}).get("shards", 0)))}
    d = Path(index_dir)
    missing = [Damage(n, "missing", repair) for n in sorted(names) if not (d / n).exists()]
    damage = missing + check_files(d, sorted(n for n in names if (d / n).exists()), full, repair)
    named = {x.file for x in damage}  # a shard whose row hashes are damaged is recomputed with them
    return damage + [Damage(shard_of(x.file), f"its row hashes ({x.file}) are {x.problem}", repair)
                     for x in damage if shard_of(x.file) != x.file and shard_of(x.file) not in named
                     and (d / shard_of(x.file)).exists()]


def repair_eigenbasis_store(model, capture, data, index_dir: str | os.PathLike, manifest: dict, pad_id: int,
                            hashes: list[bytes], full: bool, progress: bool = False) -> int:
    """Recompute the damaged or missing shards of a store already in the EK-FAC eigenbasis; return the rows.

    A transcoded build keeps no raw rows to rebuild from, so each such shard is captured again
    (``capture``: the build's projection and pre-projection maps, without covariance), rotated and
    scaled by the index's ``basis.h5`` (:func:`~gradindex.store.basis.stored_rows`, as the
    transcode did: the same bytes) and coded as the index's storage. Damaged files are moved to
    ``damaged/`` first.
    """
    from gradindex.checksum import move_aside
    from gradindex.store.append import RowSink, append_batch
    from gradindex.store.basis import index_basis, stored_rows
    from gradindex.store.shards import ShardWriter

    d = Path(index_dir)
    damage = check_store(d, full=full, manifest=manifest)
    if not damage:
        return 0
    move_aside(d, [x.file for x in damage if x.problem != "missing"])
    basis = index_basis(d, manifest)
    m = Manifest(manifest)
    shapes = m.shapes
    dims = {n: r * c for n, (r, c) in shapes.items()}  # (the captured rows: the build's, checked identical)
    N, S = int(manifest["counts"]["examples"]), m.shard_size
    B = batch_size_of(manifest)
    fp, storage = m.data_fingerprint, m.storage
    captured = (manifest.get("transcode") or {}).get("source_build", {}).get("storage", "fp32")
    computed = 0
    sink = RowSink()
    sink.rows = lambda s, grads: {n: stored_rows(basis, n, as_captured(g, captured), shapes[n])
                                  for n, g in grads.items()}
    with capture:
        for k in range((N + S - 1) // S):
            path = d / STORE_DIR / shard_name(k)
            if path.exists():
                continue
            start, end = k * S, min((k + 1) * S, N)
            w = ShardWriter(path, start, end - start, dims, fp, storage)
            done = w.open()
            for s in range(start + done, end, B):
                e = min(s + B, end)
                append_batch(w, model, capture, data, s, e, pad_id, hashes, sink)
                computed += e - s
            w.finish()
            log.warning("recomputed %s in the index's ekfac eigenbasis", path.name)
    return computed


def as_captured(x: np.ndarray, storage: str) -> np.ndarray:
    """``x`` as the build's capture stored and the transcode read it back (e.g. rounded to float16)."""
    from gradindex.store.codes import decode, encode

    codes, scale = encode(np.asarray(x, np.float32), storage)
    return decode(codes, scale, storage, x.shape[1])
