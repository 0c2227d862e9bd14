"""Host memory that a CPU run keeps for reuse instead of handing back to the kernel.

An eager CPU step allocates and frees hundreds of activation buffers of many sizes. glibc's malloc serves
the large ones with fresh ``mmap`` pages (from 128 KiB, a threshold it moves as it goes) and returns the
heap's free top to the kernel once it passes ``M_TRIM_THRESHOLD``, so the next step page-faults, and the
kernel zeroes, much of the memory it touches again. With fixed thresholds the freed memory stays in the
process and the next step's buffers reuse it, as a GPU's caching allocator reuses device memory. PyTorch's
CPU tuning guide gets the same by preloading jemalloc or tcmalloc; glibc's own switches need no preload.
The process keeps its peak: its resident memory no longer shrinks between steps.
"""

from __future__ import annotations

import ctypes
import platform
from functools import cache

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 32 * 2**20
"""The largest glibc accepts; larger buffers still come from (and go back to) mmap."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""mallopt takes an int: the largest is "never trim" for any heap a CPU run builds."""
TOP_PAD_BYTES = 64 * 2**20
"""Extra bytes the heap grows by at once, so a step's growth is a few system calls, not one per buffer."""


@cache
def keep_freed_host_memory() -> bool:
    """Set this process's malloc to keep freed memory for reuse (once; process-wide, for good). False where
    the C library is not glibc (the allocator stays as it is)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)
