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
CAPTURE_THRESHOLD = 16 << 20
"""The threshold a build fixes before its capture pass: its per-batch blocks of 16-32 MiB (activations and
their gradients at a large vocabulary or batch) then leave no holes in the heap. Peers workload, four
interleaved runs of the default build: peak RSS 1,034 / 1,010 MB against 1,110 / 1,089 MB with the
dynamic threshold, the same CPU seconds (52.2 / 52.4 against 50.4 / 52.0); a 1 MiB threshold there cost
the capture 28% (every batch's blocks mapped and zeroed again)."""


def bound_heap(threshold: int = 1 << 20) -> bool:
    """Release the heap's free memory and serve allocations over ``threshold`` bytes by ``mmap`` from now
    on (for this process); whether it took effect."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
