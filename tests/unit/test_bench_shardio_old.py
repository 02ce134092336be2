"""`bench/h200_round.sh shardio` without OLD= ran `bench_shard_cpu.py --old ""`, and an empty path is the
working directory, this checkout: the "old" rows timed this code a second time and the comparison of the two
codes' rank files passed by construction. bench_shard_cpu.py now refuses an --old that is this checkout or holds
no dsv41_convert/, and the round says the step needs OLD instead of running it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("old", ["", ".", str(ROOT), "nowhere"])
def test_bench_shard_cpu_refuses_an_old_checkout_that_is_this_one_or_none(tmp_path, old):
    cmd = [sys.executable, str(ROOT / "bench" / "bench_shard_cpu.py"), str(tmp_path / "src"), str(tmp_path / "w")]
    done = subprocess.run([*cmd, "--old", old], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]  # argparse's usage error
    assert "--old" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "w").exists()


def test_the_rounds_shardio_step_needs_old(tmp_path):
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    for name in ("h200_round.sh", "timed_run.py", "bench_shard_cpu.py"):
        shutil.copy(ROOT / "bench" / name, repo / "bench" / name)
    (repo / "dsv41_convert").symlink_to(ROOT / "dsv41_convert")
    env = {k: v for k, v in os.environ.items() if k != "OLD"} | {
        "STEPS": "shardio", "PRESET": "tiny", "DEV": "cpu", "DROP": "0", "W": str(tmp_path / "w"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # python3: this interpreter's
    }  # fmt: skip
    out = tmp_path / "out"
    done = subprocess.run(["bash", "bench/h200_round.sh", str(out)], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert "shardio needs OLD=" in summary, summary
    assert not (out / "shard_io.txt").exists()  # the bench did not run
