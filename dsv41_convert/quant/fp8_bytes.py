"""e4m3 weights with e8m0 block scales decoded to bfloat16 on bytes, with numpy alone: quant/fp8.py's
decode_fp8_blocks for the case the converter streams (upstream's wo_a dequantization, and every fp8
weight of a bf16 export), so that a CPU worker computes it without importing torch (3-5 s per process
on the 16-core H200 host). Same rule, same bytes: value = f32(q) * f32(scale), one rounding to bfloat16
(nearest-even); tests/unit/test_quant_tables.py holds it to decode_fp8_blocks bit for bit on every
finite pair. A NaN scale or weight byte is refused, not decoded (byte_checks.py), so the table's NaN
entries (0x7FC0; torch's decode of e4m3 NaN writes 0xFFFF) are never looked up.
"""

from __future__ import annotations

import numpy as np

from dsv41_convert.quant.byte_checks import (
    DECODED_INF,
    require_e4m3_not_nan,
    require_finite_blocks,
    require_scales_not_nan,
)
from dsv41_convert.quant.code_values import E4M3_F32, E8M0_F32
from dsv41_convert.quant.gather import row_step, take_into


def _bf16_table() -> np.ndarray:
    """uint16 [256 * 256]: entry (scale byte << 8) | weight byte is the bfloat16 of f32(weight) * f32(scale),
    made by the rule itself for every pair, so a lookup is the rule (overflow, subnormals, NaN included)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float32_to_bf16_bits(E8M0_F32[:, None] * E4M3_F32[None, :]).reshape(-1)


def decode_fp8_blocks_bf16(q: np.ndarray, s: np.ndarray, block: tuple[int, int], name: str = "<tensor>") -> np.ndarray:
    """Multiply each e4m3 block by its e8m0 scale in float32, then round to bfloat16 (by one lookup per
    element in a table of every (scale, weight) byte pair). Raises FormatError naming `name` and the first
    index of a NaN scale (byte 255) or weight byte (0x7F, 0xFF).

    q: [out, in]                        uint8 (e4m3 bytes)
    s: [ceil(out/bo), ceil(in/bi)]      uint8 (e8m0 bytes)
    -> [out, in]                        uint16 (bfloat16 bits)
    """
    global _BF16
    bo, bi = block
    out, inp = q.shape
    want = (-(-out // bo), -(-inp // bi))
    if s.ndim != 2 or tuple(s.shape) != want:
        raise ValueError(
            f"{name}: scale {list(s.shape)} does not fit weight {list(q.shape)} in {bo}x{bi} blocks: want {list(want)}"
        )
    require_scales_not_nan(s, name, block)
    require_e4m3_not_nan(q, name)
    require_finite_blocks(q, s, block, "e4m3", name, DECODED_INF)
    if _BF16 is None:
        _BF16 = _bf16_table()
    result = np.empty((out, inp), np.uint16)
    step = row_step(inp)
    for r in range(0, out, step):  # each row's scales [R, Ib] -> [R, Ib * bi] (the last block's ragged end cut)
        end = min(r + step, out)
        idx = np.repeat(s[np.arange(r, end) // bo].astype(np.intp) << 8, bi, axis=1)[:, :inp]
        np.bitwise_or(idx, q[r:end], out=idx)
        take_into(_BF16, idx, result[r:end])
    return result


_BF16: np.ndarray | None = None  # _bf16_table(), made at the first decode (128 KiB)


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16, nearest-even (subnormals and overflow to infinity included); NaN -> 0x7FC0.

    x: [...] float32  -> [...] uint16
    """
    u = x.view(np.uint32)
    bits = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    bits[np.isnan(x)] = 0x7FC0
    return bits
