"""bench/bench_plan.py --code DIR times DIR's plan: it ran each CLI with cwd="/" (so that `python -c` would not
import the working directory's package) and PYTHONPATH=DIR as given, so a relative DIR (`--code old`) named
nothing from "/" and the package came from wherever else it could be imported (a virtualenv's editable install:
another checkout), silently; a relative WORK failed every run the same way."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from bench_modules import fresh_bench_module


@pytest.fixture
def bench_plan(monkeypatch):
    return fresh_bench_module(monkeypatch, "bench_plan")


def test_a_relative_code_folder_is_the_one_timed(bench_plan, tmp_path, monkeypatch):
    (tmp_path / "old" / "dsv41_convert").mkdir(parents=True)
    (tmp_path / "old" / "dsv41_convert" / "__init__.py").write_text("")
    (tmp_path / "old" / "dsv41_convert" / "cli.py").write_text('def main():\n    print("old checkout")\n')
    (tmp_path / "dsv41_convert").mkdir()  # the working directory's package, which must not be run either
    (tmp_path / "dsv41_convert" / "__init__.py").write_text('raise ImportError("the working directory")\n')
    monkeypatch.chdir(tmp_path)
    done = bench_plan.run_once(Path("old"), [])
    assert done.get("sha256") == hashlib.sha256(b"old checkout\n").hexdigest(), done
