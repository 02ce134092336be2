"""bench/bench_verify.py --baseline DIR times DIR's verify: it set PYTHONPATH=DIR for `python -m
dsv41_convert.cli`, but `-m` puts the working directory first, so from the repository's root (where the
documented command runs) the "before" rows timed this checkout's verify again."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_modules import fresh_bench_module

ROOT = Path(__file__).resolve().parents[2]

FAKE_CLI = 'import json\nprint(json.dumps({"which": "baseline"}))\n'


@pytest.fixture
def bench_verify(monkeypatch):
    return fresh_bench_module(monkeypatch, "bench_verify")


def test_the_baseline_runs_its_own_cli_from_the_repository_root(bench_verify, tmp_path, monkeypatch):
    (tmp_path / "dsv41_convert").mkdir()
    (tmp_path / "dsv41_convert" / "__init__.py").write_text("")
    (tmp_path / "dsv41_convert" / "cli.py").write_text(FAKE_CLI)
    monkeypatch.chdir(ROOT)
    _, doc = bench_verify.best(1, "verify", code=tmp_path)
    assert doc == {"which": "baseline"}
