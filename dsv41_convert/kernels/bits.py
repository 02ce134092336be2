"""Device-side scalar formats for the quantization kernels, as TileLang expressions.

Everything here works on float32 bit patterns with integer operations, so no kernel depends on
how a device rounds division, log2 or exp: a power-of-two scale is built from the exponent field
and applied by multiplying with its exact reciprocal (also a power of two), which gives the same
float32 as the references' division. These are plain Python functions that build expressions;
they are evaluated inside `@T.prim_func` bodies.

Torch equivalents are given per function; the references live in `dsv41_convert.quant`. The e2m1
encoder and the byte-permute decoders are CUDA C (`device_c`): TileLang has no byte permute.
"""

from __future__ import annotations

from dsv41_convert.kernels.tl import F32, I32, T

_MANT = 0x7FFFFF
_SUBNORMAL_2_M127 = 0x00400000  # float32 bits of 2**-127 (e8m0 byte 0)
_QNAN = 0x7FC00000  # e8m0 byte 255


def pow2_ceil_exp(x):
    """Biased exponent e (1..254) of 2**ceil(log2(x)) for a float32 x > 0.

    torch: ((bits >> 23) & 0xFF) + (bits & 0x7FFFFF != 0), clamped to 254 (quant.e8m0.pow2_ceil).
    A subnormal x gives e = 1 (2**-126), as the reference does. e is also the e8m0 byte.
    """
    b = T.reinterpret(x, I32)
    e = ((b >> T.int32(23)) & T.int32(0xFF)) + T.Cast(I32, (b & T.int32(_MANT)) != T.int32(0))
    return T.min(e, T.int32(254))


def pow2_from_exp(e):
    """2**(e - 127) as float32 for e in 1..254.  torch: ((e) << 23).view(float32)."""
    return T.reinterpret(e << T.int32(23), F32)


def recip_pow2_from_exp(e):
    """1 / 2**(e - 127) = 2**(127 - e), exact, for e in 1..254 (e = 254 gives the subnormal 2**-127)."""
    return T.reinterpret(
        T.if_then_else(e == T.int32(254), T.int32(_SUBNORMAL_2_M127), (T.int32(254) - e) << T.int32(23)), F32
    )


def e8m0_to_f32(byte):
    """Value of an e8m0 byte: 2**(b - 127); byte 0 is the subnormal 2**-127, 255 is NaN.

    torch: s.view(float8_e8m0fnu).float()
    """
    e = T.Cast(I32, byte)
    bits = T.if_then_else(
        e == T.int32(0),
        T.int32(_SUBNORMAL_2_M127),
        T.if_then_else(e == T.int32(255), T.int32(_QNAN), e << T.int32(23)),
    )
    return T.reinterpret(bits, F32)


def e2m1_value(code):
    """float32 value of a 4-bit e2m1 code (exact).  torch: quant.fp4.E2M1_VALUES[code].

    Magnitude codes 0, 1 are 0 and 0.5; codes c >= 2 are (1 + (c & 1) / 2) * 2**((c >> 1) - 1).
    """
    c = T.Cast(I32, code) & T.int32(7)
    normal = T.reinterpret((((c >> T.int32(1)) + T.int32(126)) << T.int32(23)) | ((c & T.int32(1)) << T.int32(22)), F32)
    mag = T.if_then_else(c < T.int32(2), T.Cast(F32, c) * T.float32(0.5), normal)
    return T.if_then_else((T.Cast(I32, code) & T.int32(8)) != T.int32(0), -mag, mag)


def e2m1_e4m3_byte(code):
    """The e4m3 byte holding the same value as a 4-bit e2m1 code (every e2m1 value is exact in e4m3).

    torch: E2M1_VALUES[code].to(float8_e4m3fn).view(uint8). Magnitude 0 -> 0x00, 0.5 -> 0x30, and
    c >= 2 -> exponent field (c >> 1) + 6, top mantissa bit c & 1; the sign bit moves from bit 3 to 7.
    """
    c = T.Cast("uint8", code)
    m = c & T.uint8(7)
    mag = T.if_then_else(
        m < T.uint8(2),
        m * T.uint8(0x30),
        (((m >> T.uint8(1)) + T.uint8(6)) << T.uint8(3)) | ((m & T.uint8(1)) << T.uint8(2)),
    )
    return mag | ((c & T.uint8(8)) << T.uint8(4))
