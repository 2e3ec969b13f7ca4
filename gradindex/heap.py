"""Keep a long streaming pass's memory flat: the C heap's dynamic mmap threshold, fixed.

glibc serves an allocation from its heap unless it exceeds a threshold that rises to the size of the
largest block freed so far (up to 32 MiB). A pass that allocates many blocks of ~1-30 MiB (a block
of store rows, per layer) then leaves them as holes in the heap that later blocks of other sizes
do not fill: the process's RSS grows with the number of blocks, so with N (measured by
``benchmarks/build_memory.py``). Fixing the threshold sends those blocks to ``mmap``, returned to
the system on free. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number (malloc.h)."""


def bound_heap(threshold: int = 1 << 20) -> bool:
    """Release the heap's free memory and serve allocations over ``threshold`` bytes by ``mmap`` from now
    on (for this process); whether it took effect."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
