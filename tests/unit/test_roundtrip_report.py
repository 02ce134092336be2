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
from dsv41_convert.verify.roundtrip import DIFFERS, SAME_VALUES, compare_checkpoints, non_canonical


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


def test_a_changed_scale_beside_an_unchanged_weight_differs(trips, tmp_path):
    """A weight and its `.scale` are one value: a scale byte bumped (every value of its block doubled) while the codes
    keep their bytes is reported under the weight's name, never as identical."""
    dst = tmp_path / "scale"
    shutil.copytree(trips["back"], dst)
    for p in sorted(dst.glob("model-*.safetensors")):
        t = load_file(p)
        if "layers.0.attn.wq_a.scale" in t:
            raw = t["layers.0.attn.wq_a.scale"].view(torch.uint8).clone()
            raw[0, 0] += 1
            t["layers.0.attn.wq_a.scale"] = raw.view(torch.float8_e8m0fnu)
        save_file(t, p)
    diffs = {d.name: d for d in compare_checkpoints(trips["back"], dst)}
    assert set(diffs) == {"layers.0.attn.wq_a.weight"}, diffs
    assert diffs["layers.0.attn.wq_a.weight"].verdict == DIFFERS


def test_a_tensor_only_b_holds_is_reported(trips, tmp_path):
    """A tensor B adds (a stray one, or one A lost) is reported as missing in A, as one B lacks is missing in B."""
    dst = tmp_path / "extra"
    shutil.copytree(trips["back"], dst)
    first = sorted(dst.glob("model-*.safetensors"))[0]
    t = load_file(first)
    t["layers.0.attn.extra.weight"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(t, first)
    diffs = compare_checkpoints(trips["back"], dst)
    assert [(d.name, d.verdict, d.why) for d in diffs] == [("layers.0.attn.extra.weight", DIFFERS, "missing in A")]
    assert [d.why for d in compare_checkpoints(dst, trips["back"])] == ["missing in B"]


def test_an_fp4_block_whose_largest_code_is_half_the_maximum_is_non_canonical():
    """SPEC §6: an e2m1 block is non-canonical when its largest magnitude is at most 3 (half of 6): exactly 3
    counts; 4 does not. The nibble of 3.0 is 0b0101, of -3.0 0b1101, of 4.0 0b0110."""
    scale = torch.full((3, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    q = torch.tensor([[0x55] * 16, [0xD5] * 16, [0x56] * 16], dtype=torch.uint8).view(torch.int8)
    assert non_canonical(q, scale).tolist() == [[True], [True], [False]]


def test_a_tensor_of_another_shape_differs_by_its_shape(trips, tmp_path):
    """A norm weight one element shorter in B (same dtype): the report names both shapes; its values are not compared
    (they cannot be, element by element)."""
    dst = tmp_path / "shape"
    shutil.copytree(trips["back"], dst)
    length = 0
    for p in sorted(dst.glob("model-*.safetensors")):
        t = load_file(p)
        if "layers.0.attn_norm.weight" in t:
            length = t["layers.0.attn_norm.weight"].numel()
            t["layers.0.attn_norm.weight"] = t["layers.0.attn_norm.weight"][:-1].clone()
        save_file(t, p)
    (diff,) = compare_checkpoints(trips["back"], dst)
    assert diff.name == "layers.0.attn_norm.weight" and diff.verdict == DIFFERS
    assert diff.why == f"A has torch.bfloat16 [{length}], B torch.bfloat16 [{length - 1}]"


def _with_huge_scale(trips, dst: Path, weight: str, code: int) -> Path:
    """A copy of the round trip whose `weight` has scale byte 254 (2**127) for its first block and `code` as its
    first byte (an e4m3 code, or an I8 byte of two e2m1 nibbles)."""
    shutil.copytree(trips["back"], dst)
    scale = weight.removesuffix(".weight") + ".scale"
    for p in sorted(dst.glob("model-*.safetensors")):
        t = load_file(p)
        if weight in t:
            raw = t[scale].view(torch.uint8).clone()
            raw[0, 0] = 254
            t[scale] = raw.view(torch.float8_e8m0fnu)
            t[weight].view(torch.uint8)[0, 0] = code
            save_file(t, p)
    return dst


@pytest.mark.parametrize(
    ("weight", "code_a", "code_b"),
    [
        ("layers.0.attn.wq_a.weight", 0x7E, 0x7D),  # e4m3 448 and 416
        ("layers.0.ffn.experts.0.w1.weight", 0x77, 0x66),  # e2m1 pairs (6, 6) and (4, 4)
    ],
)
def test_values_past_float32s_range_are_compared_exactly(trips, tmp_path, weight, code_a, code_b):
    """A block whose e8m0 scale is 2**127 holds values past float32's largest (448 * 2**127, 6 * 2**127); shard and
    export copy such blocks as they are (README), so a round trip may hold them. Decoded in float32, both sides
    were inf, and a code changed there was reported as the same values ("only the sign of zeros differs")."""
    assert 448 * 2.0**127 != 416 * 2.0**127 and 6 * 2.0**127 != 4 * 2.0**127  # Python floats: exact
    a = _with_huge_scale(trips, tmp_path / "a", weight, code_a)
    b = _with_huge_scale(trips, tmp_path / "b", weight, code_b)
    diffs = {d.name: d for d in compare_checkpoints(a, b)}
    assert set(diffs) == {weight}, diffs
    assert diffs[weight].verdict == DIFFERS and "first at [0, 0]" in diffs[weight].why, diffs[weight]
    assert compare_checkpoints(a, a) == []
