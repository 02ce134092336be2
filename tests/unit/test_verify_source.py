"""verify.source.plan_state: one rank's file of a tp-N plan computed in memory is the rank file `shard` writes,
byte for byte (Engram padding rows included): what `reference-logits --tp N` runs on each rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.verify.source import plan_state


@pytest.mark.parametrize(("quantized", "tp"), [(True, 4), (True, 8), (False, 4)])
def test_rank_state_is_the_rank_file(tmp_path, quantized, tp):
    src = make_tiny(tmp_path / "src", quantized=quantized, vision=False)
    plan = build_plan(src, tp)
    execute(plan, tmp_path / "out")
    for rank in range(tp):
        want = load_file(str(tmp_path / "out" / f"model{rank}-mp{tp}.safetensors"))
        got = plan_state(plan, rank)
        assert set(got) == set(want)
        for name, w in want.items():
            g = got[name]
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), name


def test_the_reference_of_a_bf16_source_is_the_unquantized_model(tmp_path):
    """A bf16 source's reference runs its bf16 weights (verify's quantized mode compares the conversion with
    them), not the converter's fp8/fp4 output: no Linear or expert weight is quantized. The Engram table is the
    one exception (its row quantization is not one of the skipped actions): the only scale made."""
    from dsv41_convert.verify.source import reference_state

    fmt, state = reference_state(make_tiny(tmp_path / "src", quantized=False, vision=False))
    assert fmt == "bf16"
    for name in ("layers.0.attn.wq_a.weight", "layers.0.attn.wo_a.weight", "layers.0.ffn.experts.0.w1.weight"):
        assert state[name].dtype == torch.bfloat16, name
    assert [n for n in state if n.endswith(".scale")] == ["layers.1.engram.embed.scale"]


@pytest.mark.parametrize(("expert_dtype", "want"), [("fp4", "fp4"), ("fp8", "fp8"), (None, "fp4")])
def test_source_experts_follow_the_config(tmp_path, expert_dtype, want):
    """export --format fp8 writes expert_dtype fp8: the reference must read those experts as fp8."""
    import json

    from tiny_ckpt import tiny_config

    from dsv41_convert.verify.source import source_experts

    cfg = tiny_config(quantized=expert_dtype is not None, vision=False)
    if expert_dtype is not None:
        cfg["quantization_config"]["expert_dtype"] = expert_dtype
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert source_experts(tmp_path) == want
