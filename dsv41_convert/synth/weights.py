"""Seeded values of a catalogue `Param` and its file tensors in either source layout.

Every Param draws from its own torch.Generator, seeded from sha256(seed, name), so a tensor's values
do not depend on which other tensors exist, on shard layout or on write order.

BF16 and F32 Params are mean + std * N(0, 1). Quantized Params (FP8, FP8_ROWS, FP4) are drawn as
codes and scales in canonical form (see synth.quantized); the bf16 source layout holds their decoded
values. Hence, for the same seed:

    bf16 checkpoint value == decode(fp8 checkpoint codes, scales)              (exact, bit for bit)
    encode(bf16 checkpoint value) == fp8 checkpoint codes and scales           (exact, byte for byte)
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

from dsv41_convert.convert.catalogue import BLOCK, Fmt, Param
from dsv41_convert.quant import decode_fp8_blocks, decode_mxfp4
from dsv41_convert.quant.fp4 import as_fp4
from dsv41_convert.synth.quantized import draw_fp4, draw_fp8

_FP8_BLOCK = {Fmt.FP8: (BLOCK, BLOCK), Fmt.FP8_ROWS: (1, BLOCK)}


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one tensor, stable across runs and platforms."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw(p: Param, seed: int) -> Tensor:
    """Float values of a BF16 / F32 Param: mean + std * N(0, 1).

    -> p.shape  float32
    """
    if p.fmt not in (Fmt.BF16, Fmt.F32):
        raise ValueError(f"{p.name}: draw is for BF16 / F32 params, got {p.fmt.name}; use param_tensors")
    gen = torch.Generator().manual_seed(param_seed(seed, p.name))
    w = torch.randn(p.shape, generator=gen, dtype=torch.float32)
    return w.mul_(p.init.std).add_(p.init.mean)


def param_tensors(p: Param, seed: int, quantized: bool) -> dict[str, Tensor]:
    """File tensors of one Param (see tensors.file_tensors for the layouts).

    -> {name: tensor}, dtypes bfloat16 / float32 / float8_e4m3fn / float8_e8m0fnu / int8
    """
    if p.fmt is Fmt.BF16:
        return {p.name: draw(p, seed).to(torch.bfloat16)}
    if p.fmt is Fmt.F32:
        return {p.name: draw(p, seed)}
    weight, scale = f"{p.name}.weight", f"{p.name}.scale"
    if p.fmt is Fmt.FP4:
        packed, s = draw_fp4(p.shape, p.init, param_seed(seed, p.name), weight)
        if not quantized:
            return {weight: decode_mxfp4(as_fp4(packed), s, BLOCK, torch.bfloat16)}
        return {weight: packed, scale: s}
    block = _FP8_BLOCK[p.fmt]
    q, s = draw_fp8(p.shape, p.init, block, param_seed(seed, p.name), weight)
    if not quantized:
        return {weight: decode_fp8_blocks(q, s, block, torch.bfloat16)}
    return {weight: q, scale: s}


def decode_file_tensors(p: Param, tensors: dict[str, Tensor]) -> Tensor:
    """The values a Param's file tensors stand for, in either layout (for checks and tests).

    -> p.shape  bfloat16 for quantized and BF16 formats, float32 for F32
    """
    if p.fmt in (Fmt.BF16, Fmt.F32):
        return tensors[p.name]
    weight, scale = tensors[f"{p.name}.weight"], tensors.get(f"{p.name}.scale")
    if scale is None:
        return weight
    if p.fmt is Fmt.FP4:
        return decode_mxfp4(as_fp4(weight), scale, BLOCK, torch.bfloat16)
    return decode_fp8_blocks(weight, scale, _FP8_BLOCK[p.fmt], torch.bfloat16)
