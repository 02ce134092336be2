"""The streaming writer: output bytes do not depend on chunk size, stash budget or worker count."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.execute import select_files
from dsv41_convert.plan import build_plan
from dsv41_convert.transform import quantizer_for
from dsv41_convert.write import write_rank_file


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("s") / "bf16", quantized=False)


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_bytes_independent_of_chunk_and_stash(bf16_src, tmp_path, expert_dtype):
    plan = build_plan(bf16_src, 2, expert_dtype)
    rf = plan.files[1]
    q = quantizer_for("cpu")
    runs = {}
    for label, chunk, stash in (("big", 64 << 20, 256 << 20), ("small", 3000, 256 << 20), ("recompute", 3000, 0)):
        out = tmp_path / label
        out.mkdir()
        size, sha = write_rank_file(rf, bf16_src, out, q, chunk_bytes=chunk, stash_bytes=stash)
        assert size == rf.nbytes == (out / rf.file).stat().st_size
        assert not list(out.glob("*.partial"))
        runs[label] = sha
    assert len(set(runs.values())) == 1, runs


def test_progress_reaches_total(bf16_src, tmp_path):
    plan = build_plan(bf16_src, 1)
    seen = []
    write_rank_file(plan.files[0], bf16_src, tmp_path, quantizer_for("cpu"), lambda *a: seen.append(a))
    assert seen[-1] == (plan.files[0].file, plan.files[0].nbytes, plan.files[0].nbytes)


def test_ranks_selection(bf16_src):
    plan = build_plan(bf16_src, 4)
    assert [f.rank for f in select_files(plan, [3, 1], {})] == [1, 3]
    with pytest.raises(Exception, match="out of range"):
        select_files(plan, [4], {})
