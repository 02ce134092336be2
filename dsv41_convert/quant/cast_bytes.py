"""The lossless MXFP4 -> fp8 cast of routed experts (upstream convert.py --expert-dtype fp8), on bytes with
numpy alone: the rule itself. quant/cast.py wraps it for torch tensors; convert/stream.py calls it on the
CPU without importing torch (a worker process that imports torch starts 1.5 s later on the dev box and
3-5 s later on the 16-core H200 host, a third of an fp8 export there).

Legend: O/I = output rows/input columns (logical), G = fp4 scale groups along I, P = packed byte pairs
along I (I/4), Ob/Ib = 32x32 block counts.

Each 32x32 output block gets one e8m0 scale: the largest fp4 scale it covers divided by 2**6. Every
e2m1 value is then multiplied by its own power-of-two offset 2**k (its fp4 scale / the block scale,
k <= 6; 6 * 2**6 = 384 fits under e4m3's 448). A negative k shifts values toward e4m3's least subnormal
(2**-9): every value survives down to k = -8, only +-4.0 (2**-9 itself) at k = -11, none below, so a block
whose scales spread too far would round or flush values; that raises FormatError instead of rounding.

The cast itself is a lookup: one table row per offset k holds the two e4m3 bytes and an exactness flag
for each of the 256 fp4 byte values, so the weight is never expanded to floats. Offsets come from the
scale bytes by integer arithmetic (byte b is 2**(b - 127), so k is a difference of bytes). Where every
offset casts every byte exactly (k >= -8, the published checkpoint's case), a wider table maps two
packed bytes (four e2m1 codes) to their four e4m3 bytes, made from the first: half the gathers.
"""

from __future__ import annotations

import numpy as np

from dsv41_convert.errors import FormatError
from dsv41_convert.numbers import e8m0_text
from dsv41_convert.quant.byte_checks import DECODED_INF, require_finite_blocks, require_scales_not_nan, source_index
from dsv41_convert.quant.code_values import E2M1_CODE_VALUES
from dsv41_convert.quant.gather import row_step, take_into

FP8_BLOCK = 32  # output block, both dims, as upstream
MAX_OFFSET_BITS = 6  # largest k with 6 * 2**k <= 448
K_MIN = -12  # offsets below this are clamped to it: at K_MIN and below every nonzero value is lost


def e4m3_exact_bits(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The e4m3 (fn) byte of each value that e4m3 holds exactly, and which ones it holds.

    y: [...] float64, |y| <= 448   -> (bits [...] uint8, 0 where not exact; exact [...] bool)
    Zeros of either sign are written as +0 (upstream writes the fp4 -0, code 8, as e4m3 +0).
    """
    a = np.abs(y)
    _, e = np.frexp(a)  # a = m * 2**e, 0.5 <= m < 1: the leading bit is 2**(e - 1)
    lead = np.maximum(e - 1, -6)  # below 2**-6 the subnormals, whose step is 2**-9 as the normals' at 2**-6
    step = np.ldexp(1.0, lead - 3)  # 3 mantissa bits
    units = a / step  # exact: a power-of-two division
    exact = (units == np.floor(units)) & (a <= 448)
    normal = a >= 2.0**-6
    mant = np.where(normal, units - 8, units).astype(np.int64)  # normals: 8..15 units, the leading bit dropped
    bits = np.where(normal, (lead + 7) << 3, 0) | mant
    bits = np.where(exact & (a > 0), bits | np.where(y < 0, 0x80, 0), 0)
    return bits.astype(np.uint8), exact


def _pair_tables() -> tuple[np.ndarray, np.ndarray]:
    """For k in K_MIN..6 and each fp4 byte: its two e4m3 bytes and whether each is exact.

    -> bytes: [(7 - K_MIN) * 256, 2]  uint8, row (k - K_MIN) * 256 + byte, low nibble first (0 where inexact)
       exact: [(7 - K_MIN) * 256, 2]  bool
    """
    byte = np.arange(256)
    vals_BN = np.stack([E2M1_CODE_VALUES[byte & 0x0F], E2M1_CODE_VALUES[byte >> 4]], axis=-1)
    y_KBN = vals_BN * np.exp2(np.arange(K_MIN, MAX_OFFSET_BITS + 1, dtype=np.float64))[:, None, None]
    bits, exact = e4m3_exact_bits(y_KBN)
    return bits.reshape(-1, 2), exact.reshape(-1, 2)


BYTES_TABLE, EXACT_TABLE = _pair_tables()
# each byte pair as one uint16 for a 1-d take, viewed back to bytes after the gather (any byte order)
_PAIR16 = np.ascontiguousarray(BYTES_TABLE).view(np.uint16).reshape(-1)
_PAIR_EXACT = EXACT_TABLE.all(axis=-1)
# offsets whose every byte casts exactly (k >= -8): a weight using only these needs no per-byte check
K_EXACT = EXACT_TABLE.reshape(-1, 256, 2).all(axis=(1, 2))
K_ALL_EXACT = K_MIN + int(K_EXACT.argmax())  # the least such offset; every larger one is exact too
assert bool(K_EXACT[K_ALL_EXACT - K_MIN :].all())
# the clamp must not make a value exact: row K_MIN holds exactly the zeros (codes 0 and 8)
assert EXACT_TABLE.reshape(-1, 256, 2)[0].sum() == 2 * 2 * 16


def quad_table() -> np.ndarray:
    """For k in K_ALL_EXACT..6 and each pair of packed bytes (as one uint16 in this machine's byte order):
    their four e4m3 bytes, from the rows of BYTES_TABLE, as one int32 (so the layout round-trips).

    -> [(7 - K_ALL_EXACT) * 65536]  int32, index (k - K_ALL_EXACT) * 65536 + the two bytes' uint16
    """
    first_second = np.arange(1 << 16, dtype=np.uint16).view(np.uint8).reshape(-1, 2).astype(np.int64)
    rows_KB2 = BYTES_TABLE.reshape(-1, 256, 2)[K_ALL_EXACT - K_MIN :]
    quad_KP4 = np.concatenate([rows_KB2[:, first_second[:, 0]], rows_KB2[:, first_second[:, 1]]], axis=-1)
    return np.ascontiguousarray(quad_KP4).view(np.int32).reshape(-1)


_QUAD32: np.ndarray | None = None  # quad_table(), made at the first cast that uses it (3.9 MB)


def fp4_to_fp8_bytes(packed: np.ndarray, s: np.ndarray, block: int = 32, name: str = "<tensor>") -> tuple:
    """Re-express an MXFP4 weight as e4m3 with 32x32 e8m0 block scales, bit-exact in value.

    block scale = max(fp4 scales in the 32x32 block) / 2**6, raised to 2**-127 if it would fall below
      (upstream's formula wherever its result is representable; the raise keeps every offset <= 2**6);
    w8 = e2m1 value * (fp4 scale / block scale), which must be exact in e4m3.
    The bytes equal upstream's, which writes the fp4 -0 (code 8) as e4m3 +0.
    Raises FormatError naming `name`, the block and the element when a value would round or underflow
    in e4m3, or when an fp4 scale is NaN (byte 255).

    packed: [out, in/2]                  uint8 (e2m1 pairs, low nibble first; logical [out, in])
    s: [out, ceil(in/block)]             uint8 (e8m0 bytes); `block` an even divisor of 32
    -> w8: [out, in]                     uint8 (e4m3 bytes)
       s8: [ceil(out/32), ceil(in/32)]   uint8 (e8m0 bytes)
    """
    if block < 2 or block % 2 or FP8_BLOCK % block:
        raise ValueError(f"{name}: fp4 block {block} must be an even divisor of the fp8 block {FP8_BLOCK}")
    if packed.ndim != 2:
        raise ValueError(f"{name}: fp4_to_fp8 wants a 2-d weight, got {list(packed.shape)}")
    out, half = packed.shape
    inp = 2 * half
    want = (out, -(-inp // block))
    if tuple(s.shape) != want:
        raise ValueError(f"{name}: scale {list(s.shape)} does not fit weight {list(packed.shape)}: want {list(want)}")
    packed, b_OG = packed.view(np.uint8), s.view(np.uint8)
    require_scales_not_nan(b_OG, name, (1, block))
    require_finite_blocks(packed, b_OG, (1, block), "e2m1", name, DECODED_INF)
    groups_per_block = FP8_BLOCK // block
    # the block's largest scale byte (zero padding never wins the max)
    amax_b = _pad_blocks(b_OG, FP8_BLOCK, groups_per_block).max(axis=(1, 3))
    s8b = np.maximum(amax_b.astype(np.int16) - MAX_OFFSET_BITS, 0)  # / 2**6, raised to byte 0 (2**-127)
    s8b_OG = np.repeat(np.repeat(s8b, FP8_BLOCK, 0)[:out], groups_per_block, 1)[:, : want[1]]
    k_OG = b_OG.astype(np.int16) - s8b_OG  # log2(fp4 scale / block scale), exact
    s8 = s8b.astype(np.uint8)
    if packed.size == 0:
        return np.zeros((out, inp), np.uint8), s8
    if block % 4 == 0 and inp % block == 0 and out and int(k_OG.min()) >= K_ALL_EXACT:
        return _cast_quads(packed, k_OG, block), s8
    kk_OG = np.maximum(k_OG.astype(np.int64), K_MIN) - K_MIN
    row_OG = kk_OG * 256
    if inp % block == 0:  # [O, G, 1] + [O, G, block/2]: no [O, I/2] copy of the rows first
        row = (row_OG[..., None] + packed.reshape(out, -1, block // 2)).reshape(-1)
    else:
        row = (np.repeat(row_OG, block // 2, axis=1)[:, :half] + packed).reshape(-1)
    if not (bool(K_EXACT[kk_OG].all()) or bool(_PAIR_EXACT[row].all())):
        o, j, nib = (int(i) for i in np.argwhere(~EXACT_TABLE[row.reshape(out, half)])[0])
        _raise_lossy(name, packed, b_OG, s8, k_OG, o, 2 * j + nib, block)
    return _PAIR16[row].view(np.uint8).reshape(out, inp), s8


def _cast_quads(packed: np.ndarray, k_OG: np.ndarray, block: int) -> np.ndarray:
    """The e4m3 bytes of every code, two packed bytes per gather from _QUAD32; every k >= K_ALL_EXACT.

    packed: [O, I/2]  uint8;  k_OG: [O, I/block]  int16 offsets;  block a multiple of 4 dividing I
    -> [O, I]         uint8 (e4m3 bytes)
    """
    global _QUAD32
    if _QUAD32 is None:
        _QUAD32 = quad_table()
    out, half = packed.shape
    pairs_OP = np.ascontiguousarray(packed).view(np.uint16)
    quads_OP = np.empty(pairs_OP.shape, np.int32)
    step = row_step(half // 2)  # quant/gather.py: a run of rows at a time, the index as intp
    for r in range(0, out, step):
        idx_OP = np.repeat((k_OG[r : r + step].astype(np.intp) - K_ALL_EXACT) << 16, block // 4, axis=1)
        # repeat, then OR arrays of one shape: half the time of a broadcast OR over runs of block/4 pairs
        np.bitwise_or(idx_OP, pairs_OP[r : r + step], out=idx_OP)
        take_into(_QUAD32, idx_OP, quads_OP[r : r + step])  # k in K_ALL_EXACT..MAX_OFFSET_BITS: in range
    return quads_OP.view(np.uint8).reshape(out, 2 * half)


def _pad_blocks(x_OI: np.ndarray, bo: int, bi: int) -> np.ndarray:
    """Zero-pad up to block multiples and view as tiles.  [O, I] -> [ceil(O/bo), bo, ceil(I/bi), bi]"""
    pad_o, pad_i = -x_OI.shape[0] % bo, -x_OI.shape[1] % bi
    if pad_o or pad_i:
        x_OI = np.pad(x_OI, ((0, pad_o), (0, pad_i)))
    return x_OI.reshape(x_OI.shape[0] // bo, bo, x_OI.shape[1] // bi, bi)


def _raise_lossy(name: str, packed, b_OG, s8b, k_OG, o: int, i: int, block: int):
    code = int(packed[o, i // 2]) >> (4 * (i % 2)) & 0x0F
    bo, bi = o // FP8_BLOCK, i // FP8_BLOCK
    block_at, at = tuple(source_index(name, [bo, bi], (FP8_BLOCK, FP8_BLOCK))), source_index(name, [o, i])
    # the scales as 2**k (they were floats, 7.52316384526264e-37 beside an offset 2**-114: a carried item)
    fp4_scale, block_scale = e8m0_text(int(b_OG[o, i // block])), e8m0_text(int(s8b[bo, bi]))
    raise FormatError(
        f"{name}: fp4->fp8 cast of block {block_at} is lossy at {at}: value {float(E2M1_CODE_VALUES[code])} "
        f"x offset 2**{int(k_OG[o, i // block])} is not exact in e4m3 (fp4 scale {fp4_scale}, "
        f"block scale {block_scale}); the block's scales spread too far for fp8: keep the routed experts in fp4 "
        "(shard --expert-dtype fp4, the default; export --format fp8-fp4 or bf16), or from a bf16 source, export "
        "--format fp8 (experts quantized to fp8 directly) and shard that"
    )
