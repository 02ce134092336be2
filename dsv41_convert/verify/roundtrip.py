"""Tensor by tensor: do two Hugging Face checkpoints in the same format hold the same weights, and where
their bytes differ, why (the report of an export round trip, e.g. published -> bf16 -> fp8-fp4).

A quantized weight is compared with its `.scale` as one value: same bytes; or same values in other bytes,
and then which blocks A stores with a non-canonical scale (SPEC §6: a block whose largest code lies at or
below half the format's maximum, e4m3 <= 224 or e2m1 <= 3, which the encoder, given the decoded values,
stores with a smaller scale and larger codes) and which values differ only in the sign of a zero (the
fp4 -> fp8 cast writes the e2m1 -0 as +0); or different values, with the largest difference.

Catches: a tensor missing on one side, another dtype or shape, any changed value (decoded in float64,
exact for these formats and every scale byte). Cannot tell: why two checkpoints with different values differ.
Reads one tensor at a time (pread, no mmap of whole shards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dsv41_convert.quant import E2M1_VALUES, e4m3_to_float, infer_block
from dsv41_convert.quant.file_dtypes import tensor_from_bytes
from dsv41_convert.quant.fp4 import decode_e2m1_pairs
from dsv41_convert.quant.fp8 import pad_blocks, unpad_blocks
from dsv41_convert.store.safetensors_header import TensorInfo, pread_exact, read_header

SAME_BYTES, SAME_VALUES, DIFFERS = "same bytes", "same values", "differs"


@dataclass(frozen=True)
class TensorDiff:
    name: str
    verdict: str  # same values | differs (tensors with the same bytes are not listed)
    why: str
    rescaled: int = 0  # scale blocks stored with another scale in B
    non_canonical: int = 0  # of those, the blocks A stores with a non-canonical scale


def _index(folder: Path) -> dict[str, tuple[Path, TensorInfo]]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        for name, info in read_header(path).tensors.items():
            out[name] = (path, info)
    return out


def _load(where: tuple[Path, TensorInfo]) -> Tensor:
    """One tensor in its file dtype (I8 as int8).

    -> [*shape]  DTYPES[dtype]
    """
    path, info = where
    buf = bytearray(info.nbytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        pread_exact(fd, memoryview(buf), info.begin, str(path))
    finally:
        os.close(fd)
    return tensor_from_bytes(buf, info.dtype, info.shape)


def _bits(t: Tensor) -> Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _decode(q: Tensor, s: Tensor) -> Tensor:
    """Weight x scale in float64: exact for every code and scale byte (in float32, as the decoders multiply, a
    block scaled near 2**127 overflows to inf, and two different values there compared equal: an audit).

    q: [out, in] float8_e4m3fn, or [out, in/2] int8 (packed e2m1)
    s: its float8_e8m0fnu scale: [ceil(out/bo), ceil(in/bi)], or [out, ceil(in/32)]
    -> [out, in]  float64
    """
    s64 = s.float().double()  # every e8m0 byte is a float32 (2**-127 a subnormal, 255 NaN)
    if q.dtype == torch.int8:
        v = decode_e2m1_pairs(q).double()
        inp = v.size(-1)
        return unpad_blocks(pad_blocks(v, 1, 32) * s64[:, None, :, None], v.size(0), inp)
    bo, bi = infer_block(q.shape, s.shape)
    return unpad_blocks(pad_blocks(e4m3_to_float(q).double(), bo, bi) * s64[:, None, :, None], *q.shape)


def non_canonical(q: Tensor, s: Tensor) -> Tensor:
    """Per scale entry: the block's largest code magnitude is at most half the format's maximum.

    q: [out, in] float8_e4m3fn or [out, in/2] int8 (packed e2m1); s: [*grid] float8_e8m0fnu
    -> [*grid] bool
    """
    if q.dtype == torch.int8:
        b = q.view(torch.uint8)
        mags = E2M1_VALUES[torch.stack((b & 0x0F, b >> 4), -1).flatten(-2).long() & 7]
        return mags.unflatten(-1, (-1, 32)).amax(-1) <= 3
    bo, bi = infer_block(q.shape, s.shape)
    return pad_blocks(q.float().abs(), bo, bi).amax(dim=(1, 3)) <= 224


def _same_values(name: str, qa: Tensor, sa: Tensor, qb: Tensor, sb: Tensor) -> TensorDiff:
    """A quantized weight whose values agree in other bytes: which blocks moved to another scale, and why.
    Under an unchanged scale equal values have equal codes but for the sign of zero (e4m3 and e2m1 have
    no other duplicate encodings of a number)."""
    moved = sa.view(torch.uint8) != sb.view(torch.uint8)
    n_moved = int(moved.sum())
    if not n_moved:
        return TensorDiff(name, SAME_VALUES, "same scales; only the sign of zeros differs (-0 vs +0)")
    explained = int((moved & non_canonical(qa, sa)).sum())
    why = (
        f"{n_moved} of {moved.numel()} blocks stored with another scale, {explained} of them non-canonical in A "
        "(largest code at most half the format's maximum: the encoder picks a smaller scale)"
    )
    return TensorDiff(name, SAME_VALUES, why, n_moved, explained)


def _compare(name: str, a: dict, b: dict) -> TensorDiff | None:
    ta, tb = _load(a[name]), _load(b[name])
    if (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
        return TensorDiff(name, DIFFERS, f"A has {ta.dtype} {list(ta.shape)}, B {tb.dtype} {list(tb.shape)}")
    sname = name.removesuffix(".weight") + ".scale"
    packed = ta.dtype in (torch.float8_e4m3fn, torch.int8)
    quantized = packed and name.endswith(".weight") and sname in a and sname in b
    sa = _load(a[sname]) if quantized else None
    sb = _load(b[sname]) if quantized else None
    if torch.equal(_bits(ta), _bits(tb)) and (not quantized or torch.equal(_bits(sa), _bits(sb))):
        return None
    va, vb = (_decode(ta, sa), _decode(tb, sb)) if quantized else (ta.float(), tb.float())
    equal = (va == vb) | (va.isnan() & vb.isnan())
    if not bool(equal.all()):
        where = tuple(int(i) for i in (~equal).nonzero()[0])
        first = f"first at {list(where)}: {float(va[where])} in A, {float(vb[where])} in B"
        return TensorDiff(name, DIFFERS, f"{int((~equal).sum())} of {equal.numel()} values differ, {first}")
    if quantized:
        return _same_values(name, ta, sa, tb, sb)
    return TensorDiff(name, SAME_VALUES, "only the sign of zeros differs (-0 vs +0)")


def compare_checkpoints(a: Path, b: Path) -> list[TensorDiff]:
    """Every tensor whose bytes differ between folders `a` and `b`, with the verdict and the reason; [] when
    every tensor of both is byte-identical. A `.scale` is judged with its weight."""
    ia, ib = _index(Path(a)), _index(Path(b))
    out = [TensorDiff(n, DIFFERS, "missing in B") for n in sorted(set(ia) - set(ib))]
    out += [TensorDiff(n, DIFFERS, "missing in A") for n in sorted(set(ib) - set(ia))]
    for name in sorted(set(ia) & set(ib)):
        weight = name.removesuffix(".scale") + ".weight"
        if name.endswith(".scale") and weight in ia and weight in ib:
            continue  # judged with its weight
        diff = _compare(name, ia, ib)
        if diff is not None:
            out.append(diff)
    return out
