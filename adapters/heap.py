"""What a thousand adapters need of the C heap: large frees given back to the system.

glibc serves a large allocation from its own mapping and, once such a block is freed, raises that threshold to the
block's size, so later blocks of that size come from the heap's arenas instead, where a freed one stays part of the
process. An adapter read from its folder allocates and frees its file's bytes (megabytes) and every fused tensor; at
a thousand adapters through a 2 GiB cache that is gigabytes of heap the process keeps, beyond any budget (the
benchmarks doc has the resident memory before and after). Fixing the threshold keeps every block from
`MMAP_THRESHOLD` up in its own mapping, returned whole when freed; smaller ones are not worth a system call each.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 4 << 20


def return_large_frees() -> bool:
    """Fix glibc's mmap threshold for this process (once is enough; again is harmless). False where the C library
    is not glibc (nothing to do: others do not raise the threshold this way)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return False
    log.debug("large allocations (>= %d MiB) go back to the system when freed", MMAP_THRESHOLD >> 20)
    return True
