"""e8m0 scales: every byte decodes to 2**(b-127), encoding rounds up from the float32 bits."""

import math

import numpy as np
import pytest
import torch

from dsv41_convert.quant import decode_e8m0, encode_e8m0_ceil, pow2_ceil

ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal dtype, shape, NaN positions and values (atol=0, rtol=0)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan], b[~nan]), (a[~nan] != b[~nan]).nonzero()[:5].tolist()


def ceil_log2(v: float) -> int:
    """Reference: exact ceil(log2(v)) for a positive finite float, via frexp (v = m * 2**e, m in [0.5, 1))."""
    m, e = math.frexp(v)
    return e - 1 if m == 0.5 else e


def test_decode_every_byte():
    got = decode_e8m0(ALL_BYTES)
    assert got.dtype == torch.float32
    want = torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], dtype=torch.float32)
    assert_same(got, want)


@pytest.mark.parametrize(("byte", "value"), [(0, 2.0**-127), (1, 2.0**-126), (127, 1.0), (128, 2.0), (254, 2.0**127)])
def test_decode_edge_bytes(byte, value):
    got = decode_e8m0(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e8m0fnu))
    assert got.item() == value


def test_decode_byte_255_is_nan():
    assert math.isnan(decode_e8m0(torch.tensor([255], dtype=torch.uint8).view(torch.float8_e8m0fnu)).item())


def test_decode_refuses_raw_bytes():
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        decode_e8m0(torch.tensor([127], dtype=torch.uint8))


@pytest.mark.parametrize(
    ("x", "byte"),
    [
        (1.0, 127),
        (1.0000001, 128),  # one ulp above a power of two rounds up
        (0.99999994, 127),  # one ulp below stays
        (1.5, 128),
        (448.0, 127 + 9),
        (2.0**-126, 1),
        (2.0**-127, 1),  # float32 subnormal: the bit trick gives 2**-126
        (1e-45, 1),
        (2.0**127, 254),
        (3.0e38, 254),  # above 2**127: clamped
        (math.inf, 254),
    ],
)
def test_encode_ceil_edges(x, byte):
    got = encode_e8m0_ceil(torch.tensor([x], dtype=torch.float32))
    assert got.dtype == torch.float8_e8m0fnu
    assert got.view(torch.uint8).item() == byte


def test_encode_ceil_matches_frexp_reference_on_random_bits():
    gen = np.random.default_rng(0)
    # positive normal float32 below 2**127 from random bit patterns, plus exact powers of two
    bits = gen.integers(0x00800000, 0x7F000000, size=20000, dtype=np.int64).astype(np.int32)
    x = np.concatenate([bits.view(np.float32), np.ldexp(np.float32(1), np.arange(-126, 127)).astype(np.float32)])
    got = encode_e8m0_ceil(torch.from_numpy(x)).view(torch.uint8).numpy()
    want = np.array([ceil_log2(float(v)) + 127 for v in x])
    np.testing.assert_array_equal(got, want)


def test_encode_then_decode_is_an_upper_power_of_two():
    x = torch.rand(1000, dtype=torch.float32) * 1000 + 1e-3
    s = decode_e8m0(encode_e8m0_ceil(x))
    assert bool((s >= x).all()) and bool((s < 2 * x).all())


@pytest.mark.parametrize("x", [0.0, -1.0, math.nan])
def test_encode_rejects_non_positive(x):
    with pytest.raises(ValueError, match="x > 0"):
        encode_e8m0_ceil(torch.tensor([1.0, x]))


def test_pow2_ceil_special_values_follow_the_bit_trick():
    x = torch.tensor([0.0, math.inf, math.nan, 2.0**-140, 3.0e38])
    got = pow2_ceil(x)
    assert got[0].item() == 0.0
    assert got[1].item() == math.inf
    assert math.isnan(got[2].item())
    assert got[3].item() == 2.0**-126
    assert got[4].item() == math.inf


@pytest.mark.parametrize("qmax", [6.0, 448.0])
def test_scale_via_float32_reciprocal_is_the_exact_ceil(qmax):
    # the kernels round amax * f32(1/qmax), not amax / qmax; it still gives 2**ceil(log2(amax / qmax)).
    # One binade of amax (the pattern repeats in every binade whose product stays normal): every mantissa
    # within 2**16 ulps of qmax's own mantissa, where the ceil flips, plus every 64th mantissa elsewhere.
    center = int(torch.tensor([qmax]).view(torch.int32)) & ((1 << 23) - 1)
    mant = torch.cat([torch.arange(0, 1 << 23, 64), torch.arange(center - (1 << 16), center + (1 << 16))])
    amax = (mant.clamp(0, (1 << 23) - 1).to(torch.int32) + 0x3F800000).view(torch.float32)
    s = pow2_ceil(amax * torch.tensor(1 / qmax, dtype=torch.float32)).double()
    exact = amax.double() / qmax
    assert bool((s >= exact).all()) and bool((s / 2 < exact).all())
