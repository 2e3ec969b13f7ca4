"""Disk space: a stage checks the free space against what it will write, and a full disk is one clear error.

A build writes its stages into one directory; each stage knows, before it starts, about how many
bytes it adds (:mod:`gradindex.plan`). :func:`check_space` refuses a stage that cannot fit, before it
writes anything; :func:`disk_full_as_error` turns "No space left on device" raised anywhere inside a
stage (h5py, FAISS, a JSON write: as ``OSError``, ``RuntimeError`` or a FAISS error) into a
:class:`DiskFullError` that says what is kept and how to resume. Every stage commits its files
atomically, so a re-run after freeing space resumes and ends with the same index.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from gradindex.errors import DiskFullError

NO_SPACE = "No space left on device"
PARTIAL_WRITE = re.compile(r"\d+ requested and \d+ written")
"""NumPy's ``tofile``/``np.save`` on a full disk: an ``OSError`` without an errno (``2774016 requested and
524288 written``)."""


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for this user) on the file system holding ``path`` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def is_disk_full(e: BaseException | None) -> bool:
    """Whether ``e`` (or an exception it was raised from) is ENOSPC / EDQUOT, by errno or by message."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or NO_SPACE in str(e) \
                or "errno = 28" in str(e) or isinstance(e, OSError) and PARTIAL_WRITE.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def reserve(path: str | os.PathLike, need: int) -> None:
    """Raise ENOSPC *before* a write of up to ``need`` bytes into ``path`` that the disk cannot hold: HDF5
    left to hit a full disk itself cannot close the file cleanly (it crashed the process at exit)."""
    free = free_bytes(path)
    if need > free:
        raise OSError(errno.ENOSPC, f"{NO_SPACE}: {human(free)} free, a write of up to {human(need)} pending",
                      str(path))


def check_space(where: str | os.PathLike, need: int, stage: str, detail: str = "") -> None:
    """Refuse ``stage`` (nothing written yet) when the disk of ``where`` has less than ``need`` bytes free."""
    free = free_bytes(where)
    if need > free:
        raise DiskFullError(
            f"not enough disk space for the {stage} in {str(where)!r}: it writes about {human(need)}"
            f"{f' ({detail})' if detail else ''} and {human(free)} is free; free {human(need - free)} more "
            "(or use another --out), then re-run the same command: what is written so far is kept and resumed"
        )


@contextlib.contextmanager
def disk_full_as_error(where: str | os.PathLike, stage: str, kept: str,
                       need: Callable[[], int] | None = None) -> Iterator[None]:
    """Inside: a full disk, whatever raised it, becomes one :class:`DiskFullError` naming ``stage``, what is
    ``kept``, the free space ``need()`` says the rest of the work takes (bytes) and the resume (a re-run of
    the same command)."""
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(full_message(where, stage, kept, need)) from None


def full_message(where: str | os.PathLike, stage: str, kept: str, need: Callable[[], int] | None = None) -> str:
    """The one line of a disk that filled during ``stage`` (see :func:`disk_full_as_error`)."""
    free = free_bytes(where)
    try:
        n = int(need()) if need is not None else 0
    except Exception:  # noqa: BLE001 - the estimate is advice; the error is the full disk
        n = 0
    space = f"about {human(n)} free for the rest ({human(free)} free now)" if n else f"more than the {human(free)} free"
    fix = f"free {human(n - free)} or more" if n > free else "free some space"
    return (f"the disk holding {str(where)!r} is full during the {stage}, which needs {space}: {kept}; {fix} "
            "(or use another --out) and re-run the same command to resume (the index will be the same)")
