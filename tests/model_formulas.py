"""The model's arithmetic written out in plain torch for the formula tests: no code shared with
dsv41_convert.model, float64 where the model's own rounding does not matter; the number formats are
tests/quant_reference.py's.

rms:      RMSNorm in fp32, the weight applied before the one bf16 rounding.
rope:     pairs (2k, 2k+1) of the last dim rotated by position * theta**(-2k/rd), from float64 angles
          (or position * freqs[k] for given frequencies, e.g. yarn_freqs).
yarn_freqs: theta**(-2k/rd) blended towards theta**(-2k/rd) / factor by YaRN's linear ramp, float64.
e4m3_round_trip: per 32 values, e4m3 codes times the power of two at or above amax / 448 (act_ref).
fp4_e4m3_round_trip: per 16 values, e2m1 codes times the scale e4m3(amax / 6) (fp4_act_ref).
compressed_latent: a kv source's compressed KV rows before their fp4 rounding: softmax-gated pooling
          of each group of `ratio` tokens, RMSNorm, RoPE at the group's first token.
attend:   softmax(q.k * scale) over the visible keys with the sink's exp in the denominator only, float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from quant_reference import act_ref, e2m1_values, e4m3_values, fp4_act_ref


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., n] bf16, w: [n] -> [..., n] bf16"""
    xf = x.float()
    return (w.float() * xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).bfloat16()


def yarn_freqs(
    rd: int, theta: float, original_seq_len: int, factor: float, beta_fast: int, beta_slow: int
) -> torch.Tensor:
    """-> [rd/2] float64: pair k's frequency theta**(-2k/rd), YaRN-scaled when original_seq_len > 0.

    d(turns) = rd * ln(original_seq_len / (2 pi turns)) / (2 ln theta) is the (fractional) pair index
    whose wavelength fits `turns` times into the training context; lo = max(floor(d(beta_fast)), 0),
    hi = min(ceil(d(beta_slow)), rd - 1), ramp_k = clamp((k - lo) / max(hi - lo, 1e-3), 0, 1):
    ramp 0 (the fast pairs below lo) keeps the frequency, ramp 1 (the slow pairs from hi on) divides
    it by `factor`, the pairs in between are blended linearly.
    """
    freqs = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    if original_seq_len <= 0:
        return freqs

    def pair_for_turns(turns: float) -> float:
        return rd * math.log(original_seq_len / (2 * math.pi * turns)) / (2 * math.log(theta))

    lo = max(math.floor(pair_for_turns(beta_fast)), 0)
    hi = min(math.ceil(pair_for_turns(beta_slow)), rd - 1)
    ramp = ((torch.arange(rd // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
    return freqs * (1 - ramp) + freqs / factor * ramp


def compressed_freqs(args) -> torch.Tensor:
    """-> [rope_head_dim/2] float64: the compressed layers' frequencies (compress_rope_theta, YaRN) of ModelArgs."""
    return yarn_freqs(
        args.rope_head_dim, args.compress_rope_theta, args.original_seq_len, args.rope_factor, args.beta_fast,
        args.beta_slow,
    )  # fmt: skip


def rope(
    x: torch.Tensor, pos: torch.Tensor, theta: float, inverse: bool = False, freqs: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [b, s, rd] or [b, s, h, rd]; pos: [s] positions -> x rotated, x's dtype.
    freqs: [rd/2] the pairs' frequencies (yarn_freqs); None: theta**(-2k/rd)."""
    rd = x.size(-1)
    if freqs is None:
        freqs = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = pos.double()[:, None] * freqs  # [s, rd/2]
    if x.dim() == 4:
        ang = ang[:, None]
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    a, b = x.double()[..., 0::2], x.double()[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def rope_tail(
    x: torch.Tensor,
    rd: int,
    pos: torch.Tensor,
    theta: float,
    inverse: bool = False,
    freqs: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on the last rd dims of x only (the nope dims pass through)."""
    return torch.cat([x[..., :-rd], rope(x[..., -rd:], pos, theta, inverse, freqs)], dim=-1)


def e4m3_round_trip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x: [..., n] -> [..., n] bf16 on the e4m3 grid of its block's power-of-two scale (quant_reference.act_ref)."""
    codes, scales = act_ref(x, block, ue8m0=True)
    return _dequantized(e4m3_values(codes), scales, block)


def fp4_e4m3_round_trip(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """x: [..., n] -> [..., n] bf16: e2m1 codes times one e4m3 scale per `block` values
    (quant_reference.fp4_act_ref)."""
    codes, scales = fp4_act_ref(x, block, e4m3_scale=True)
    return _dequantized(e2m1_values(codes), scales, block)


def _dequantized(values: np.ndarray, scales: np.ndarray, block: int) -> torch.Tensor:
    """values [..., n] times their block's scale [..., n/block] (exact in float64), as bf16."""
    out = values.reshape(*scales.shape, block) * scales[..., None].astype(np.float64)
    return torch.from_numpy(out.reshape(values.shape)).bfloat16()


def compressed_latent(
    x: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor | None,
    norm_w: torch.Tensor,
    eps: float,
    ratio: int,
    rd: int,
    freqs: torch.Tensor,
) -> torch.Tensor:
    """The compressed KV rows of x ([b, s, dim], positions 0..s-1) before their fp4 rounding.

    Group j holds tokens j*ratio .. j*ratio + ratio - 1 (no overlap; an incomplete last group gives
    no row). ratio 1: the row is wkv(x) in bf16. ratio > 1: per channel, a softmax over the group's
    wgate(x) scores weights the group's wkv(x) values, summed (float64 here, fp32 in the model),
    rounded to bf16. Then RMSNorm, and RoPE on the last rd dims at the group's first token j * ratio.
    wkv, wgate: [d, dim]; freqs: [rd/2] -> [b, s // ratio, d] bf16
    """
    s = x.size(1)
    full = s - s % ratio
    kv = torch.nn.functional.linear(x[:, :full].double(), wkv.double())
    if ratio == 1:
        pooled = kv.bfloat16()
    else:
        score = torch.nn.functional.linear(x[:, :full].double(), wgate.double())
        gate = score.unflatten(1, (-1, ratio)).softmax(dim=2)  # over the group's tokens, per channel
        pooled = (kv.unflatten(1, (-1, ratio)) * gate).sum(dim=2).bfloat16()
    pos = torch.arange(0, full, ratio)
    return rope_tail(rms(pooled, norm_w, eps), rd, pos, 0.0, freqs=freqs)


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
