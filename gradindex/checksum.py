"""Content hashes of an index directory's data files, kept in ``INDEX_DIR/checksums.json``.

Every committed store shard, every preconditioner file, the row basis (``basis.h5``) and every
FAISS file (and ``norms.npy``) is hashed once when written, and the hash is kept *outside* the
file it protects (a file that carried its own hash would vouch for any complete replacement of
itself)::

    {"version": 1, "files": {"store/shard-00000.h5": {"bytes": N, "blake2b": "...", "sample": "..."}}}

* ``blake2b``: 128-bit BLAKE2b of the whole file (the full check: ``gradindex verify``, before a
  fit, before indexing, when a query engine loads FAISS and preconditioner files);
* ``sample``: BLAKE2b of the size, the first and last 64 KiB and 16 spread 4 KiB blocks (the
  cheap check on every store open and build resume: it catches truncation, a replaced file and
  most torn writes, not every flipped byte).

Writers hold the directory's lock (:mod:`gradindex.lock`), so updates never race.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is imported where rows are hashed: `gradindex --help` stays light
    import numpy as np

from gradindex.spec import layout

CHECKSUMS = layout.CHECKSUMS
VERSION = 1
_EDGE, _BLOCK, _BLOCKS = 1 << 16, 1 << 12, 16


class DamagedIndexError(OSError):
    """A data file of an index does not match the hash recorded when it was written."""

    damage: tuple[Damage, ...] = ()
    """The damaged files, when known (:func:`damage_error`)."""


@dataclass(frozen=True)
class Damage:
    file: str
    """Path relative to the index directory."""
    problem: str
    """What is wrong (missing, size, content hash)."""
    repair: str = ""
    """The command that rewrites it."""


def damage_error(index_dir: str | os.PathLike, damage: list[Damage], then: str = "") -> DamagedIndexError:
    """One error naming every damaged file, then each distinct repair command."""
    files = "; ".join(f"{x.file} ({x.problem})" for x in damage)
    repairs = list(dict.fromkeys(x.repair for x in damage if x.repair))
    how = " and ".join(f"`{r}`" for r in repairs) or "rebuild the index"
    err = DamagedIndexError(f"damaged files in {str(index_dir)!r}: {files}. Repair with {how}"
                            + (f", then {then}" if then else "")
                            + f" (`gradindex verify {index_dir}` checks every file of the index)")
    err.damage = tuple(damage)
    return err


_seen: dict[tuple[int, int, int, int], str] = {}
"""Digests this process computed, by (device, inode, size, mtime): a file it wrote is hashed once."""


def file_digest(path: Path, chunk: int = 1 << 23) -> str:
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _seen:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
        _seen[key] = h.hexdigest()
    return _seen[key]


def sample_digest(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    offsets = [0, max(0, size - _EDGE)] + [size * i // (_BLOCKS + 1) for i in range(1, _BLOCKS + 1)]
    with open(path, "rb") as f:
        for i, off in enumerate(offsets):
            f.seek(off)
            h.update(f.read(_EDGE if i < 2 else _BLOCK))
    return h.hexdigest()


def entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "blake2b": file_digest(path), "sample": sample_digest(path)}


def read_checksums(index_dir: str | os.PathLike) -> dict[str, dict]:
    """``relative path → entry``; empty when nothing was recorded (an index from before checksums)."""
    p = Path(index_dir) / CHECKSUMS
    if not p.exists():
        return {}
    try:
        return dict(json.loads(p.read_text())["files"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DamagedIndexError(
            f"{str(p)!r} is corrupt ({e}); delete it and re-run the command (files are then not verified)"
        ) from None


def write_checksums(index_dir: str | os.PathLike, files: dict[str, dict]) -> None:
    p = Path(index_dir) / CHECKSUMS
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps({"version": VERSION, "files": dict(sorted(files.items()))}, indent=1))
    os.replace(tmp, p)


@contextlib.contextmanager
def _updating(index_dir: str | os.PathLike) -> Iterator[None]:
    """Serialise read-modify-write of ``checksums.json`` between processes (the ranks of one build)."""
    fd = os.open(Path(index_dir) / ".checksums.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def record(index_dir: str | os.PathLike, paths: Iterable[Path], names: Iterable[str] | None = None) -> None:
    """Hash ``paths`` and record them (under ``names``, default their paths relative to the index)."""
    d = Path(index_dir)
    paths = list(paths)
    names = list(names) if names is not None else [str(Path(p).relative_to(d)) for p in paths]
    new = {n: entry(Path(p)) for p, n in zip(paths, names, strict=True)}  # hashed outside the lock
    with _updating(d):
        write_checksums(d, {**read_checksums(d), **new})


def forget(index_dir: str | os.PathLike, names: Iterable[str]) -> None:
    with _updating(index_dir):
        files = read_checksums(index_dir)
        names = [n for n in names if n in files]
        if names:
            for n in names:
                del files[n]
            write_checksums(index_dir, files)


def rename_records(index_dir: str | os.PathLike, renames: dict[str, str], drop_prefix: str = "") -> None:
    """Move records to new names (files that were renamed), first dropping those under ``drop_prefix``."""
    files = read_checksums(index_dir)
    if drop_prefix:
        files = {n: e for n, e in files.items() if not n.startswith(drop_prefix)}
    for old, new in renames.items():
        if old in files:
            files[new] = files.pop(old)
    write_checksums(index_dir, files)


def check_files(index_dir: str | os.PathLike, names: Iterable[str], full: bool = True,
                repair: str = "", sample: bool = True, files: dict[str, dict] | None = None) -> list[Damage]:
    """Damage among recorded files ``names`` (a name with no record is not checked): missing, another size,
    and unless ``sample`` is False (presence and size only) a sampled hash, or with ``full`` the whole hash.
    ``files``: the records when the caller has read them already (:func:`read_checksums`)."""
    d = Path(index_dir)
    files = read_checksums(d) if files is None else files
    out = []
    for n in names:
        e = files.get(n)
        if e is None:
            continue
        p = d / n
        if not p.exists():
            out.append(Damage(n, "missing", repair))
        elif p.stat().st_size != e["bytes"]:
            out.append(Damage(n, f"{p.stat().st_size} bytes, {e['bytes']} were written", repair))
        elif sample and (sample_digest(p) != e["sample"] or (full and file_digest(p) != e["blake2b"])):
            out.append(Damage(n, "content differs from the hash recorded when it was written", repair))
    return out


def recorded(index_dir: str | os.PathLike, prefix: str) -> list[str]:
    """Recorded names under ``prefix`` (e.g. ``store/``)."""
    return sorted(n for n in read_checksums(index_dir) if n.startswith(prefix))


def move_aside(index_dir: str | os.PathLike, names: Iterable[str], keep_records: bool = False) -> list[Path]:
    """Move damaged files to ``INDEX_DIR/damaged/<time>/`` (kept, not deleted) and forget their hashes (with
    ``keep_records``, keep them: a copy put back is checked against them, as a lost file's is)."""
    d = Path(index_dir)
    names = [n for n in names if (d / n).exists()]
    dest = d / layout.DAMAGED_DIR / time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for n in names:
        target = dest / n
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(d / n, target)
        moved.append(target)
    if not keep_records:
        forget(d, names)
    return moved


# -- per-row hashes: what a query checks as it reads store rows --------------------------------------
ROW_HASHES = ".rowhash.npy"
"""Sidecar of ``store/shard-NNNNN.h5``: ``store/shard-NNNNN.rowhash.npy``, uint64 ``[n, L]``, one hash per
row and layer (``L``: the shard's layers in the file's order), written when the shard is committed and
itself recorded in ``checksums.json``. Readers check every row they decode against it (:func:`row_hashes`),
so a flipped byte in a row's codes or scale is refused the moment a query reads that row, at the cost of
one multiply-add per 8 bytes read; ``gradindex verify`` still hashes every byte of every file."""
_MIX_SCALE, _MIX_ROW = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F
_weights: dict[int, np.ndarray] = {}


def row_hash_path(shard: Path) -> Path:
    """The row-hash sidecar of a shard (``shard-00003.h5`` → ``shard-00003.rowhash.npy``)."""
    name = shard.name.removesuffix(".partial")
    return shard.with_name(name.removesuffix(".h5") + ROW_HASHES)


def shard_of(name: str) -> str:
    """The shard a recorded name belongs to (a sidecar's shard; a shard itself)."""
    return name.removesuffix(ROW_HASHES) + ".h5" if name.endswith(ROW_HASHES) else name


def _word_weights(n: int) -> np.ndarray:
    import numpy as np

    if n not in _weights:  # odd, so a change in any one 8-byte word always changes the hash
        _weights[n] = np.random.default_rng(0x6772616469).integers(0, 2**63, n, dtype=np.uint64) * 2 + 1
    return _weights[n]


def row_hashes(codes: np.ndarray, scales: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """``[n]`` uint64 hashes of ``n`` stored rows: their code bytes, their scale (if any) and their row
    numbers ``rows`` in the shard (so two swapped rows differ); a weighted sum of 8-byte words mod 2⁶⁴."""
    import numpy as np

    b = np.ascontiguousarray(codes).view(np.uint8).reshape(len(codes), -1)  # [n, bytes]
    if b.shape[1] % 8:
        b = np.pad(b, ((0, 0), (0, 8 - b.shape[1] % 8)))
    words = b.view("<u8")  # [n, W]
    with np.errstate(over="ignore"):
        h = (words * _word_weights(words.shape[1])[None, :]).sum(axis=1, dtype=np.uint64)
        if scales is not None:
            h += np.asarray(scales, "<f4").view("<u4").astype(np.uint64) * np.uint64(_MIX_SCALE)
        h += (np.asarray(rows, np.uint64) + np.uint64(1)) * np.uint64(_MIX_ROW)
    return h
