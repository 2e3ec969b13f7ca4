"""Store shard files moved between an index and the parts of a sharded index (:mod:`gradindex.index.sharded`):
the same bytes, their row ids shifted.

A part of a sharded index is a complete index over a contiguous range of the whole index's rows, numbered from 0
inside it (the store reads row ``i`` as example ``i``). So a shard file moves into a part as a byte copy whose
``ids`` dataset and ``first_id`` attribute are shifted by the part's first row, written in place in the copy (the
same sizes: HDF5 keeps the file's layout), and shifting them back gives the original file, byte for byte. The
row-hash sidecar hashes codes by their row in the file, not their id: it is copied unchanged.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import numpy as np

from gradindex.checksum import Damage, damage_error, file_digest, read_checksums, record, row_hash_path
from gradindex.store.shards import STORE_DIR


def copy_shard(src: Path, dst: Path, shift: int, recorded: dict | None = None) -> None:
    """Copy shard file ``src`` (a committed ``shard-NNNNN.h5``) and its row-hash sidecar to ``dst``, its ids and
    ``first_id`` plus ``shift``; record both in the checksums of ``dst``'s index. The copy is checked against the
    hash the source index recorded (``recorded``: its ``checksums.json``, read here when not given), so a damaged
    shard is refused, not copied under a fresh hash."""
    src_dir = src.parent.parent
    recorded = read_checksums(src_dir) if recorded is None else recorded
    name = f"{STORE_DIR}/{src.name}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.copyfile(src, tmp)
    want = recorded.get(name, {}).get("blake2b")
    if want is not None and file_digest(tmp) != want:
        tmp.unlink()
        raise damage_error(src_dir, [Damage(name, "its content differs from the hash recorded when it was written")])
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

