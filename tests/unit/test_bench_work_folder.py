"""bench_shard.py and bench_export.py start by deleting WORK if it exists (`shutil.rmtree`), whatever it holds:
`bench_shard.py /tmp/med` (a make-tiny source, meant as --src) or a typo naming a folder of one's own data
deleted it without a word. They now refuse a WORK that holds anything they did not write (a marker file says
a folder is a bench's), and still start afresh in their own folders."""

from __future__ import annotations

import sys

import pytest
from bench_modules import fresh_bench_module


class Reached(Exception):
    """The bench got past preparing WORK."""


def _stop(*args, **kwargs):
    raise Reached


@pytest.fixture
def bench(monkeypatch):
    bench_shard = fresh_bench_module(monkeypatch, "bench_shard")
    bench_export = fresh_bench_module(monkeypatch, "bench_export")
    monkeypatch.setattr(bench_shard, "planned_bytes", _stop)  # bench_shard's first step after WORK
    monkeypatch.setattr(bench_export, "measure", _stop)  # bench_export's (make-tiny)
    return {"bench_shard": bench_shard, "bench_export": bench_export}


@pytest.mark.parametrize("name", ["bench_shard", "bench_export"])
def test_a_work_folder_holding_other_files_is_refused_and_kept(bench, name, tmp_path, monkeypatch):
    work = tmp_path / "med"
    work.mkdir()
    (work / "config.json").write_text("{}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", str(work)])
    with pytest.raises(SystemExit) as e:
        bench[name].main()
    assert "not a bench's folder" in str(e.value), e.value
    assert (work / "config.json").read_text() == "{}"


@pytest.mark.parametrize("name", ["bench_shard", "bench_export"])
def test_a_previous_runs_work_folder_or_an_empty_one_is_reused(bench, name, tmp_path, monkeypatch):
    work = tmp_path / "w"
    monkeypatch.setattr(sys, "argv", [f"{name}.py", str(work), "--keep"])
    with pytest.raises(Reached):  # a new folder
        bench[name].main()
    (work / "src").mkdir()  # what a run leaves with --keep
    with pytest.raises(Reached):  # the one the first run kept: emptied
        bench[name].main()
    assert work.is_dir() and not (work / "src").exists()
