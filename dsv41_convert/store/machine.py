"""What this machine offers the writers: the cores this process may run on and the memory available."""

from __future__ import annotations

import os

# torch threads per process, at most (--threads, a reference file's `threads`): far past any host's cores, short
# of the thread limits a process meets (an audit's 100000 ended in a Rust thread pool's panic, exit 139)
MAX_THREADS = 1024


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (physical memory where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()


def physical_memory() -> int:
    """The host's physical memory in bytes, all of it."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
