"""bench_shard.py, bench_merge_replicas.py, bench_verify_stream.py and bench_stream.py time THIS checkout's code
(bench_stream.py ran the `dsv41-convert` console script: the virtualenv's checkout, or none), whatever the
working directory and PYTHONPATH: they started the CLI as `python -m dsv41_convert.cli`, which runs the package
of the working directory first (another checkout's, or none: "No module named dsv41_convert"), and
bench_merge_replicas imported its in-process code from whatever PYTHONPATH or the virtualenv gave."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_modules import fresh_bench_module

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ["bench_shard", "bench_merge_replicas", "bench_verify_stream", "bench_stream"]
# benches whose code runs in their own process: bench_nonfinite_scan, bench_weight_digests, teacher_noise and
# bench_ref_gemm imported the package from PYTHONPATH or the virtualenv's editable install (another checkout)
IN_PROCESS = [*BENCHES, "bench_nonfinite_scan", "bench_weight_digests", "teacher_noise", "bench_ref_gemm"]


@pytest.fixture
def other_checkout(tmp_path):
    """A folder holding another dsv41_convert, which cannot be imported (its submodules could come from
    anywhere: a virtualenv's editable install serves them from the checkout it was made in)."""
    (tmp_path / "dsv41_convert").mkdir()
    (tmp_path / "dsv41_convert" / "__init__.py").write_text('raise ImportError("the other checkout")\n')
    return tmp_path


@pytest.mark.parametrize("name", BENCHES)
def test_the_bench_runs_this_checkouts_cli_from_another_checkouts_folder(name, other_checkout, monkeypatch):
    bench = fresh_bench_module(monkeypatch, name)
    done = subprocess.run([*bench.CLI, "--help"], cwd=other_checkout, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shard" in done.stdout


@pytest.mark.parametrize("name", IN_PROCESS)
def test_the_bench_imports_this_checkouts_package_beside_another_on_pythonpath(name, other_checkout):
    env = os.environ | {"PYTHONPATH": str(other_checkout)}
    cmd = [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--help"]
    done = subprocess.run(cmd, cwd=other_checkout, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_the_cli_keeps_the_callers_pythonpath_after_this_checkout(other_checkout, tmp_path, monkeypatch):
    """The caller's PYTHONPATH stays, after this checkout: it replaced it, so the GPU machine's TileLang (on
    PYTHONPATH there, .device/setup.sh) went missing for a CLI run a bench started."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "stand_in_for_tilelang.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(extra), str(other_checkout)]))
    cli = fresh_bench_module(monkeypatch, "bench_shard")._cli(ROOT)
    probe = [
        *cli[: cli.index("-m")],
        "-c",
        "import dsv41_convert, stand_in_for_tilelang; print(dsv41_convert.__file__)",
    ]
    done = subprocess.run(probe, cwd=other_checkout, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).resolve() == ROOT / "dsv41_convert" / "__init__.py"
