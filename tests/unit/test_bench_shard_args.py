"""bench/bench_shard.py's arguments are refused before anything is written: `--experts 4` (fewer routed
experts than the 6 each token picks) ended in a ConfigError traceback, and `--experts 12` (not a multiple of
the bench's tp 8) wrote its source and timed `cp` before `shard` refused the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("experts", ["4", "12"])
def test_an_expert_count_the_bench_cannot_run_is_refused_by_argparse(tmp_path, experts):
    work = tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_shard.py"), str(work), "--experts", experts, "--skip-in-ram"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]  # argparse's usage error
    assert "--experts" in done.stderr and "Traceback" not in done.stderr
    assert not work.exists()  # nothing written
