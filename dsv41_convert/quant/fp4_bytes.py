"""MXFP4 weights (e2m1 pairs, one e8m0 scale per block) decoded to bfloat16 on bytes, with numpy alone:
quant/fp4.py's decode_mxfp4 for the case the converter streams (the routed experts of a bf16 export), so
that a CPU worker computes it without importing torch. Same rule, same bytes: value = e2m1 value *
f32(scale), one rounding to bfloat16 (exact unless 6 * 2**127 overflows to infinity); a NaN scale, byte
255, is refused (byte_checks.py), though the table maps it to 0x7FC0 as decode_mxfp4 does;
tests/unit/test_quant_tables.py holds it to decode_mxfp4 bit for bit.
"""

from __future__ import annotations

import numpy as np

from dsv41_convert.quant.byte_checks import DECODED_INF, require_finite_blocks, require_scales_not_nan
from dsv41_convert.quant.code_values import E2M1_CODE_VALUES, E8M0_F32
from dsv41_convert.quant.fp8_bytes import float32_to_bf16_bits
from dsv41_convert.quant.gather import row_step, take_into


def _pair_table() -> np.ndarray:
    """uint32 [256 * 256]: entry (scale byte << 8) | packed byte holds the bfloat16 bits of both codes of the
    byte times the scale, the low nibble's first in memory, made by the rule itself for every pair."""
    byte = np.arange(256)
    values_B2 = np.stack([E2M1_CODE_VALUES[byte & 0x0F], E2M1_CODE_VALUES[byte >> 4]], axis=-1).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        bits_SB2 = float32_to_bf16_bits(E8M0_F32[:, None, None] * values_B2[None])
    return np.ascontiguousarray(bits_SB2).view(np.uint32).reshape(-1)


_PAIRS: np.ndarray | None = None  # _pair_table(), made at the first decode (256 KiB)


def decode_mxfp4_bf16(packed: np.ndarray, s: np.ndarray, block: int = 32, name: str = "<tensor>") -> np.ndarray:
    """Multiply each decoded e2m1 value by its block's scale in float32, then round to bfloat16 (one lookup
    per packed byte in a table of every (scale, packed) byte pair). Raises FormatError naming `name` and
    the first index of a NaN scale (byte 255); e2m1 codes have no NaN.

    packed: [out, in/2]              uint8 (e2m1 pairs, low nibble first; logical [out, in])
    s: [out, ceil(in/block)]         uint8 (e8m0 bytes); `block` even
    -> [out, in]                     uint16 (bfloat16 bits)
    """
    global _PAIRS
    out, half = packed.shape
    want = (out, -(-2 * half // block))
    if block % 2 or s.ndim != 2 or tuple(s.shape) != want:
        raise ValueError(
            f"{name}: scale {list(s.shape)} does not fit weight {list(packed.shape)} (block {block}): want {list(want)}"
        )
    require_scales_not_nan(s, name, (1, block))
    require_finite_blocks(packed, s, (1, block), "e2m1", name, DECODED_INF)
    if _PAIRS is None:
        _PAIRS = _pair_table()
    pairs = np.empty((out, half), np.uint32)
    step = row_step(half)
    for r in range(0, out, step):  # [R, G] scales -> [R, G * block/2] (the last group's ragged end cut)
        idx = np.repeat(s[r : r + step].astype(np.intp) << 8, block // 2, axis=1)[:, :half]
        np.bitwise_or(idx, packed[r : r + step], out=idx)
        take_into(_PAIRS, idx, pairs[r : r + step])
    return pairs.view(np.uint16).reshape(out, 2 * half)
