"""One writer per index directory: an exclusive ``flock`` on ``INDEX_DIR/.lock``.

Builds, fits and index builds take it at start; a second writer is refused at once, naming the
holder's pid and command (written inside the file). The kernel releases a ``flock`` when its
process dies, so a lock left by a killed process never blocks. Re-entrant within one process
(the pipeline holds it across its stages). Readers (queries) take no lock. A directory the lock
created is removed again when nothing else was written into it (and its lock file, in a folder that had none).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK = ".lock"
_held: dict[str, list] = {}
"""Resolved directory → [fd, depth, what] of the locks this process holds."""


class IndexBusyError(OSError):
    """Another process is writing the index directory."""


@contextlib.contextmanager
def index_lock(index_dir: str | os.PathLike, what: str, reentrant: bool = True) -> Iterator[None]:
    """Hold the directory's write lock (creating the directory) for the ``with`` block; ``reentrant=False``: refused
    where this process holds it already (two live captures into one folder).

    Under ``torchrun`` only rank 0 takes it: the other ranks are the same job, writing their own shards.
    """
    from gradindex import distributed

    d = Path(index_dir)
    if distributed.rank() != 0:
        d.mkdir(parents=True, exist_ok=True)
        yield
        return
    created = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    key = str(d.resolve())
    if key in _held and not reentrant:
        raise IndexBusyError(f"{str(d)!r} is being written by this process already ({_held[key][2]}); finish that "
                             "first, or write another folder")
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    made = not (d / LOCK).exists()
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process"
        os.close(fd)
        raise IndexBusyError(
            f"{str(d)!r} is being written by another process ({holder}); wait for it to finish, "
            "or stop it (a killed process releases the lock)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {what}\n".encode(), 0)
    _held[key] = [fd, 1, what]
    try:
        yield
    finally:
        del _held[key]
        if made and [p.name for p in d.iterdir()] == [LOCK]:  # a command that failed before writing
            (d / LOCK).unlink()
            if created:
                d.rmdir()
        os.close(fd)
