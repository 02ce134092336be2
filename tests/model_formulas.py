"""The model's arithmetic written out in plain torch for the formula tests: no code shared with
dsv41_convert.model, float64 where the model's own rounding does not matter.

rms:      RMSNorm in fp32, the weight applied before the one bf16 rounding.
rope:     pairs (2k, 2k+1) of the last dim rotated by position * theta**(-2k/rd), from float64 angles.
e4m3_round_trip: per 32 values, scale 2**ceil(log2(amax / 448)) (amax floored at 1e-4), e4m3 codes.
attend:   softmax(q.k * scale) over the visible keys with the sink's exp in the denominator only, float64.
"""

from __future__ import annotations

import math

import torch


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., n] bf16, w: [n] -> [..., n] bf16"""
    xf = x.float()
    return (w.float() * xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).bfloat16()


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, inverse: bool = False) -> torch.Tensor:
    """x: [b, s, rd] or [b, s, h, rd]; pos: [s] positions -> x rotated, x's dtype."""
    rd = x.size(-1)
    freqs = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = pos.double()[:, None] * freqs  # [s, rd/2]
    if x.dim() == 4:
        ang = ang[:, None]
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def rope_tail(x: torch.Tensor, rd: int, pos: torch.Tensor, theta: float, inverse: bool = False) -> torch.Tensor:
    """RoPE on the last rd dims of x only (the nope dims pass through)."""
    return torch.cat([x[..., :-rd], rope(x[..., -rd:], pos, theta, inverse)], dim=-1)


def e4m3_round_trip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x: [..., n] -> [..., n] bf16 on the e4m3 grid of its block's power-of-two scale."""
    xb = x.float().unflatten(-1, (-1, block))
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    codes = (xb / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (codes * scale).flatten(-2).bfloat16()


def attend(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """q: [b, m, h, d], kv: [b, n, d], visible: [m, n] bool, sink: [h] -> [b, m, h, d] bf16."""
    logits = torch.einsum("bqhd,bkd->bqhk", q.double(), kv.double()) / math.sqrt(q.size(-1))
    logits = logits.masked_fill(~visible[None, :, None, :], -math.inf)
    m = logits.amax(-1, keepdim=True)
    e = (logits - m).exp()
    denom = e.sum(-1, keepdim=True) + (sink.double()[None, None, :, None] - m).exp()
    return torch.einsum("bqhk,bkd->bqhd", e / denom, kv.double()).bfloat16()


def grouped_out(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, groups: int) -> torch.Tensor:
    """o: [b, s, h, d] -> wo_b(per-group wo_a(o)) [b, s, dim] bf16; wo_a: [g * r, h * d / g]."""
    b, s = o.shape[:2]
    o = o.reshape(b, s, groups, -1).double()
    low = torch.einsum("bsgx,grx->bsgr", o, wo_a.double().view(groups, -1, o.size(-1))).bfloat16()
    return torch.nn.functional.linear(low.flatten(2), wo_b)


def assert_near(got: torch.Tensor, want: torch.Tensor, frac: float = 2e-2) -> None:
    """max |got - want| within `frac` of want's largest magnitude (bf16 GEMM and rounding noise)."""
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= frac * scale, f"max |diff| {err:.4g} vs scale {scale:.4g}"
