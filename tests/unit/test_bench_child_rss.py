"""bench/bench_verify_stream.py reports each run's own peak RSS: it printed `nan` for every run whose peak
was below an earlier child's (RUSAGE_CHILDREN's ru_maxrss is the largest child so far, not the last one),
e.g. `verify` after a larger `reference-logits` on a fresh WORK."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# a child that holds argv[1] MiB, then prints the JSON document the bench expects
HOLD = "import sys; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096]); print('{}')"


@pytest.fixture
def bench_verify_stream(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_verify_stream", None)
    import bench_verify_stream

    monkeypatch.setattr(bench_verify_stream, "CLI", [sys.executable, "-c", HOLD])
    return bench_verify_stream


def test_a_smaller_run_after_a_larger_one_gets_its_own_peak(bench_verify_stream):
    # sizes above this process's RSS (over 1 GiB late in a whole test run): Linux counts the parent's resident
    # pages at the child's exec in its peak
    here = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20  # MiB
    _, doc, big = bench_verify_stream.timed(str(here + 480))
    _, _, small = bench_verify_stream.timed(str(here + 320))
    assert doc == {}
    assert big > (here + 480) / 1024
    assert (here + 320) / 1024 < small < big  # its own peak, not nan and not the earlier child's
