"""A finite code times a finite scale that reaches 2**128 is infinite in float32 and bfloat16 (e4m3's 448 x
2**120, e2m1's 6 x 2**126): quant/byte_checks.require_finite_blocks refuses such a block, naming the tensor,
the block and the first index, in every decoder (fp8_bytes, fp4_bytes, cast_bytes, transform.apply) and in
transform.apply's encoders' output (a source value near the bfloat16 maximum rounds up to 2**128). Checked
against an independent rule, every code times every scale byte in float64. Planted faults: a decoder or
encoder that skips the check (it wrote inf, exit 0), a line one scale byte off, a block looked at with the
wrong geometry (ragged last blocks, fp4 nibble order). Cannot catch: a wrong but finite value."""

import numpy as np
import pytest
import torch

from dsv41_convert.convert.transform import apply, quantizer_for
from dsv41_convert.errors import FormatError
from dsv41_convert.quant.byte_checks import require_finite_blocks
from dsv41_convert.quant.cast_bytes import fp4_to_fp8_bytes
from dsv41_convert.quant.fp4_bytes import decode_mxfp4_bf16
from dsv41_convert.quant.fp8_bytes import decode_fp8_blocks_bf16

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def _e4m3(byte: int) -> float:
    """|value| of an e4m3 (fn) byte, from its fields (independent of the package's tables)."""
    exp, mant = (byte >> 3) & 15, byte & 7
    return mant / 8 * 2.0**-6 if exp == 0 else (1 + mant / 8) * 2.0 ** (exp - 7)


@pytest.mark.parametrize("scale", range(240, 255))
def test_every_e4m3_code_at_every_high_scale_against_float64(scale):
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
    for code in codes:
        q = np.zeros((32, 32), np.uint8)
        q[3, 4] = code
        inf = _e4m3(int(code)) * 2.0 ** (scale - 127) >= 2.0**128
        s = np.array([[scale]], np.uint8)
        if inf:
            with pytest.raises(FormatError, match=r"w: block \(0, 0\) decodes to infinity at \[3, 4\]"):
                require_finite_blocks(q, s, (32, 32), "e4m3", "w", "why")
        else:
            require_finite_blocks(q, s, (32, 32), "e4m3", "w", "why")


@pytest.mark.parametrize("scale", range(248, 255))
@pytest.mark.parametrize("high", [False, True])
def test_every_e2m1_code_at_every_high_scale_against_float64(scale, high):
    for code in range(16):
        p = np.zeros((2, 16), np.uint8)
        p[1, 5] = code << 4 if high else code  # logical column 11 (high nibble) or 10
        inf = E2M1[code & 7] * 2.0 ** (scale - 127) >= 2.0**128
        s = np.array([[127], [scale]], np.uint8)
        col = 11 if high else 10
        if inf:
            with pytest.raises(FormatError, match=rf"block \(1, 0\) decodes to infinity at \[1, {col}\]"):
                require_finite_blocks(p, s, (1, 32), "e2m1", "w", "why")
        else:
            require_finite_blocks(p, s, (1, 32), "e2m1", "w", "why")


def test_the_numpy_decoders_refuse_a_block_that_decodes_to_infinity():
    """Ragged shapes: the last block is a partial one."""
    q = np.full((33, 65), 0x38, np.uint8)  # 1.0
    s = np.full((2, 3), 127, np.uint8)
    assert decode_fp8_blocks_bf16(q, s, (32, 32), "w").shape == (33, 65)
    s[1, 2] = 254  # 2**127: 1.0 x 2**127 is finite, 2.0 x 2**127 is not
    assert decode_fp8_blocks_bf16(q, s, (32, 32), "w").shape == (33, 65)
    q[32, 64] = 0x40  # 2.0
    with pytest.raises(FormatError, match=r"w: block \(1, 2\) decodes to infinity at \[32, 64\].*corrupt shard"):
        decode_fp8_blocks_bf16(q, s, (32, 32), "w")
    p = np.full((3, 16), 0x11, np.uint8)  # 0.5, 0.5
    sp = np.full((3, 1), 253, np.uint8)  # 2**126: 3 x 2**126 is finite, 4 x 2**126 is not
    p[2, 7] = 0x51  # low 0.5, high 3.0
    assert decode_mxfp4_bf16(p, sp, 32, "e").shape == (3, 32)
    assert fp4_to_fp8_bytes(p, sp, 32, "e")[0].shape == (3, 32)
    p[2, 7] = 0x61  # high nibble 4.0: logical column 15
    for decode in (lambda: decode_mxfp4_bf16(p, sp, 32, "e"), lambda: fp4_to_fp8_bytes(p, sp, 32, "e")):
        with pytest.raises(FormatError, match=r"e: block \(2, 0\) decodes to infinity at \[2, 15\]"):
            decode()


def test_transform_refuses_infinity_in_and_out():
    q = quantizer_for("cpu")
    w8 = torch.full((64, 64), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s8 = torch.full((2, 2), 127, dtype=torch.uint8)
    s8[1, 1] = 254
    w8.view(torch.uint8)[40, 40] = 0x48  # 4.0
    with pytest.raises(FormatError, match=r"x: block \(1, 1\) decodes to infinity at \[40, 40\]"):
        apply("dequant_bf16", [w8, s8.view(torch.float8_e8m0fnu)], q, "x", "BF16", (32, 32))
    big = torch.ones(64, 64, dtype=torch.bfloat16)
    big[7, 9] = 3.3e38  # rounds to 256 x 2**120 = 2**128 in its block
    blocks = {"quant_fp8": "0, 0", "quant_fp4": "7, 0", "quant_fp4_fp8": "7, 0", "quant_rows_fp8": "7, 0"}
    for action, b in blocks.items():
        with pytest.raises(FormatError, match=rf"y: block \({b}\) decodes to infinity at \[7, 9\].*check the source"):
            apply(action, [big], q, "y", "F8_E4M3", None)
    big[7, 9] = 3.2e38  # below: 240 x 2**120 (fp8) and 4 x 2**126 (fp4) are finite
    for action in ("quant_fp8", "quant_rows_fp8"):
        apply(action, [big], q, "y", "F8_E4M3", None)


def test_a_cast_that_makes_infinity_is_refused_and_so_is_a_source_inf():
    """An f32 source tensor published as bf16 (a norm weight of a fine-tuned checkpoint saved in f32): before
    (an audit), 3.3999e38 became inf without a word; an inf or NaN the source holds was cast along."""
    q = quantizer_for("cpu")
    x = torch.ones(4, 8)
    x[2, 3] = 3.3999e38
    with pytest.raises(FormatError, match=r"n: 3\.3999e\+38 at index \[2, 3\] is beyond torch.bfloat16's range"):
        apply("cast", [x], q, "n", "BF16", None)
    x[2, 3] = 3.38e38  # rounds to bf16's largest finite value
    assert bool(torch.isfinite(apply("cast", [x], q, "n", "BF16", None)[0]).all())
    for held in (float("inf"), float("-inf"), float("nan")):
        x[2, 3] = held
        with pytest.raises(FormatError, match=rf"n: found {held} at index \[2, 3\] .*written unchanged too"):
            apply("cast", [x], q, "n", "BF16", None)
