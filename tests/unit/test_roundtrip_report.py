"""verify/roundtrip.py on export round trips of a small checkpoint with random (non-canonical) codes: it
explains every difference a round trip may make, and it reports the faults planted in a copy."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert.export import build_export_plan, export
from dsv41_convert.verify.roundtrip import DIFFERS, SAME_VALUES, compare_checkpoints


@pytest.fixture(scope="module")
def trips(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("roundtrip")
    d = {"pub": make_tiny(base / "pub")}
    steps = (("b16", "pub", "bf16"), ("back", "b16", "fp8-fp4"), ("f8", "pub", "fp8"), ("f8back", "f8", "fp8-fp4"))
    for name, src, fmt in steps:
        d[name] = base / name
        export(build_export_plan(d[src], fmt), d[name])
    return d


def test_identical_checkpoints_report_nothing(trips):
    assert compare_checkpoints(trips["pub"], trips["pub"]) == []


def test_non_canonical_blocks_are_named_as_the_reason(trips):
    diffs = compare_checkpoints(trips["pub"], trips["back"])
    assert diffs and all(d.verdict == SAME_VALUES for d in diffs), [d for d in diffs if d.verdict != SAME_VALUES]
    for d in diffs:  # every block stored with another scale was non-canonical in A
        assert d.rescaled > 0 and d.non_canonical == d.rescaled, d


def test_signed_zeros_are_named_as_the_reason(trips):
    diffs = compare_checkpoints(trips["pub"], trips["f8back"])
    experts = [d for d in diffs if ".experts." in d.name]
    assert len(experts) == len(diffs)  # every other tensor was copied
    assert experts and all(d.verdict == SAME_VALUES and d.rescaled == 0 and "sign of zeros" in d.why for d in experts)


def _planted(trips, tmp_path: Path) -> Path:
    """A copy of the round trip with one e4m3 code one step off, one norm weight changed, one tensor gone."""
    dst = tmp_path / "copy"
    shutil.copytree(trips["back"], dst)
    for p in sorted(dst.glob("model-*.safetensors")):
        t = load_file(p)
        if "layers.0.attn.wq_a.weight" in t:
            t["layers.0.attn.wq_a.weight"].view(torch.uint8)[3, 4] ^= 0x01
        if "layers.0.attn_norm.weight" in t:
            t["layers.0.attn_norm.weight"][0] += 1
        t.pop("layers.0.attn.wkv.weight", None)
        save_file(t, p)
    return dst


def test_a_changed_code_a_changed_norm_and_a_missing_tensor_are_reported(trips, tmp_path):
    diffs = {d.name: d for d in compare_checkpoints(trips["back"], _planted(trips, tmp_path))}
    code = diffs["layers.0.attn.wq_a.weight"]
    assert code.verdict == DIFFERS and "1 of 2048 values differ, first at [3, 4]" in code.why
    assert diffs["layers.0.attn_norm.weight"].verdict == DIFFERS
    assert diffs["layers.0.attn.wkv.weight"].why == "missing in B"
    assert len(diffs) == 3


def test_a_nan_on_one_side_differs(trips, tmp_path):
    """NaN equals NaN (the same tensor on both sides), never a number: a NaN code or norm weight in B is reported."""
    dst = tmp_path / "nan"
    shutil.copytree(trips["back"], dst)
    for p in sorted(dst.glob("model-*.safetensors")):
        t = load_file(p)
        if "layers.0.attn.wq_a.weight" in t:
            t["layers.0.attn.wq_a.weight"].view(torch.uint8)[3, 4] = 0x7F  # e4m3fn NaN
        if "layers.0.attn_norm.weight" in t:
            t["layers.0.attn_norm.weight"][0] = float("nan")
        save_file(t, p)
    diffs = {d.name: d for d in compare_checkpoints(trips["back"], dst)}
    assert set(diffs) == {"layers.0.attn.wq_a.weight", "layers.0.attn_norm.weight"}, diffs
    assert all(d.verdict == DIFFERS and d.why.startswith("1 of ") for d in diffs.values()), diffs
    assert compare_checkpoints(dst, dst) == []
