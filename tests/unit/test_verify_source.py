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
