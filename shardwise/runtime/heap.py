"""Keep the memory a CPU training step frees, instead of handing it back to the OS every step.

A per-rank step program holds the whole step's temporaries in one function and frees most of
them together at its end. With glibc's malloc defaults, freeing that much at the top of the heap
trims it (``M_TRIM_THRESHOLD``, at most 64 MiB by its dynamic rule), so the next step grows the
heap again and faults every page back in: on llama-small (hidden 256) over two gloo ranks about
10,000 minor page faults and 15 ms of system time per 330 ms step, where DDP's loop, whose bucket
buffers stay allocated, has about 200 faults (``benchmarks/train.py``). PyTorch's CUDA caching
allocator keeps freed blocks for the same reason; on CPU the allocator is the C library's, so
this tells it to do the same: the heap stays at the step's peak, which the next step reuses.

``retain_freed_memory`` sets two process-wide ``mallopt`` parameters; it changes no value a
program computes, only where its buffers come from. Where the C library is not glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import platform

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Allocations above this many bytes get their own mapping, returned to the OS when freed: glibc's
# own ceiling for its dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), which a fixed
# value keeps (setting either parameter turns the dynamic rule off).
MMAP_THRESHOLD_BYTES = 32 * 2**20
# Free memory at the top of the heap is returned to the OS only above this: never, in practice
# (mallopt takes a C int).
TRIM_THRESHOLD_BYTES = 2**31 - 1


@functools.cache
def retain_freed_memory() -> bool:
    """Make this process's malloc keep freed heap memory for reuse (once per process). True
    where it took effect (glibc), False elsewhere."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not done:
        log.warning("malloc refused to keep freed memory: each CPU step may fault its pages back in")
    return done
