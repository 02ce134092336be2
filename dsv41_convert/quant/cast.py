"""The lossless MXFP4 -> fp8 cast of routed experts (upstream convert.py --expert-dtype fp8).

Legend: O/I = output rows/input columns (logical), G = fp4 scale groups along I, P = packed byte pairs
along I (I/4), Ob/Ib = 32x32 block counts.

Each 32x32 output block gets one e8m0 scale: the largest fp4 scale it covers divided by 2**6. Every
e2m1 value is then multiplied by its own power-of-two offset 2**k (its fp4 scale / the block scale,
k <= 6; 6 * 2**6 = 384 fits under e4m3's 448). A negative k shifts values toward e4m3's least subnormal
(2**-9): every value survives down to k = -8, none below k = -10, so a block whose scales spread too far
would round or flush values; that raises FormatError instead of rounding.

The cast itself is a lookup: one table row per offset k holds the two e4m3 bytes and an exactness flag
for each of the 256 fp4 byte values, so the weight is never expanded to float32. Offsets come from the
scale bytes by integer arithmetic (byte b is 2**(b - 127), so k is a difference of bytes). Where every
offset casts every byte exactly (k >= -8, the published checkpoint's case), a wider table maps two
packed bytes (four e2m1 codes) to their four e4m3 bytes, made from the first: half the gathers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dsv41_convert.errors import FormatError
from dsv41_convert.quant.checks import require_dtype
from dsv41_convert.quant.fp4 import E2M1_VALUES
from dsv41_convert.quant.fp8 import pad_blocks

FP8_BLOCK = 32  # output block, both dims, as upstream
MAX_OFFSET_BITS = 6  # largest k with 6 * 2**k <= 448
K_MIN = -11  # offsets below this are clamped to it: they lose every nonzero value either way


def _pair_tables() -> tuple[Tensor, Tensor]:
    """For k in K_MIN..6 and each fp4 byte: its two e4m3 bytes and whether each is exact.

    -> bytes: [(7 - K_MIN) * 256, 2]  uint8, row (k - K_MIN) * 256 + byte, low nibble first
       exact: [(7 - K_MIN) * 256, 2]  bool
    """
    byte = torch.arange(256)
    vals_BN = torch.stack([E2M1_VALUES[byte & 0x0F], E2M1_VALUES[byte >> 4]], dim=-1)
    vals_BN = torch.where(vals_BN == 0, 0.0, vals_BN)  # as upstream convert.py: code 8 (-0) is written as +0
    y_KBN = vals_BN * torch.exp2(torch.arange(K_MIN, MAX_OFFSET_BITS + 1, dtype=torch.float32))[:, None, None]
    q_KBN = y_KBN.to(torch.float8_e4m3fn)  # |y| <= 384: never saturates; exactness is checked, not assumed
    return q_KBN.view(torch.uint8).reshape(-1, 2), (q_KBN.float() == y_KBN).reshape(-1, 2)


_BYTES_TABLE, _EXACT_TABLE = _pair_tables()
# 1-d forms for index_select (much faster than advanced indexing): each byte pair as one int16, viewed
# back to bytes after the gather, so the layout round-trips on any byte order
_PAIR16 = _BYTES_TABLE.contiguous().view(torch.int16).view(-1)
_PAIR_EXACT = _EXACT_TABLE.all(dim=-1)
# offsets whose every byte casts exactly (k >= -8): a weight using only these needs no per-byte check
_K_EXACT = _EXACT_TABLE.view(-1, 256, 2).all(dim=2).all(dim=1)
K_ALL_EXACT = K_MIN + int(_K_EXACT.int().argmax())  # the least such offset; every larger one is exact too
assert bool(_K_EXACT[K_ALL_EXACT - K_MIN :].all())


def _quad_table() -> Tensor:
    """For k in K_ALL_EXACT..6 and each pair of packed bytes (as one uint16 in this machine's byte order):
    their four e4m3 bytes, from the rows of _BYTES_TABLE, as one int32 (so the layout round-trips).

    -> [(7 - K_ALL_EXACT) * 65536]  int32, index (k - K_ALL_EXACT) * 65536 + the two bytes' uint16
    """
    first_second = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(-1, 2).long()
    rows_KB2 = _BYTES_TABLE.view(-1, 256, 2)[K_ALL_EXACT - K_MIN :]
    quad_KP4 = torch.cat([rows_KB2[:, first_second[:, 0]], rows_KB2[:, first_second[:, 1]]], dim=-1)
    return quad_KP4.contiguous().view(torch.int32).view(-1)


_QUAD32: Tensor | None = None  # _quad_table(), made at the first cast that uses it (3.9 MB)


def fp4_to_fp8(packed: Tensor, s: Tensor, block: int = 32, name: str = "<tensor>") -> tuple[Tensor, Tensor]:
    """Re-express an MXFP4 weight as e4m3 with 32x32 e8m0 block scales, bit-exact in value.

    block scale = max(fp4 scales in the 32x32 block) / 2**6, raised to 2**-127 if it would fall below
      (upstream's formula wherever its result is representable; the raise keeps every offset <= 2**6);
    w8 = e2m1 value * (fp4 scale / block scale), which must be exact in e4m3.
    So decode_fp8_blocks(w8, s8) == decode_mxfp4(packed, s) value for value (in float32, before any cast);
    the bytes equal upstream's, which writes the fp4 -0 (code 8) as e4m3 +0.
    Raises FormatError naming `name`, the block and the element when a value would round or underflow
    in e4m3, or when an fp4 scale is NaN (byte 255).

    packed: [out, in/2]                     float4_e2m1fn_x2 / int8 / uint8 (logical [out, in])
    s: [out, ceil(in/block)]                float8_e8m0fnu; `block` an even divisor of 32
    -> w8: [out, in]                        float8_e4m3fn
       s8: [ceil(out/32), ceil(in/32)]      float8_e8m0fnu
    """
    require_dtype(packed, (torch.float4_e2m1fn_x2, torch.int8, torch.uint8), f"{name}: fp4_to_fp8 weight")
    require_dtype(s, (torch.float8_e8m0fnu,), f"{name}: fp4_to_fp8 scale")
    if block < 2 or block % 2 or FP8_BLOCK % block:
        raise ValueError(f"{name}: fp4 block {block} must be an even divisor of the fp8 block {FP8_BLOCK}")
    if packed.dim() != 2:
        raise ValueError(f"{name}: fp4_to_fp8 wants a 2-d weight, got {list(packed.shape)}")
    out, half = packed.shape
    inp = 2 * half
    want = (out, -(-inp // block))
    if tuple(s.shape) != want:
        raise ValueError(f"{name}: scale {list(s.shape)} does not fit weight {list(packed.shape)}: want {list(want)}")
    b_OG = s.view(torch.uint8)
    groups_per_block = FP8_BLOCK // block
    # in bytes: the block's largest scale (zero padding never wins the max; a NaN, byte 255, always does)
    amax_b = pad_blocks(b_OG, FP8_BLOCK, groups_per_block).amax(dim=(1, 3))
    if bool((amax_b == 255).any()):
        first = [int(i) for i in (b_OG == 255).nonzero()[0]]
        raise FormatError(f"{name}: scale is NaN (e8m0 byte 255) at {first}; expected a power of two; corrupt shard?")
    s8b = (amax_b.short() - MAX_OFFSET_BITS).clamp_min(0)  # / 2**6, raised to byte 0 (2**-127)
    s8b_OG = s8b.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(groups_per_block, 1)[:, : want[1]]
    k_OG = b_OG.short() - s8b_OG  # log2(fp4 scale / block scale), exact
    s8 = s8b.to(torch.uint8).view(torch.float8_e8m0fnu)
    if block % 4 == 0 and inp % block == 0 and int(k_OG.min()) >= K_ALL_EXACT:
        return _cast_quads(packed, k_OG, block), s8
    kk_OG = k_OG.int().clamp_min(K_MIN) - K_MIN
    row_OG = kk_OG * 256
    if inp % block == 0:  # [O, G, 1] + [O, G, block/2]: no [O, I/2] copy of the rows first
        row = (row_OG.unsqueeze(-1) + packed.view(torch.uint8).unflatten(-1, (-1, block // 2))).view(-1)
    else:
        row = (row_OG.repeat_interleave(block // 2, dim=1)[:, :half] + packed.view(torch.uint8)).view(-1)
    exact = bool(_K_EXACT.index_select(0, kk_OG.view(-1)).all()) or bool(_PAIR_EXACT.index_select(0, row).all())
    if not exact:
        o, j, nib = (int(i) for i in (~_EXACT_TABLE[row.view(out, half)]).nonzero()[0])
        _raise_lossy(name, packed, s.float(), s8.float(), k_OG, o, 2 * j + nib, block)
    w8 = _PAIR16.index_select(0, row).view(torch.uint8).view(out, inp).view(torch.float8_e4m3fn)
    return w8, s8


def _cast_quads(packed: Tensor, k_OG: Tensor, block: int) -> Tensor:
    """The e4m3 bytes of every code, two packed bytes per gather from _QUAD32; every k >= K_ALL_EXACT.

    packed: [O, I/2]  fp4 bytes (CPU);  k_OG: [O, I/block]  int16 offsets;  block a multiple of 4 dividing I
    -> [O, I]         float8_e4m3fn
    """
    global _QUAD32
    if _QUAD32 is None:
        _QUAD32 = _quad_table()
    out, half = packed.shape
    base_OG = ((k_OG.int() - K_ALL_EXACT) << 16).numpy()  # each group's part of the table
    pairs_OP = packed.view(torch.uint8).contiguous().view(torch.uint16).numpy()
    # repeat, then OR arrays of one shape: half the time of a broadcast OR over runs of block/4 pairs
    idx_OP = np.repeat(base_OG, block // 4, axis=1)
    np.bitwise_or(idx_OP, pairs_OP, out=idx_OP)
    quads = _QUAD32.index_select(0, torch.from_numpy(idx_OP).view(-1))
    return quads.view(torch.uint8).view(out, 2 * half).view(torch.float8_e4m3fn)


def _raise_lossy(name: str, packed: Tensor, s_OG: Tensor, s8: Tensor, k_OG: Tensor, o: int, i: int, block: int):
    code = int(packed.view(torch.uint8)[o, i // 2]) >> (4 * (i % 2)) & 0x0F
    bo, bi = o // FP8_BLOCK, i // FP8_BLOCK
    raise FormatError(
        f"{name}: fp4->fp8 cast of block ({bo}, {bi}) is lossy at [{o}, {i}]: value {float(E2M1_VALUES[code])} "
        f"x offset 2**{int(k_OG[o, i // block])} is not exact in e4m3 (fp4 scale {float(s_OG[o, i // block])}, "
        f"block scale {float(s8[bo, bi])}); the block's scales spread too far; keep this tensor in fp4"
    )
