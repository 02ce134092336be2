"""RoPE's frequency table against YaRN written out in float64 (tests/model_formulas.py yarn_freqs):
pair k turns at theta**(-2k/rd), the fast pairs keep that, the slow ones are divided by rope_factor,
a linear ramp over the pair index blends the band between. Compressed layers (compress_ratio > 0)
use compress_rope_theta with YaRN, window-only layers rope_theta without it.

The model computes the table in float32: measured, the frequencies (the angle at position 1) agree
to 1.7e-7 relatively and every entry up to position 63 to 3.1e-6 (an angle p * f rounded to
float32). The checks allow 1e-5 and 1e-4; an inverted ramp (the fast pairs divided, the slow ones
kept) moves a frequency by the factor, 4 or 16.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_formulas import compressed_freqs, yarn_freqs
from model_testing import tiny_args

from dsv41_convert.model.attention import Attention
from dsv41_convert.model.layers import dense_dtype
from dsv41_convert.model.rope import precompute_freqs_cis

ARGS = tiny_args(dtype="bf16", expert_dtype=None)
# (rd, theta, original_seq_len, factor, beta_fast, beta_slow)
SCHEDULES = {
    "tiny": (16, 40000.0, 32, 4.0, 32, 1),  # ramp over pairs 0..2 (pair 0's clamped at lo = 0)
    "v41-flash": (64, 160000.0, 65536, 16.0, 32, 1),  # ramp over pairs 15..25 of 32
}


def _table(freqs: torch.Tensor, seqlen: int) -> torch.Tensor:
    """e^(i p f) for positions 0..seqlen-1, float64 angles -> [seqlen, rd/2] complex128."""
    ang = torch.arange(seqlen, dtype=torch.float64)[:, None] * freqs
    return torch.polar(torch.ones_like(ang), ang)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_yarn_frequencies_match_formula(schedule):
    rd, theta, orig, factor, beta_fast, beta_slow = SCHEDULES[schedule]
    got = precompute_freqs_cis(rd, 64, orig, theta, factor, beta_fast, beta_slow)
    want = yarn_freqs(rd, theta, orig, factor, beta_fast, beta_slow)
    torch.testing.assert_close(got[1].to(torch.complex128).angle(), want, atol=0, rtol=1e-5)
    torch.testing.assert_close(got.to(torch.complex128), _table(want, 64), atol=1e-4, rtol=0)

    # the direction of the ramp, from the turns over the training context alone: a pair that turns
    # more than beta_fast times keeps its frequency, one that turns fewer than beta_slow times is
    # divided by factor
    base = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    turns = orig * base / (2 * math.pi)
    fast, slow = turns > beta_fast, turns < beta_slow
    assert slow.any() and (fast.any() or schedule == "tiny")  # tiny: no pair turns 32 times in 32 tokens
    torch.testing.assert_close(want[fast], base[fast], atol=0, rtol=1e-12)
    torch.testing.assert_close(want[slow], base[slow] / factor, atol=0, rtol=1e-12)


def test_compressed_layers_rotate_with_yarn_window_layers_without():
    yarn = compressed_freqs(ARGS)
    plain = yarn_freqs(ARGS.rope_head_dim, ARGS.rope_theta, 0, ARGS.rope_factor, ARGS.beta_fast, ARGS.beta_slow)
    rd = ARGS.rope_head_dim
    assert not torch.allclose(yarn, ARGS.compress_rope_theta ** (-torch.arange(0, rd, 2).double() / rd))  # YaRN bites
    for layer_id, ratio in enumerate(ARGS.compress_ratios):
        with dense_dtype(ARGS):
            attn = Attention(layer_id, ARGS)
        want = _table(yarn if ratio else plain, ARGS.max_seq_len)
        torch.testing.assert_close(attn.freqs_cis.to(torch.complex128), want, atol=1e-4, rtol=0)
