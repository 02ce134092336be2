"""bench/bench_shard.py's arguments are refused before anything is written: `--experts 4` (fewer routed
experts than the 6 each token picks) ended in a ConfigError traceback, and `--experts 12` (not a multiple of
the bench's tp 8) wrote its source and timed `cp` before `shard` refused the model."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bench_modules import fresh_bench_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("experts", ["4", "12"])
def test_an_expert_count_the_bench_cannot_run_is_refused_by_argparse(tmp_path, experts):
    work = tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "bench" / "bench_shard.py"), str(work), "--experts", experts, "--skip-in-ram"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]  # argparse's usage error
    assert "--experts" in done.stderr and "Traceback" not in done.stderr
    assert not work.exists()  # nothing written


@pytest.fixture
def bench_shard(monkeypatch):
    return fresh_bench_module(monkeypatch, "bench_shard")


def test_a_disk_too_small_is_refused_before_the_source_is_written(bench_shard, tmp_path, monkeypatch):
    """Without --src the bench writes a source of 2.48 GB or more (23.7 GB with the default 384 experts), then
    a copy or tp 8's output beside it: on a disk too small it wrote until ENOSPC and ended in an OSError
    traceback, after minutes. Now it says how much it needs before writing anything."""
    work = tmp_path / "work"

    def no_bytes(size):
        raise AssertionError("the source's bytes were written")

    monkeypatch.setattr(bench_shard, "source_bytes", no_bytes)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=3 * 10**9))  # 3 GB free
    monkeypatch.setattr(sys, "argv", ["bench_shard.py", str(work), "--experts", "8", "--gb", "0", "--skip-in-ram"])
    with pytest.raises(SystemExit) as e:
        bench_shard.main()
    message = str(e.value)
    assert "3.0 GB free" in message and "needs 7.4 GB" in message, message  # 2.48 GB in, 4.55 GB out, 2% to spare
    assert not work.exists()


def test_the_source_size_and_output_are_planned_without_writing_bytes(bench_shard, tmp_path):
    """The sizes the check compares are those of the run: the source `write_source` would write and the
    bytes `shard --tp 8` writes of it (its own plan over the headers of a hollow, sparse copy)."""
    src_bytes, out_bytes = bench_shard.planned_bytes(tmp_path / "plan", 0, 8)
    assert round(src_bytes / 1e9, 3) == 2.479 and round(out_bytes / 1e9, 3) == 4.547  # one run's JSON
    assert not (tmp_path / "plan").exists()


def test_an_in_ram_run_that_cannot_fit_is_refused_before_the_source_is_written(bench_shard, tmp_path, monkeypatch):
    """The all-in-RAM run comes last and holds the whole source and more (3.5 GB for a 2.48 GB source): with
    the default 384 experts (23.7 GB) on a 24 GiB box it was killed after the cp and shard runs, and the bench
    ended in 'failed (-9)' without printing what it had measured. Now it says so before writing anything."""
    work = tmp_path / "work"

    def no_bytes(size):
        raise AssertionError("the source's bytes were written")

    monkeypatch.setattr(bench_shard, "source_bytes", no_bytes)
    monkeypatch.setattr(bench_shard, "available_memory", lambda: 3 * 10**9, raising=False)
    monkeypatch.setattr(sys, "argv", ["bench_shard.py", str(work), "--experts", "8", "--gb", "0"])
    with pytest.raises(SystemExit) as e:
        bench_shard.main()
    assert "--skip-in-ram" in str(e.value) and "3.0 GB available" in str(e.value), e.value
    assert not work.exists()
