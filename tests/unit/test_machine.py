"""store.machine: the cores and memory `--workers auto` plans with, from the affinity mask and /proc/meminfo."""

from __future__ import annotations

import io

from dsv41_convert.store import machine

MEMINFO = """MemTotal:       32768000 kB
MemFree:         1024000 kB
MemAvailable:   20480000 kB
Buffers:          102400 kB
"""


def test_available_memory_is_memavailable_in_bytes(monkeypatch):
    """MemAvailable (free memory plus what the page cache can give back) in bytes, 1024 a kB. Bugs guarded:
    MemFree read instead (a host with a warm page cache looked full: one worker), and kB taken as 1000 bytes."""
    monkeypatch.setattr(machine, "open", lambda *a, **k: io.StringIO(MEMINFO), raising=False)
    assert machine.available_memory() == 20480000 * 1024


def test_usable_cores_follow_the_affinity_mask(monkeypatch):
    """A process pinned to 3 CPUs of a 64-CPU host (taskset, a container's cpuset) may use 3. Bug guarded:
    the host's CPU count used instead, which gave a pinned run sixteen workers on three cores."""
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 5, 9}, raising=False)
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 64)
    assert machine.usable_cores() == 3
