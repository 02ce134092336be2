"""fp4 e2m1 codes, their nibble packing, and MXFP4 weights (e2m1 with one e8m0 scale per 32).

An e2m1 code is 4 bits: bit 3 is the sign, codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6. Two codes share a
byte, the even element in the low nibble; torch calls such a byte float4_e2m1fn_x2 and the checkpoint
stores the same bytes as I8. Codes 0 and 8 are +0 and -0: compare decoded values, not bytes.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41_convert.quant.checks import FLOAT_INPUTS, require_amax_finite, require_dtype
from dsv41_convert.quant.code_values import E2M1_CODE_VALUES
from dsv41_convert.quant.e8m0 import pow2_ceil

FP4_MAX = 6.0
# the kernels multiply by this float32 reciprocal rather than divide by 6; we do the same
FP4_MAX_INV = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)
MXFP4_AMAX_FLOOR = 6 * 2.0**-126  # keeps the smallest scale at 2**-126, a normal float32

E2M1_VALUES = torch.from_numpy(E2M1_CODE_VALUES).float()
"""Value of each 4-bit code 0..15, float32 [16]; code 8 is -0.0."""

_BYTES = (torch.uint8, torch.int8)
# the two values of every packed byte (low nibble first) as one int64, for a fast 1-d index_select
_BYTE_PAIRS = torch.stack([E2M1_VALUES[torch.arange(256) & 0x0F], E2M1_VALUES[torch.arange(256) >> 4]], dim=-1)
_BYTE_PAIRS64 = _BYTE_PAIRS.contiguous().view(torch.int64).view(-1)

# Midpoints between neighbouring magnitudes. bucketize (right=False) counts the bounds strictly below |x|,
# so a tie rounds down; where the upper neighbour has the even code (0.75 -> 1.0 code 2, 1.75 -> 2.0
# code 4, 3.5 -> 4.0 code 6) the bound is moved one float32 ulp down so that the tie rounds up.
_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIE_UP = torch.tensor([False, True, False, True, False, True, False])
_E2M1_BOUNDS = torch.where(_TIE_UP, torch.nextafter(_E2M1_MIDS, torch.zeros(7)), _E2M1_MIDS)


def encode_e2m1(x: Tensor) -> Tensor:
    """Round to the nearest e2m1 code; ties go to the even code; magnitudes clamp at 6.

    The sign bit follows torch.signbit, so -0.0 and negatives that round to zero give code 8 (-0).
    NaN gives code 0 or 8 (as the upstream comparison-based rounding does).

    x: [...]  float32 / bfloat16 / float16
    -> [...]  uint8 codes 0..15
    """
    x = x.float()
    sign = torch.signbit(x).to(torch.uint8) << 3
    # code = how many rounding boundaries lie below |x| (inf counts all 7: it clamps to 6)
    code = torch.bucketize(torch.nan_to_num(x.abs(), nan=0.0), _E2M1_BOUNDS, out_int32=True)
    return code.to(torch.uint8) | sign


@functools.cache
def _e2m1_of_bf16() -> Tensor:
    """The code of every bf16 bit pattern (read as uint16), made by `encode_e2m1` itself: a gather through
    it gives encode_e2m1's codes for a bf16 input without its binary search (about 25x slower).
    -> [65536] uint8. Made at first use, not at import: 65536 elements start torch's OpenMP pool, and a
    process forked after that (verify's ranks come from a fork server that imports this module) hangs in
    its first parallel op."""
    return encode_e2m1(torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16))


def decode_e2m1(codes: Tensor) -> Tensor:
    """Value of each code (exact).

    codes: [...]  uint8 0..15
    -> [...]      float32
    """
    require_dtype(codes, (torch.uint8,), "decode_e2m1 codes")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"decode_e2m1: codes must be 0..15, got max {int(codes.max())}")
    return E2M1_VALUES[codes.long()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """Two codes per byte: element 2k in the low nibble, 2k+1 in the high nibble.

    codes: [..., n]    uint8 0..15, n even
    -> [..., n/2]      uint8
    """
    require_dtype(codes, (torch.uint8,), "pack_nibbles codes")
    if codes.size(-1) % 2:
        raise ValueError(f"pack_nibbles: last dim must be even, got {list(codes.shape)}")
    if sys.byteorder == "little" and codes.is_contiguous() and codes.device.type == "cpu" and codes.numel():
        # each pair as one int16 (even element in the low byte): hi << 8 | lo -> hi << 4 | lo in the low
        # byte, in three passes over half as many elements instead of four strided ones
        pairs = codes.view(torch.int16) & 0x0F0F
        return (pairs | (pairs >> 4)).to(torch.uint8)
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of `pack_nibbles`.

    packed: [..., m]   uint8 / int8 / float4_e2m1fn_x2 (bytes reinterpreted, not converted)
    -> [..., 2m]       uint8 codes 0..15
    """
    b = packed.view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def decode_e2m1_pairs(packed: Tensor, out: Tensor | None = None) -> Tensor:
    """Value of every code of packed bytes (exact): one 8-byte table entry per byte, both nibbles at once.

    packed: [..., m]      float4_e2m1fn_x2 / int8 / uint8 (logical [..., 2m])
    out:    [..., 2m]     float32, contiguous, written and returned (allocated when None)
    -> [..., 2m]          float32, the low nibble's value first; code 8 gives -0.0
    """
    require_dtype(packed, (torch.float4_e2m1fn_x2, *_BYTES), "decode_e2m1_pairs input")
    shape = (*packed.shape[:-1], 2 * packed.size(-1))
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=packed.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != shape or not out.is_contiguous():
        raise ValueError(f"decode_e2m1_pairs: out {out.dtype} {list(out.shape)}, want contiguous float32 {list(shape)}")
    idx = packed.reshape(-1).view(torch.uint8).int()
    torch.index_select(_BYTE_PAIRS64.to(packed.device), 0, idx, out=out.view(-1).view(torch.int64))
    return out


def as_fp4(packed: Tensor) -> Tensor:
    """Reinterpret packed e2m1 bytes (the checkpoint's I8) as torch's fp4 pair dtype; no copy.

    packed: [out, in/2]  int8 / uint8
    -> [out, in/2]       float4_e2m1fn_x2 (logical [out, in]), same storage
    """
    require_dtype(packed, _BYTES, "as_fp4")
    return packed.view(torch.float4_e2m1fn_x2)


def as_int8(packed: Tensor) -> Tensor:
    """Reinterpret fp4 pairs as the checkpoint's I8 bytes; no copy.

    packed: [out, in/2]  float4_e2m1fn_x2 (or uint8 / int8)
    -> [out, in/2]       int8, same storage
    """
    require_dtype(packed, (torch.float4_e2m1fn_x2, *_BYTES), "as_int8")
    return packed.view(torch.int8)


def check_mxfp4_input(w: Tensor, name: str) -> None:
    """encode_mxfp4's input rules (also the CUDA encoder's): a float dtype and an even last dim."""
    require_dtype(w, FLOAT_INPUTS, f"{name}: encode_mxfp4 input")
    if w.dim() < 1 or w.size(-1) % 2:
        raise ValueError(f"{name}: encode_mxfp4 wants an even last dim, got {list(w.shape)}")


def encode_mxfp4(w: Tensor, block: int = 32, name: str = "<tensor>") -> tuple[Tensor, Tensor]:
    """Quantize a weight to MXFP4: e2m1 codes with one e8m0 scale per `block` along the last dim.

    amax = max |w| over the block, floored at 6 * 2**-126;
    scale = 2**ceil(log2(amax * f32(1/6))) from the float32 bits;
    code = e2m1 of w / scale, clamped to +-6, nearest-even (see `encode_e2m1`).
    A last dim not a multiple of `block` gets ceil(in/block) scales. NaN or Inf in `w` raises
    FormatError naming `name` and the first bad index. A bfloat16 `w` on the CPU takes its codes from a
    table of every bf16 pattern (`_encode_e2m1_scaled_bf16`): the same codes, ~10x faster.

    w: [..., in]                 float32 / bfloat16 / float16, in even
    -> packed: [..., in/2]       float4_e2m1fn_x2 (logical [..., in])
       s: [..., ceil(in/block)]  float8_e8m0fnu
    """
    check_mxfp4_input(w, name)
    if block < 1:
        raise ValueError(f"{name}: block must be >= 1, got {block}")
    inp = w.size(-1)
    table = w.dtype == torch.bfloat16 and w.device.type == "cpu"  # codes by _encode_e2m1_scaled_bf16
    wf = w.float()
    if inp % block:
        wf = F.pad(wf, (0, -inp % block))
    groups = wf.unflatten(-1, (-1, block))
    amax = (groups.abs_() if table else groups.abs()).amax(dim=-1)  # a bf16 w's float copy is free to reuse
    require_amax_finite(amax, w, name)
    s = pow2_ceil(amax.clamp_min(MXFP4_AMAX_FLOOR) * FP4_MAX_INV)
    if table:
        wb = F.pad(w, (0, -inp % block)) if inp % block else w
        codes = _encode_e2m1_scaled_bf16(wb.unflatten(-1, (-1, block)), s.unsqueeze(-1))
    else:
        codes = encode_e2m1(groups / s.unsqueeze(-1))
    codes = codes.flatten(-2)[..., :inp]
    return pack_nibbles(codes).view(torch.float4_e2m1fn_x2), s.to(torch.float8_e8m0fnu)


def _encode_e2m1_scaled_bf16(w: Tensor, s: Tensor) -> Tensor:
    """encode_e2m1(w.float() / s), bit for bit, for a bf16 `w` and power-of-two float32 scales `s`.

    w / s only moves the exponent, so wherever it is a normal float32 it is exact in bf16 too, and
    w * bf16(1/s) gives it in bf16 (1/s is exact for s in [2**-126, 2**127]); below 2**-126 both give
    code 0 or 8 with w's sign. The code is then a gather through _e2m1_of_bf16().

    w: [..., G, B]  bfloat16 (CPU);  s: [..., G, 1]  float32 powers of two
    -> [..., G, B]  uint8 codes 0..15
    """
    y = w * (1.0 / s).bfloat16()
    return _e2m1_of_bf16().index_select(0, y.reshape(-1).view(torch.uint16).int()).view(y.shape)


def decode_mxfp4(packed: Tensor, s: Tensor, block: int = 32, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Multiply each decoded e2m1 value by its block's scale in float32, then cast to `dtype`.

    The float32 product is exact unless it overflows (6 * 2**127 -> inf); one rounding at the cast.
    On the CPU, to bfloat16 with an even `block` that divides in: a gather of both values of each
    byte from a (scale byte, packed byte) table that this float path made (the same bits, ~2x faster).

    packed: [..., in/2]          float4_e2m1fn_x2 / int8 / uint8 (logical [..., in])
    s: [..., ceil(in/block)]     float8_e8m0fnu
    -> [..., in]                 dtype (bfloat16 by default)
    """
    require_dtype(packed, (torch.float4_e2m1fn_x2, *_BYTES), "decode_mxfp4 weight")
    require_dtype(s, (torch.float8_e8m0fnu,), "decode_mxfp4 scale")
    inp = 2 * packed.size(-1)
    want = (*packed.shape[:-1], -(-inp // block))
    if tuple(s.shape) != want:
        raise ValueError(
            f"decode_mxfp4: scale {list(s.shape)} does not fit weight {list(packed.shape)}: want {list(want)}"
        )
    if dtype == torch.bfloat16 and packed.device.type == "cpu" and block % 2 == 0 and inp % block == 0:
        # (scale byte, packed byte) -> the two bf16 values, from _mxfp4_bf16_table() (the float path's)
        idx = (s.view(torch.uint8).int() << 8).unsqueeze(-1) + packed.view(torch.uint8).unflatten(-1, (-1, block // 2))
        return _mxfp4_bf16_table().index_select(0, idx.view(-1)).view(torch.bfloat16).view(*packed.shape[:-1], inp)
    return _decode_mxfp4_float(packed, s, block, dtype)


def _decode_mxfp4_float(packed: Tensor, s: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    """decode_mxfp4 in float32 arithmetic (any dtype, block, device); shapes checked by the caller."""
    inp = 2 * packed.size(-1)
    v = decode_e2m1_pairs(packed)
    if inp % block:
        v = F.pad(v, (0, -inp % block))
    v = v.unflatten(-1, (-1, block)) * s.float().unsqueeze(-1)
    return v.flatten(-2)[..., :inp].to(dtype)


@functools.cache
def _mxfp4_bf16_table() -> Tensor:
    """The two bf16 values of every (e8m0 scale byte, packed byte), by the float path: row = scale byte
    (255 is NaN), column = packed byte; each pair as one int32, so the layout round-trips on any byte order.

    -> [256 * 256]  int32, index scale byte * 256 + packed byte. Made at first use (see _e2m1_of_bf16).
    """
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).expand(256, 256)
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu).view(256, 1)
    return _decode_mxfp4_float(packed, s, 512, torch.bfloat16).view(torch.int32).reshape(-1)
