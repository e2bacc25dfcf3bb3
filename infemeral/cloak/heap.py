"""Give a preparing process's freed tensors back to the OS at once, so its peak memory is what it holds.

glibc serves an allocation from the heap or from its own mmap depending on a size threshold that it
raises, up to 32 MiB, each time a mapped block is freed. After the first layer is dropped, layer-sized
tensors of a small or medium model therefore come from the heap, and what they leave behind when freed
stays in the process: the peak then drifts by the size of a layer or two from run to run (measured on a
0.5 GB checkpoint: 87 to 201 MB above the baseline; with the threshold fixed, 72 MB every run).

Only for processes that do nothing but prepare: a decode loop would pay a fresh page fault for every
large activation instead of reusing the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD = 1 << 20  # 1 MiB: every tensor worth counting is mapped, and unmapped when freed


def map_large_allocations(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc has it; musl and macOS have other allocators
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    done = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    log.debug("mmap threshold fixed at %d bytes: %s", threshold, done)
    return done
