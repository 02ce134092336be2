"""Seeded random values for a catalogue `Param`, and their file tensors in either source layout.

Every Param draws from its own torch.Generator, seeded from sha256(seed, name), so a tensor's values
do not depend on which other tensors exist, on shard layout or on write order.

Quantized formats are made with dsv41_convert.quant and then put in canonical form: the codes and
scales are decoded and encoded again until encoding the decoded values gives the same bytes (at most
two extra rounds; a block whose largest code is the format maximum, 448 or 6, gets its scale doubled
once because amax * f32(1/max) rounds above a power of two). Hence, for the same seed:

    bf16 checkpoint value == decode(fp8 checkpoint codes, scales)              (exact, bit for bit)
    encode(bf16 checkpoint value) == fp8 checkpoint codes and scales           (exact, byte for byte)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import Tensor

from dsv41_convert.quant import decode_fp8_blocks, decode_mxfp4, encode_fp8_blocks, encode_mxfp4
from dsv41_convert.quant.fp4 import as_fp4, as_int8
from dsv41_convert.synth.tensors import BLOCK, Fmt, Param

_FP8_BLOCK = {Fmt.FP8: (BLOCK, BLOCK), Fmt.FP8_ROWS: (1, BLOCK)}
_MAX_ROUNDS = 4


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed for one tensor, stable across runs and platforms."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def draw(p: Param, seed: int) -> Tensor:
    """Random values of a Param: mean + std * N(0, 1), each 32x32 block of a jittered weight
    multiplied by 2**k, k uniform in {-1, 0, 1}.

    -> p.shape  float32
    """
    gen = torch.Generator().manual_seed(param_seed(seed, p.name))
    w = torch.randn(p.shape, generator=gen, dtype=torch.float32)
    w.mul_(p.init.std).add_(p.init.mean)
    if p.init.jitter and w.dim() == 2:
        out, inp = w.shape
        k = torch.randint(-1, 2, (-(-out // BLOCK), -(-inp // BLOCK)), generator=gen, dtype=torch.int32)
        factor = torch.pow(2.0, k.float()).repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inp]
        w.mul_(factor)
    return w


def _fp8_canonical(w: Tensor, block: tuple[int, int], name: str) -> tuple[Tensor, Tensor]:
    q, s = encode_fp8_blocks(w, block=block, scale_fmt="ue8m0", name=name)
    for _ in range(_MAX_ROUNDS):
        q2, s2 = encode_fp8_blocks(decode_fp8_blocks(q, s, block, torch.float32), block=block, name=name)
        if torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            s2.view(torch.uint8), s.view(torch.uint8)
        ):
            return q, s
        q, s = q2, s2
    raise AssertionError(f"{name}: fp8 encode/decode did not reach a fixed point")


def _fp4_canonical(w: Tensor, name: str) -> tuple[Tensor, Tensor]:
    q, s = encode_mxfp4(w, block=BLOCK, name=name)
    for _ in range(_MAX_ROUNDS):
        q2, s2 = encode_mxfp4(decode_mxfp4(q, s, BLOCK, torch.float32), block=BLOCK, name=name)
        if torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            s2.view(torch.uint8), s.view(torch.uint8)
        ):
            return q, s
        q, s = q2, s2
    raise AssertionError(f"{name}: mxfp4 encode/decode did not reach a fixed point")


def encode_param(p: Param, w: Tensor, quantized: bool) -> dict[str, Tensor]:
    """File tensors of one Param from its float values (see tensors.file_tensors for the layouts).

    w: p.shape  float32
    -> {name: tensor}, dtypes bfloat16 / float32 / float8_e4m3fn / float8_e8m0fnu / int8
    """
    if p.fmt is Fmt.BF16:
        return {p.name: w.to(torch.bfloat16)}
    if p.fmt is Fmt.F32:
        return {p.name: w.contiguous()}
    weight, scale = f"{p.name}.weight", f"{p.name}.scale"
    if p.fmt is Fmt.FP4:
        packed, s = _fp4_canonical(w, weight)
        if not quantized:
            return {weight: decode_mxfp4(packed, s, BLOCK, torch.bfloat16)}
        return {weight: as_int8(packed).contiguous(), scale: s}
    block = _FP8_BLOCK[p.fmt]
    q, s = _fp8_canonical(w, block, weight)
    if not quantized:
        return {weight: decode_fp8_blocks(q, s, block, torch.bfloat16)}
    return {weight: q, scale: s}


_FP4_BATCH = 1 << 25  # elements per batched fp4 encode: few calls for tiny, bounded memory for medium


def encode_params(items: Iterable[tuple[Param, Tensor]], quantized: bool) -> dict[str, Tensor]:
    """`encode_param` over many Params; routed experts (FP4) with the same in-features are encoded as
    one stacked tensor (MXFP4 scales are per row, so stacking rows changes nothing but the call count).
    """
    out: dict[str, Tensor] = {}
    pending: dict[int, list[tuple[Param, Tensor]]] = {}

    def flush(batch: list[tuple[Param, Tensor]]) -> None:
        rows = [w.size(0) for _, w in batch]
        packed, s = _fp4_canonical(torch.cat([w for _, w in batch]), batch[0][0].name + ".weight")
        for (p, _), pk, sc in zip(batch, packed.split(rows), s.split(rows), strict=True):
            if quantized:
                out[f"{p.name}.weight"], out[f"{p.name}.scale"] = as_int8(pk).contiguous(), sc.contiguous()
            else:
                out[f"{p.name}.weight"] = decode_mxfp4(pk, sc, BLOCK, torch.bfloat16)
        batch.clear()

    for p, w in items:
        if p.fmt is not Fmt.FP4:
            out.update(encode_param(p, w, quantized))
            continue
        batch = pending.setdefault(w.size(1), [])
        batch.append((p, w))
        if sum(x.numel() for _, x in batch) >= _FP4_BATCH:
            flush(batch)
    for batch in pending.values():
        if batch:
            flush(batch)
    return out


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
