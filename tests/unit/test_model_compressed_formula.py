"""A kv source's compressed KV against its formula written out (tests/model_formulas.py): each group
of `ratio` tokens (j*ratio .. j*ratio + ratio - 1, no overlap) pooled through a per-channel softmax
over wgate's scores (ratio 1: wkv alone), the compressor's RMSNorm, RoPE on the last rope_head_dim
dims at the group's first token j * ratio with the YaRN frequencies of compress_rope_theta, then fp4
with one e4m3 scale per 16 values in the cache. In decode, a group's row appears in the step that
completes it, and not before.

The layer's fp4 call is observed (its input recorded, the real op still run), so the latent is
compared before its rounding: the model pools in fp32 and rotates in fp32 where the formula uses
float64, both rounding to bf16 at the same points, so a value may sit one bf16 step off. The check
allows 1% of the latent's largest magnitude (measured: 0 for the seeds here; at most 0.36%, one bf16
step, over 200 seeds of each layer, 28 of 256,000 values off at ratio 2, 5 of 537,600 at ratio 1).
Planted faults move it by: RoPE at the group's last token in prefill 47%, at the decoded token in
decode 65%, the compressor's norm dropped 138-150%, the YaRN ramp inverted 65-108%. The cache must
then hold exactly the fp4 round trip of what went in (atol 0): a block of 32 instead of 16 fails.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_formulas import assert_near, compressed_freqs, compressed_latent, fp4_e4m3_round_trip
from model_testing import random_attention, tiny_args

from dsv41_convert.model import attention
from dsv41_convert.model.attention import Attention

ARGS = tiny_args(dtype="bf16", expert_dtype=None)
SEQ = 13  # odd: at ratio 2 the last token's group is still open after the prefill
FREQS = compressed_freqs(ARGS)  # YaRN, as tests/unit/test_model_yarn_formula.py checks
LAYERS = [1, 3]  # kv sources: ratio 2 (pooled through wgate), ratio 1 (wkv alone)


def _layer(layer_id: int, seed: int) -> Attention:
    attn = random_attention(ARGS, layer_id, seed, norm_weights={"compressor.norm.weight": 0.3})
    assert attn.is_kv_source
    return attn


def _want(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    comp = attn.compressor
    wgate = comp.wgate.weight if comp.compress_ratio > 1 else None
    return compressed_latent(
        x, comp.wkv.weight, wgate, comp.norm.weight, ARGS.norm_eps, comp.compress_ratio, ARGS.rope_head_dim, FREQS
    )


@pytest.fixture
def fp4_inputs(monkeypatch) -> list[torch.Tensor]:
    """What attention.py hands to fp4_act_quant (only the compressed KV goes there), in call order."""
    seen: list[torch.Tensor] = []
    real_ops_for = attention.ops_for

    def ops_for(device):
        ops = real_ops_for(device)

        def fp4_act_quant(x, *args, **kwargs):
            seen.append(x.clone())
            return ops.fp4_act_quant(x, *args, **kwargs)

        return dataclasses.replace(ops, fp4_act_quant=fp4_act_quant)

    monkeypatch.setattr(attention, "ops_for", ops_for)
    return seen


@pytest.mark.parametrize("layer_id", LAYERS)
def test_compressed_kv_prefill_matches_formula(layer_id, fp4_inputs):
    attn = _layer(layer_id, seed=10 + layer_id)
    ratio = attn.compress_ratio
    x = torch.randn(2, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(20 + layer_id)).bfloat16()
    attn(x.clone(), 0)
    want = _want(attn, x)
    assert want.shape == (2, SEQ // ratio, ARGS.head_dim)
    (latent,) = fp4_inputs
    assert latent.shape == want.shape
    assert_near(latent, want, 1e-2)
    cached = attn.compress_kv_cache[:2, : SEQ // ratio]
    torch.testing.assert_close(cached, fp4_e4m3_round_trip(latent), atol=0, rtol=0)
    assert not attn.compress_kv_cache[:2, SEQ // ratio :].any()  # the open group wrote nothing


@pytest.mark.parametrize("layer_id", LAYERS)
def test_compressed_kv_decode_matches_formula(layer_id, fp4_inputs):
    """A prefill of 5 tokens, then one token at a time: each group's row, when its last token arrives."""
    attn = _layer(layer_id, seed=30 + layer_id)
    ratio = attn.compress_ratio
    x = torch.randn(2, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(40 + layer_id)).bfloat16()
    want = _want(attn, x)
    head = 5
    attn(x[:, :head].clone(), 0)
    assert len(fp4_inputs) == 1 and fp4_inputs[0].shape[1] == head // ratio
    for pos in range(head, SEQ):
        fp4_inputs.clear()
        attn(x[:, pos : pos + 1].clone(), pos)
        j = pos // ratio
        if (pos + 1) % ratio:  # the group is still open: nothing compressed, its row still empty
            assert not fp4_inputs and not attn.compress_kv_cache[:2, j].any()
            continue
        (latent,) = fp4_inputs
        assert latent.shape == (2, 1, ARGS.head_dim)
        assert_near(latent, want[:, j : j + 1], 1e-2)
        torch.testing.assert_close(attn.compress_kv_cache[:2, j : j + 1], fp4_e4m3_round_trip(latent), atol=0, rtol=0)
    assert bool(attn.compress_kv_cache[:2, : SEQ // ratio].abs().amax(-1).gt(0).all())  # every group's row written
