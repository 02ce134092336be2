"""The window-only attention layer against its formula written out (tests/model_formulas.py):
low-rank query, one shared KV head, RoPE on the last rope_head_dim dims (pairs 2k, 2k+1, plain
rope_theta, no YaRN), the fp8 round trip of the KV, softmax scale head_dim**-0.5, the sink in the
denominator only, the sliding window, the query's rotation undone on the output, grouped wo_a, wo_b.

The model runs bf16 GEMMs and rounds P to bf16 before P.V, so the comparison allows 2% of the
output's scale (measured: under 0.5%); each fault these tests exist for (softmax scale 1/d, RoPE
turned the wrong way or on the wrong dims, no inverse rotation, a dropped sink, YaRN on a window
layer) moves the output by tens of percent of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from model_formulas import assert_near, attend, e4m3_round_trip, grouped_out, rms, rope_tail
from model_testing import random_attention, tiny_args

from dsv41_convert.model.attention import Attention

ARGS = tiny_args(dtype="bf16", expert_dtype=None)
SEQ = 12  # longer than the window (8): the window cuts in


def _layer(seed: int) -> Attention:
    return random_attention(ARGS, 0, seed)  # layer 0: window only


def window_attention(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """The layer's output at every position of x ([b, s, dim], positions 0..s-1)."""
    rd, d, eps, theta = attn.rope_head_dim, attn.head_dim, ARGS.norm_eps, ARGS.rope_theta
    pos = torch.arange(x.size(1))
    qr = rms(F.linear(x, attn.wq_a.weight), attn.q_norm.weight, eps)
    q = rope_tail(F.linear(qr, attn.wq_b.weight).unflatten(-1, (attn.n_heads, d)), rd, pos, theta)
    kv = e4m3_round_trip(rope_tail(rms(F.linear(x, attn.wkv.weight), attn.kv_norm.weight, eps), rd, pos, theta))
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - attn.window_size)
    o = rope_tail(attend(q, kv, visible, attn.attn_sink), rd, pos, theta, inverse=True)
    return grouped_out(o, attn.wo_a.weight, attn.wo_b.weight, attn.n_groups)


def test_window_layer_prefill_matches_formula():
    attn = _layer(seed=1)
    x = torch.randn(2, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert_near(attn(x.clone(), 0), window_attention(attn, x))


def test_window_layer_decode_matches_formula():
    """The last position, decoded after a prefill of the others, reads the ring buffer."""
    attn = _layer(seed=3)
    x = torch.randn(2, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(4)).bfloat16()
    attn(x[:, : SEQ - 1].clone(), 0)
    got = attn(x[:, SEQ - 1 :].clone(), SEQ - 1)
    assert_near(got, window_attention(attn, x)[:, SEQ - 1 :])


def test_window_kv_lies_on_the_e4m3_grid():
    """Every cached window KV row, 32 values at a time, is e4m3 codes times a power of two."""
    attn = _layer(seed=5)
    x = torch.randn(2, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(6)).bfloat16()
    attn(x, 0)
    cached = attn.window_kv_cache[:2].float().unflatten(-1, (-1, 32))
    assert cached.abs().amax() > 0
    scale = torch.exp2(torch.ceil(torch.log2(cached.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448)))
    codes = cached / scale
    assert torch.equal(codes.to(torch.float8_e4m3fn).float(), codes)


def test_compressed_kv_lies_on_the_fp4_grid_of_its_own_16_values():
    """A kv source's cached compressed rows: per 16 values, e2m1 codes times one e4m3 scale that puts the
    block's largest magnitude at code 6 (scale = e4m3(amax / 6) rounds by under 6.25%, so amax / scale
    rounds to 6)."""
    attn = random_attention(ARGS, 3, seed=7)  # ratio 1, kv source
    x = torch.randn(2, SEQ, ARGS.dim, generator=torch.Generator().manual_seed(8)).bfloat16()
    attn(x, 0)
    blocks = attn.compress_kv_cache[:2, :SEQ].float().unflatten(-1, (-1, 16))
    scale = blocks.abs().amax(-1, keepdim=True) / 6
    assert bool((scale > 0).all())
    assert torch.equal(scale.to(torch.float8_e4m3fn).float(), scale)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert bool(torch.isin((blocks / scale).abs(), grid).all())
