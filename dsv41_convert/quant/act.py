"""Activation quantizers used inside the model, with upstream kernel.py's signatures and numerics.

Both quantize per row, in groups of `block_size` along the last dim, in float32. `inplace=True` is
upstream's fused quantize-dequantize: x is overwritten with the dequantized values (in x's dtype) and
returned; otherwise the codes and scales are returned.

Non-finite activations are not checked, as upstream. A group holding Inf gets an infinite scale (NaN
once stored as e8m0): its finite values quantize to 0 and the Inf to NaN, as upstream's CPU port. A
group holding NaN gets a NaN scale and NaN values (there the port's integer bit trick wraps to a -0
scale; we do not copy that accident). Every NaN that act_quant produces is the positive NaN: inf / inf
and 0 * inf give a NaN whose sign bit depends on the processor (negative on x86, positive on CUDA),
and the CUDA kernel must match these bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41_convert.quant.checks import FLOAT_INPUTS, require_dtype
from dsv41_convert.quant.e8m0 import pow2_ceil
from dsv41_convert.quant.fp4 import E2M1_VALUES, FP4_MAX, FP4_MAX_INV, encode_e2m1, pack_nibbles
from dsv41_convert.quant.fp8 import FP8_MAX_INV, e4m3_saturate

ACT_AMAX_FLOOR = 1e-4  # act_quant, as upstream
FP4_E8M0_AMAX_FLOOR = 6 * 2.0**-126  # fp4_act_quant with e8m0 scales: smallest scale 2**-126
FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9  # fp4_act_quant with e4m3 scales: smallest scale 2**-9, e4m3's least


def _groups(x: Tensor, block_size: int, what: str) -> Tensor:
    require_dtype(x, FLOAT_INPUTS, what)
    if block_size < 1 or x.size(-1) % block_size:
        raise ValueError(f"{what}: last dim of {list(x.shape)} is not a multiple of block_size {block_size}")
    return x.float().unflatten(-1, (-1, block_size))


def act_quant(
    x: Tensor,
    block_size: int = 32,
    scale_fmt: str | None = "ue8m0",
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
    inplace: bool = False,
) -> tuple[Tensor, Tensor] | Tensor:
    """Per-row block e4m3 quantization of activations (upstream kernel.py act_quant).

    amax = max |x| over the block, floored at 1e-4;
    scale = amax * f32(1/448), rounded up to a power of two from its float32 bits when scale_fmt is set;
    q = x / scale, clamped to +-448, nearest-even to e4m3.
    Upstream's defaults are block_size=128, scale_fmt=None, scale_dtype=float32; the model always passes
    all three (32, "ue8m0", float8_e8m0fnu), which are the defaults here.

    x: [..., N]                       bfloat16 (upstream's only input; float32 / float16 also accepted)
    -> inplace=False: q [..., N]      float8_e4m3fn
                      s [..., N/B]    scale_dtype (float32 values cast to it)
    -> inplace=True:  x itself        [..., N], overwritten with f32(q) * scale cast to x.dtype
    """
    xg = _groups(x, block_size, "act_quant input")
    amax = xg.abs().amax(dim=-1).clamp_min(ACT_AMAX_FLOOR)
    s = amax * FP8_MAX_INV
    if scale_fmt is not None:
        s = pow2_ceil(s)
    finite = bool(torch.isfinite(amax).all())
    q = e4m3_saturate(_positive_nan(xg / s.unsqueeze(-1), finite))
    if inplace:
        x.copy_(_positive_nan((q.float() * s.unsqueeze(-1)).flatten(-2).to(x.dtype), finite))
        return x
    return q.flatten(-2), s.to(scale_dtype)


def _positive_nan(t: Tensor, finite: bool) -> Tensor:
    """t with every NaN's sign bit cleared (nothing to do when every group was finite)."""
    return t if finite else torch.where(t.isnan(), t.abs(), t)


def fp4_act_quant(
    x: Tensor, block_size: int = 32, inplace: bool = False, scale_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor] | Tensor:
    """Per-row block e2m1 quantization of activations (upstream kernel.py fp4_act_quant).

    e8m0 scales (the indexer, block 32):
      amax floored at 6 * 2**-126; scale = amax * f32(1/6) rounded up to a power of two (float32 bits).
    e4m3 scales (the compressed KV latent, block 16):
      amax floored at 6 * 2**-9; scale = e4m3(amax / 6), nearest-even, saturating at 448.
    code = e2m1 of x / scale, clamped to +-6, nearest-even (see `encode_e2m1`).
    `scale_dtype` picks the path as upstream does; None (our default) picks e4m3 for block_size 16 and
    e8m0 otherwise, so upstream's calls fp4_act_quant(k, 32, True) and
    fp4_act_quant(latent, 16, True, scale_dtype=torch.float8_e4m3fn) both mean what they say.

    x: [..., N]                          bfloat16 (upstream's only input; float32 / float16 also accepted)
    -> inplace=False: packed [..., N/2]  float4_e2m1fn_x2 (logical [..., N])
                      s [..., N/B]       scale_dtype
    -> inplace=True:  x itself           [..., N], overwritten with e2m1 value * scale cast to x.dtype
    """
    if scale_dtype is None:
        scale_dtype = torch.float8_e4m3fn if block_size == 16 else torch.float8_e8m0fnu
    if scale_dtype not in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        raise ValueError(f"fp4_act_quant: scale_dtype must be float8_e8m0fnu or float8_e4m3fn, got {scale_dtype}")
    xg = _groups(x, block_size, "fp4_act_quant input")
    amax = xg.abs().amax(dim=-1)
    if scale_dtype == torch.float8_e4m3fn:
        s = e4m3_saturate(amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_MAX).float()
    else:
        s = pow2_ceil(amax.clamp_min(FP4_E8M0_AMAX_FLOOR) * FP4_MAX_INV)
    codes = encode_e2m1(xg / s.unsqueeze(-1))
    if inplace:
        x.copy_((E2M1_VALUES[codes.long()] * s.unsqueeze(-1)).flatten(-2))
        return x
    return pack_nibbles(codes.flatten(-2)).view(torch.float4_e2m1fn_x2), s.to(scale_dtype)
