"""glibc heap settings for our own processes, through `mallopt` (one home for both): a preparing process maps its
large allocations, a server caps its arenas.

Preparing: glibc serves an allocation from the heap or from its own mmap depending on a size threshold that it
raises, up to 32 MiB, each time a mapped block is freed. After the first layer is dropped, layer-sized
tensors of a small or medium model therefore come from the heap, and what they leave behind when freed
stays in the process: the peak then drifts by the size of a layer or two from run to run (measured on a
0.5 GB checkpoint: 87 to 201 MB above the baseline; with the threshold fixed, 72 MB every run).
Only for processes that do nothing but prepare: a decode loop would pay a fresh page fault for every
large activation instead of reusing the heap.

Serving: glibc gives every thread that allocates an arena of its own, up to 8 per core, and seldom gives an
arena's freed memory back. The server's turn threads decrypt, encrypt and copy every session's cache, so
each one keeps a high-water mark of its own (docs/soak.md). Two arenas are what `MALLOC_ARENA_MAX=2` gives;
set in the process, a server started by pip, torchrun or a supervisor gets it without that variable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 20  # 1 MiB: every tensor worth counting is mapped, and unmapped when freed
SERVER_ARENAS = 2


def _glibc_mallopt():
    """glibc's `mallopt`, or None where the C library is another (musl, macOS) or none is found."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc has it; musl and macOS have other allocators
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt


def set_malloc_option(parameter: int, value: int) -> bool:
    """`mallopt(parameter, value)`; False where the C library is not glibc or refused the value."""
    mallopt = _glibc_mallopt()
    done = mallopt is not None and mallopt(parameter, value) == 1
    log.debug("mallopt(%d, %d): %s", parameter, value, done)
    return done


def map_large_allocations(threshold: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes; False where the C library is not glibc."""
    return set_malloc_option(M_MMAP_THRESHOLD, threshold)


def cap_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Let glibc create at most `arenas` arenas from now on (call it before threads start allocating: arenas
    already made stay); False where the C library is not glibc."""
    return set_malloc_option(M_ARENA_MAX, arenas)
