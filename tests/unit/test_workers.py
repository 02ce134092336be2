"""--workers auto: a quarter of the cores but four on two or more (half the cores but two where most output
bytes are computed), within half the available memory (1 GiB a worker) and the number of rank files, one
with --device cuda; bad values are usage errors (exit 2), never a traceback."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import run_cli
from tiny_ckpt import make_tiny

from dsv41_convert.convert.workers import WORKER_RSS, auto_workers

GIB = 1 << 30


@pytest.mark.parametrize(
    ("files", "device", "cores", "memory", "want"),
    [
        (8, "cpu", 16, 100 * GIB, 4),  # a quarter of the cores (measured best on the 16-core host)
        (8, "cpu", 2, 20 * GIB, 4),  # the 2-core dev box: four workers fill each other's waits
        (8, "cpu", 6, 20 * GIB, 4),
        (8, "cpu", 20, 100 * GIB, 5),  # past 16 cores a quarter again
        (3, "cpu", 2, 20 * GIB, 3),  # no more workers than rank files
        (8, "cpu", 1, 20 * GIB, 1),  # one core: one worker
        (8, "cpu", 2, 3 * WORKER_RSS, 1),  # memory still bounds it
        (8, "cpu", 64, 100 * GIB, 8),  # no more workers than rank files
        (2, "cpu", 64, 100 * GIB, 2),
        (8, "cpu", 64, 5 * WORKER_RSS, 2),  # half the available memory, 1 GiB a worker
        (8, "cpu", 64, WORKER_RSS, 1),  # at least one
        (1, "cpu", 64, 100 * GIB, 1),
        (8, "cuda", 64, 100 * GIB, 1),  # one GPU: one worker
    ],
)
def test_auto_workers(files, device, cores, memory, want):
    assert auto_workers(files, device, cores=cores, memory=memory) == want


@pytest.mark.parametrize(
    ("share", "want", "want_2_cores"),
    [(0.0, 4, 4), (0.5, 4, 4), (0.51, 8, 2), (1.0, 8, 2)],  # 13 files: 16 cores give a quarter, or half where
)  # most is computed; 2 cores give the floor: four where most is copied, two where most is computed
def test_auto_workers_where_most_bytes_are_computed(share, want, want_2_cores):
    assert auto_workers(13, "cpu", cores=16, memory=100 * GIB, computed_share=share) == want
    assert auto_workers(13, "cpu", cores=2, memory=100 * GIB, computed_share=share) == want_2_cores
    assert auto_workers(13, "cpu", cores=1, memory=100 * GIB, computed_share=share) == 1
    assert auto_workers(13, "cuda", cores=16, memory=100 * GIB, computed_share=share) == 1
    assert auto_workers(13, "cpu", cores=16, memory=5 * WORKER_RSS, computed_share=share) == 2


def test_auto_counts_the_computed_bytes_of_the_plan(tmp_path, monkeypatch, capsys):
    """export --format bf16 computes most bytes; fp8-fp4 of the published layout copies every byte: the
    same 16 cores give them 8 and 4 workers."""
    import dsv41_convert.convert.execute as execute
    from dsv41_convert.convert import workers

    monkeypatch.setattr(workers, "usable_cores", lambda: 16)
    monkeypatch.setattr(workers, "available_memory", lambda: 100 * GIB)
    seen = []
    real = execute.auto_workers
    monkeypatch.setattr(execute, "auto_workers", lambda *a, **k: seen.append(k["computed_share"]) or real(*a, **k))
    src = make_tiny(tmp_path / "src")
    for fmt in ("bf16", "fp8-fp4"):
        code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(tmp_path / fmt), "--format", fmt)
        assert code == 0, err
    assert seen[0] > 0.5 and seen[1] == 0.0  # the tiny bf16 export computes 68 % of its bytes


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5"])
def test_bad_workers_is_a_usage_error(tmp_path, value):
    res = subprocess.run(
        [sys.executable, "-m", "dsv41_convert.cli", "shard", str(tmp_path), str(tmp_path / "o"), "--workers", value],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2, res.stderr
    assert "Invalid value for '--workers'" in res.stderr and "Traceback" not in res.stderr
    assert "expected a number >= 1 in the digits 0-9 or auto" in res.stderr and "Value error" not in res.stderr
    assert not (tmp_path / "o").exists()


def test_auto_is_the_default_and_reported(tmp_path, monkeypatch, capsys):
    src = make_tiny(tmp_path / "src")
    code, out, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "o"), "--tp", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["workers"] == auto_workers(2)
    code, out, err = run_cli(
        monkeypatch, capsys, "shard", str(src), str(tmp_path / "p"), "--tp", "2", "--workers", "auto", "--json"
    )
    assert code == 0, err
    assert json.loads(out)["workers"] == auto_workers(2)
    for f in (tmp_path / "o").glob("model*"):
        assert (tmp_path / "p" / f.name).read_bytes() == f.read_bytes()


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8-fp4"])
def test_workers_take_the_most_work_first(tmp_path, fmt):
    """longest_first: every file of the plan once, in non-increasing work (output bytes plus the computed
    ones, counted here from the tensors' actions); equal work keeps plan order."""
    from dsv41_convert.convert.execute import longest_first
    from dsv41_convert.convert.export import build_export_plan
    from dsv41_convert.convert.write import COPIED

    files = list(build_export_plan(make_tiny(tmp_path / "src"), fmt).plan.files)
    order = longest_first(files)
    assert sorted(f.file for f in order) == sorted(f.file for f in files)

    def work(f) -> int:
        return sum((t.end - t.begin) * (1 if t.action in COPIED else 2) for t in f.tensors) + f.tensors[0].begin

    works = [work(f) for f in order]
    assert works == sorted(works, reverse=True)
    for a, b in itertools.pairwise(order):
        if work(a) == work(b):
            assert files.index(a) < files.index(b)
    if fmt != "fp8-fp4":  # something computed: the plan's first file is not the most work
        assert order != files


@pytest.mark.parametrize(
    ("source", "fmt", "device", "want"),
    [("pub", "fp8-fp4", "cpu", False), ("pub", "fp8", "cpu", False), ("pub", "bf16", "cpu", False),
     ("pub", "fp8", "cuda", True), ("pub", "fp8-fp4", "cuda", False), ("bf16", "fp8", "cpu", True),
     ("bf16", "bf16", "cpu", False)],
)  # fmt: skip
def test_workers_import_torch_only_for_work_that_needs_it(tmp_path, source, fmt, device, want):
    """execute._needs_torch: on the CPU the published layout's actions (copies, the fp4 -> fp8 cast, the
    bf16 decoders) are numpy's; quantizing a bf16 source is torch's, and on CUDA every computed tensor is
    (kernels). A copy never needs it. Counted independently from the plan's tensors here."""
    from dsv41_convert.convert.execute import _needs_torch
    from dsv41_convert.convert.export import build_export_plan
    from dsv41_convert.convert.stream import numpy_computes
    from dsv41_convert.convert.write import COPIED

    src = make_tiny(tmp_path / "src") if source == "pub" else make_tiny(tmp_path / "src", quantized=False)
    files = list(build_export_plan(src, fmt).plan.files)
    computed = [t for f in files for t in f.tensors if t.action not in COPIED]
    assert _needs_torch(files, device) == want
    assert want == bool(computed and (device == "cuda" or not all(numpy_computes(t) for t in computed)))
