"""Store shard files moved between an index and the parts of a sharded index (:mod:`gradindex.index.sharded`):
the same bytes, their row ids shifted.

A part of a sharded index is a complete index over a contiguous range of the whole index's rows, numbered from 0
inside it (the store reads row ``i`` as example ``i``). So a shard file moves into a part as a byte copy whose
``ids`` dataset and ``first_id`` attribute are shifted by the part's first row, written in place in the copy (the
same sizes: HDF5 keeps the file's layout), and shifting them back gives the original file, byte for byte. The
row-hash sidecar hashes codes by their row in the file, not their id: it is copied unchanged.

A part may also start or end inside a shard file (more parts than files): :func:`write_rows` writes row ranges of
one or more shard files as one new shard file (their codes as stored, never decoded; ids renumbered; its own row
hashes and recorded hash), which also joins the pieces of a file again at a merge (the same rows and columns, not
the same bytes).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from gradindex.checksum import Damage, damage_error, file_digest, read_checksums, record, row_hash_path
from gradindex.store.shards import STORE_DIR, ShardWriter, repair_command


def copy_shard(src: Path, dst: Path, shift: int, recorded: dict | None = None) -> None:
    """Copy shard file ``src`` (a committed ``shard-NNNNN.h5``) and its row-hash sidecar to ``dst``, its ids and
    ``first_id`` plus ``shift``; record both in the checksums of ``dst``'s index. The copy is checked against the
    hash the source index recorded (``recorded``: its ``checksums.json``, read here when not given), so a damaged
    shard is refused, not copied under a fresh hash."""
    recorded = read_checksums(src.parent.parent) if recorded is None else recorded
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.copyfile(src, tmp)
    _check(src, tmp, recorded, tmp)
    if shift:
        with h5py.File(tmp, "r+") as f:
            first = int(f.attrs["first_id"]) + shift
            if first < 0:
                raise ValueError(f"{src}: shifting its ids by {shift} makes them negative")
            f["ids"][:] = f["ids"][:] + np.int64(shift)
            f.attrs.modify("first_id", np.int64(first))  # (in place: attrs[...] = would re-create it elsewhere)
    side_src, side_dst = row_hash_path(src), row_hash_path(dst)
    names, paths = [f"{STORE_DIR}/{dst.name}"], [tmp]
    if side_src.exists():
        shutil.copyfile(side_src, side_dst)
        names.append(f"{STORE_DIR}/{side_dst.name}")
        paths.append(side_dst)
    record(dst.parent.parent, paths, names)
    os.replace(tmp, dst)


def move_shard(src: Path, dst: Path, first: int) -> None:
    """Move shard file ``src`` and its row-hash sidecar to ``dst`` (a rename: nothing copied), its ids set to run
    from ``first`` in place (the bytes :func:`copy_shard` writes), and record both in the checksums of ``dst``'s
    index. Resumable: a ``dst`` in place is done; a ``dst.partial`` (``src`` already moved) is finished."""
    if dst.exists():
        return
    tmp = dst.with_name(dst.name + ".partial")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.exists():
        os.replace(src, tmp)
    with h5py.File(tmp, "r") as f:
        was, n = int(f.attrs["first_id"]), int(f["ids"].shape[0])
        ids = f["ids"][:]
    if was != first:
        if not (np.array_equal(ids, np.arange(was, was + n)) or np.array_equal(ids, np.arange(first, first + n))):
            raise ValueError(f"{src}: its ids are not the rows {was} to {was + n - 1}; it cannot be renumbered")
        with h5py.File(tmp, "r+") as f:
            f["ids"][:] = np.arange(first, first + n, dtype=np.int64)  # (absolute: a killed try's write redone)
            f.attrs.modify("first_id", np.int64(first))
    side_src, side_dst = row_hash_path(src), row_hash_path(dst)
    if side_src.exists():
        os.replace(side_src, side_dst)
    names, paths = [f"{STORE_DIR}/{dst.name}"], [tmp]
    if side_dst.exists():
        names.append(f"{STORE_DIR}/{side_dst.name}")
        paths.append(side_dst)
    record(dst.parent.parent, paths, names)
    os.replace(tmp, dst)


def _check(src: Path, copy: Path, recorded: dict, drop: Path | None = None) -> None:
    """Refuse ``src`` (read as ``copy``) when it differs from the hash its index recorded (``drop`` removed first)."""
    name = f"{STORE_DIR}/{src.name}"
    want = recorded.get(name, {}).get("blake2b")
    if want is not None and file_digest(copy) != want:
        if drop is not None:
            drop.unlink()
        raise damage_error(src.parent.parent, [Damage(name, "its content differs from the hash recorded when it was "
                                                            "written", repair_command(src.parent.parent))])


def write_rows(pieces: list[tuple[Path, int, int]], dst: Path, first_id: int,
               recorded: dict[Path, dict] | None = None) -> None:
    """Write rows ``start:stop`` (file rows) of each ``(shard file, start, stop)`` of ``pieces``, in order, as one
    shard file ``dst`` whose ids run from ``first_id``: the codes, scales and columns as stored, written through
    :class:`~gradindex.store.shards.ShardWriter`'s layout and commit (row hashes, recorded hash, rename into place).
    Each source is checked against its index's recorded hash first (``recorded``: each source index's
    ``checksums.json`` by its directory, read here when missing)."""
    recorded = {} if recorded is None else recorded
    for src in dict.fromkeys(p for p, _, _ in pieces):
        d = src.parent.parent
        recorded.setdefault(d, read_checksums(d))
        _check(src, src, recorded[d])
    n = sum(b - a for _, a, b in pieces)
    with h5py.File(pieces[0][0], "r") as f:
        dims = {name: int(ds.attrs.get("dim", ds.shape[1])) for name, ds in f["grads"].items()}
        w = ShardWriter(dst, first_id, n, dims, str(f.attrs["fingerprint"]), str(f.attrs.get("storage", "fp32")))
    dst.parent.mkdir(parents=True, exist_ok=True)
    w.partial.unlink(missing_ok=True)  # (a killed split's: written again)
    w.open()
    try:
        at = 0
        for src, a, b in pieces:
            with h5py.File(src, "r") as f:
                for key, ds in w._ds().items():
                    ds.resize(at + b - a, axis=0)
                    ds[at:] = f[key][a:b] if key != "ids" else np.arange(first_id + at, first_id + at + b - a)
            at += b - a
        w.committed = n
        w.file.attrs["committed"] = n
        w.finish()
    finally:
        w.close()
