"""glibc's heap, for passes that allocate and free many buffers of a few MiB (glibc only; nothing elsewhere).

glibc serves an allocation above its mmap threshold (128 KiB at first, raised as such blocks are freed, at
most 32 MiB) with a fresh mapping, and hands the top of the heap back once more than the trim threshold is
free there: a pass that reads, casts and hashes tensor after tensor then takes every page of every buffer
as a new page fault. Measured (docs/BENCHMARKS.md, session 28): the routed experts cast to fp8 and hashed,
medium preset, dev box: 12.9 s of system time of 26 CPU s, 3.8 s with the thresholds below.
"""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # the most glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20  # free bytes a heap keeps at its top before they go back to the OS


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def reuse_freed_buffers() -> None:
    """From now on this process serves buffers up to 32 MiB from its heaps and keeps up to 256 MiB free at
    a heap's top for the next ones, instead of mapping and unmapping each (for the rest of the process: the
    digest passes of reference-logits and verify). release_freed_memory still hands everything back."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def release_freed_memory() -> None:
    """Hand the free pages of every heap back to the OS (glibc's malloc_trim)."""
    libc = _libc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except AttributeError:
            pass
