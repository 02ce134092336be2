"""store/heap.py: buffers of a few MiB reused from the heap instead of mapped anew each time."""

from __future__ import annotations

import subprocess
import sys

import pytest

_FAULTS = """
import resource, sys
from dsv41_convert.store import heap
if sys.argv[1] == "on":
    heap.reuse_freed_buffers()
def one_tensor():  # a read and a cast's output alive at once, then both freed (zero-filled: pages touched)
    bufs = [bytearray(30 << 20), bytearray(30 << 20)]
    del bufs
for _ in range(3):  # warm: the thresholds glibc adjusts itself settle
    one_tensor()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    one_tensor()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_buffers_are_reused_not_faulted_in_again():
    """50 times two buffers of 30 MiB alive at once, then freed: glibc gives the 60 MiB back to the OS each
    time (more than its trim threshold, which it raises only to twice its mmap threshold) and faults every
    page in again, 15,360 a time; none once the heap keeps them (the digest passes' setting)."""
    off, on = _faults("off"), _faults("on")
    assert on < 1000 < 50 * 15360 // 2 < off, (off, on)
