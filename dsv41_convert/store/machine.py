"""What this machine offers the writers: the cores this process may run on and the memory available."""

from __future__ import annotations

import codecs
import os
from pathlib import Path

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


MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs")  # their files take the host's memory, as the processes' pages do


def memory_backed(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """Whether `path` lies on a file system held in memory (MEMORY_FILE_SYSTEMS): that of the last-mounted of the
    longest mount points above it in `mountinfo`; False where that cannot be read (not Linux)."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return False
    real = os.path.realpath(path)
    best, kind = "", ""
    for line in lines:
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        mount = codecs.decode(fields[4], "unicode_escape")  # a space is \040, and so on
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[fields.index("-", 6) + 1]
    return kind in MEMORY_FILE_SYSTEMS
