"""bench/bench_export.py's round trip compares the checkpoint's files, not make-tiny's mark: since make-tiny
writes `.dsv41-make-tiny` beside every checkpoint (which export does not copy), every fp8-fp4 and
bf16 -> fp8-fp4 row reported `files_differing_from_pub: [".dsv41-make-tiny"]` for a byte-exact round trip."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsv41_convert.synth.staged import MARK

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_export(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_export", None)
    import bench_export

    return bench_export


def test_the_make_tiny_mark_is_no_difference(bench_export, tmp_path):
    pub, out = tmp_path / "pub", tmp_path / "out"
    for folder in (pub, out):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model-00001-of-00001.safetensors").write_bytes(b"same")
    (pub / MARK).write_text("make-tiny\n")
    assert bench_export._compare(pub, out) == []


def test_a_changed_or_missing_file_is_a_difference(bench_export, tmp_path):
    pub, out = tmp_path / "pub", tmp_path / "out"
    for folder in (pub, out):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    (pub / "model-00001-of-00001.safetensors").write_bytes(b"ours")
    (out / "config.json").write_text('{"x": 1}')
    assert bench_export._compare(pub, out) == ["config.json", "model-00001-of-00001.safetensors"]
