"""fp8 e4m3 block weights, checked against a scalar e4m3 reference built from the bit layout."""

import math

import numpy as np
import pytest
import torch
from quant_reference import E4M3_POS, e4m3_ref, e4m3_value, encode_ref

from dsv41_convert.errors import FormatError
from dsv41_convert.quant import decode_fp8_blocks, e4m3_saturate, encode_fp8_blocks, infer_block

# --- independent reference -------------------------------------------------------------------------


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal dtype, shape, NaN positions and values (atol=0, rtol=0)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan], b[~nan]), (a[~nan] != b[~nan]).nonzero()[:5].tolist()


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


# --- e4m3 rounding -----------------------------------------------------------------------------------


def test_reference_table_matches_torch_decode():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    want = np.array([e4m3_value(b) for b in range(256)])
    np.testing.assert_array_equal(every, want)


def test_saturate_keeps_every_e4m3_value():
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = finite[(finite & 0x7F) != 0x7F]
    x = finite.view(torch.float8_e4m3fn).float()
    np.testing.assert_array_equal(bytes_of(e4m3_saturate(x)), finite.numpy())


def test_saturate_rounds_midpoints_half_to_even():
    mids = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2  # exact in float32: one more mantissa bit
    x = np.concatenate([mids, -mids]).astype(np.float32)
    got = bytes_of(e4m3_saturate(torch.from_numpy(x)))
    np.testing.assert_array_equal(got, e4m3_ref(x))
    assert np.all(got % 2 == 0)  # the even neighbour wins every tie
    np.testing.assert_array_equal(got, bytes_of(torch.from_numpy(x).to(torch.float8_e4m3fn)))


@pytest.mark.parametrize(
    ("x", "want"),
    [(448.0, 448.0), (464.0, 448.0), (1e30, 448.0), (math.inf, 448.0), (-math.inf, -448.0), (2.0**-10, 0.0)],
)
def test_saturate_clamps(x, want):
    assert e4m3_saturate(torch.tensor([x])).float().item() == want


def test_saturate_subnormals_and_signed_zero():
    x = torch.tensor([2.0**-9, 3 * 2.0**-10, 2.0**-10 * 1.0001, -0.0, -(2.0**-11)])
    got = e4m3_saturate(x)
    assert got.float().tolist() == [2.0**-9, 2.0**-8, 2.0**-9, 0.0, 0.0]
    assert bytes_of(got).tolist()[3:] == [0x80, 0x80]  # sign kept on zeros


def test_saturate_matches_reference_on_random_floats():
    gen = np.random.default_rng(1)
    x = (gen.standard_normal(50000) * np.exp2(gen.integers(-14, 10, 50000))).astype(np.float32)
    np.testing.assert_array_equal(bytes_of(e4m3_saturate(torch.from_numpy(x))), e4m3_ref(x))


# --- encode_fp8_blocks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "block"),
    [((64, 96), (32, 32)), ((70, 100), (32, 32)), ((130, 260), (128, 128)), ((9, 256), (1, 32)), ((7, 45), (1, 32))],
)
def test_encode_matches_block_reference(shape, block):
    gen = np.random.default_rng(sum(shape))
    w = (gen.standard_normal(shape) * np.exp2(gen.integers(-12, 12, (shape[0], 1)))).astype(np.float32)
    q, s = encode_fp8_blocks(torch.from_numpy(w), block)
    q_ref, s_ref = encode_ref(w, *block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert tuple(s.shape) == s_ref.shape
    np.testing.assert_array_equal(bytes_of(q), q_ref)
    np.testing.assert_array_equal(s.float().numpy(), s_ref)


def test_encode_float32_scales_match_reference():
    gen = np.random.default_rng(2)
    w = gen.standard_normal((40, 70)).astype(np.float32)
    q, s = encode_fp8_blocks(torch.from_numpy(w), (32, 32), scale_fmt=None)
    q_ref, s_ref = encode_ref(w, 32, 32, ue8m0=False)
    assert s.dtype == torch.float32
    np.testing.assert_array_equal(bytes_of(q), q_ref)
    np.testing.assert_array_equal(s.numpy(), s_ref.astype(np.float32))


def test_encode_bfloat16_input_equals_its_float32_value():
    w = torch.randn(64, 64).bfloat16()
    for a, b in zip(encode_fp8_blocks(w), encode_fp8_blocks(w.float()), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_encode_exact_block_max_448_keeps_values():
    w = torch.zeros(32, 32)
    w[0, 0], w[3, 4], w[31, 31] = 448.0, -0.5, 2.0**-9
    q, s = encode_fp8_blocks(w)
    assert s.float().item() == 1.0
    assert torch.equal(q.float(), w)


def test_encode_block_max_just_over_448_doubles_scale():
    w = torch.zeros(32, 32)
    w[0, 0] = 449.0
    q, s = encode_fp8_blocks(w)
    assert s.float().item() == 2.0 and q.float()[0, 0].item() == 224.0


def test_encode_zero_block_gets_floored_scale():
    q, s = encode_fp8_blocks(torch.zeros(32, 64))
    # floor 1e-4 * f32(1/448) = 2.2e-7, rounded up to 2**-22
    assert s.float().tolist() == [[2.0**-22, 2.0**-22]]
    assert not q.float().any()


def test_encode_subnormal_inputs_flush_like_the_reference():
    w = np.full((32, 32), 1e-40, dtype=np.float32)  # float32 subnormal input
    w[0, 0] = 3e-6  # amax above the floor: scale 2**-17, values far below e4m3's smallest subnormal
    q, s = encode_fp8_blocks(torch.from_numpy(w))
    q_ref, s_ref = encode_ref(w, 32, 32)
    np.testing.assert_array_equal(bytes_of(q), q_ref)
    np.testing.assert_array_equal(s.float().numpy(), s_ref)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_encode_non_finite_names_tensor_and_index(bad):
    w = torch.randn(40, 40)
    w[5, 33] = bad
    w[7, 1] = bad
    with pytest.raises(FormatError, match=r"layers\.3\.attn\.wq_a\.weight: found (nan|inf|-inf) at index \[5, 33\]"):
        encode_fp8_blocks(w, name="layers.3.attn.wq_a.weight")
    # the dtype as the file names it, as for a copied tensor (it said "torch.bfloat16 [40, 40]": an audit)
    with pytest.raises(FormatError, match=r"\(2 non-finite of 1600\) in BF16 \[40, 40\]; expected finite values"):
        encode_fp8_blocks(w.bfloat16(), name="layers.3.attn.wq_a.weight")


def test_encode_rejects_bad_arguments():
    with pytest.raises(ValueError, match="2-d"):
        encode_fp8_blocks(torch.zeros(4, 4, 4))
    with pytest.raises(ValueError, match="scale_fmt"):
        encode_fp8_blocks(torch.zeros(4, 4), scale_fmt="e4m3")
    with pytest.raises(ValueError, match="int8"):
        encode_fp8_blocks(torch.zeros(4, 4, dtype=torch.int8))


# --- decode_fp8_blocks ------------------------------------------------------------------------------


def decode_ref(q: torch.Tensor, s: torch.Tensor, bo: int, bi: int, dtype: torch.dtype) -> torch.Tensor:
    """Expand every scale to its block with repeat_interleave, multiply in float64 (exact), cast once."""
    full = s.double().repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: q.size(0), : q.size(1)]
    return (q.double() * full).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "block"), [((96, 64), (32, 32)), ((70, 100), (32, 32)), ((256, 384), (128, 128))])
def test_decode_matches_reference(shape, block, dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0  # no NaN bytes
    q = q.view(torch.float8_e4m3fn)
    s_shape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    s = torch.randint(100, 150, s_shape, generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    got = decode_fp8_blocks(q, s, dtype=dtype)
    assert got.dtype == dtype and got.shape == q.shape
    assert_same(got, decode_ref(q, s, *block, dtype))


def test_decode_with_float32_scales_and_explicit_block():
    q = torch.randn(8, 64).to(torch.float8_e4m3fn)
    s = torch.rand(8, 2) + 0.1
    got = decode_fp8_blocks(q, s, block=(1, 32), dtype=torch.float32)
    assert_same(got, decode_ref(q, s, 1, 32, torch.float32))


def test_decode_engram_rows_layout():
    q = torch.randn(5, 256).to(torch.float8_e4m3fn)
    s = torch.randint(120, 130, (5, 8), dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    assert_same(decode_fp8_blocks(q, s), decode_ref(q, s, 1, 32, torch.bfloat16))


@pytest.mark.parametrize(
    ("q_shape", "s_shape", "block"),
    [
        ((64, 96), (2, 3), (32, 32)),
        ((70, 100), (3, 4), (32, 32)),
        ((256, 512), (2, 4), (128, 128)),
        ((130, 300), (2, 3), (128, 128)),
        ((7, 256), (7, 8), (1, 32)),
    ],
)
def test_infer_block(q_shape, s_shape, block):
    assert infer_block(q_shape, s_shape) == block


def test_infer_block_overlap_decodes_the_same():
    # a 32x32 weight with one scale fits both 32x32 and 128x128: either reading gives the same values
    q = torch.randn(32, 32).to(torch.float8_e4m3fn)
    s = torch.tensor([[130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(decode_fp8_blocks(q, s), decode_fp8_blocks(q, s, block=(128, 128)))


def test_infer_block_rejects_unknown_grid():
    with pytest.raises(ValueError, match=r"scale \[3, 3\] fits no known block"):
        infer_block((64, 64), (3, 3))


def test_decode_rejects_mismatched_explicit_block():
    q = torch.zeros(64, 64).to(torch.float8_e4m3fn)
    s = torch.ones(2, 2).to(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="does not fit"):
        decode_fp8_blocks(q, s, block=(128, 128))


# --- round trip -------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [(32, 32), (128, 128), (1, 32)])
def test_round_trip_error_bound_and_idempotence(block):
    w = torch.randn(150, 200) * torch.logspace(-3, 3, 150).unsqueeze(1)
    q, s = encode_fp8_blocks(w, block)
    d = decode_fp8_blocks(q, s, dtype=torch.float32)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2**-4 relative; below 2**-6 * scale the step is 2**-9 * scale
    scale = decode_fp8_blocks(torch.ones_like(q, dtype=torch.float32).to(torch.float8_e4m3fn), s, block, torch.float32)
    bound = torch.maximum(w.abs() * 2.0**-4, scale * 2.0**-10)
    assert bool(((d - w).abs() <= bound).all())
    q2, s2 = encode_fp8_blocks(d, block)
    assert torch.equal(decode_fp8_blocks(q2, s2, dtype=torch.float32), d)


# --- planted faults that the tests above let through (mutation audit) --------------------------------


def test_encode_scale_of_amax_one_ulp_above_448_times_a_power_of_two_rounds_up():
    """amax one float32 ulp above 448 * 2**k puts amax * f32(1/448) a hair above 2**k, where float32 log2
    rounds to k exactly: a scale from ceil(log2(.)) would be 2**k and clip the block's largest value to 448.
    SPEC §4: 2**ceil(log2(amax / qmax)) from the exponent bits, so 2**(k + 1), as encode_ref's frexp."""
    ks = range(-22, 25)  # 448 * 2**-22 > 1e-4: above the amax floor
    w = torch.zeros(32 * len(ks), 32)
    for i, k in enumerate(ks):
        w[32 * i, 5] = float(np.nextafter(np.float32(448.0 * 2.0**k), np.float32(np.inf)))
        w[32 * i + 3, 7] = -(2.0**k)
    q, s = encode_fp8_blocks(w)
    q_ref, s_ref = encode_ref(w.numpy(), 32, 32)
    np.testing.assert_array_equal(s.float().numpy(), s_ref)
    np.testing.assert_array_equal(s.float().numpy()[:, 0], [2.0 ** (k + 1) for k in ks])
    np.testing.assert_array_equal(bytes_of(q), q_ref)


def test_decode_to_bfloat16_with_float32_scales_rounds_the_float32_product():
    """value = f32(q) * f32(scale), then one cast to bf16: the scale is never rounded to bf16 first.
    Expected: the product in float64 (exact for two float32 factors) rounded to float32, then to bf16."""
    gen = torch.Generator().manual_seed(21)
    q = torch.randint(0, 256, (40, 70), generator=gen, dtype=torch.int32).to(torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38  # no NaN bytes
    q = q.view(torch.float8_e4m3fn)
    s = 1 + torch.rand(2, 3, generator=gen)  # float32 scales with full mantissas
    values = torch.tensor([e4m3_value(int(b)) for b in q.view(torch.uint8).flatten()], dtype=torch.float64)
    full = s.double().repeat_interleave(32, 0).repeat_interleave(32, 1)[:40, :70]
    want = (values.view(40, 70) * full).float().bfloat16()
    got = decode_fp8_blocks(q, s, (32, 32), torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float64, torch.int8, torch.uint8, torch.int32]
)
def test_encoders_refuse_inputs_that_are_not_float32_bfloat16_or_float16(dtype):
    """An already-quantized (or integer) tensor handed to an encoder is a caller bug: re-quantizing e4m3
    bytes silently would hide an fp8 wo_a or expert read as a float weight. Each encoder raises ValueError."""
    from dsv41_convert.quant import act_quant, encode_mxfp4, fp4_act_quant

    w = torch.ones(32, 64).to(dtype)
    for encode in (encode_fp8_blocks, encode_mxfp4, act_quant, fp4_act_quant):
        with pytest.raises(ValueError, match=str(dtype).removeprefix("torch.")):
            encode(w)


def test_bfloat16_decode_is_exact_except_e4m3_under_scale_bytes_0_to_2():
    """README (export --format bf16): the decode to bf16 is exact except where an e4m3 value times its scale is
    not a multiple of bf16's least subnormal, 2**-133. Over every finite (e4m3 byte, e8m0 byte) pair that happens
    only under scale bytes 0-2 (2**-127..2**-125), to values on both sides of 2**-133 (all below 2**-130);
    e2m1 codes are exact under every scale byte."""
    from dsv41_convert.quant import decode_mxfp4

    q = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    q = q[(q & 0x7F) != 0x7F].view(torch.float8_e4m3fn).expand(254, -1).contiguous()
    s = torch.arange(254, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu).view(254, 1)
    exact = q.float().double() * s.float().double()  # [scale byte, e4m3 byte], exact in float64
    got = decode_fp8_blocks(q, s, (1, q.size(1)), torch.bfloat16).double()
    finite = exact.abs() < 2.0**128
    inexact = finite & (got != exact)
    assert inexact.any(dim=1).nonzero().flatten().tolist() == [0, 1, 2]
    assert float(exact[inexact].abs().max()) < 2.0**-130
    assert float(exact[inexact].abs().min()) < 2.0**-133 < float(exact[inexact].abs().max())
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).expand(254, -1).contiguous()
    v = decode_mxfp4(packed, s.expand(254, 16).contiguous(), 32, torch.bfloat16).double()
    v32 = decode_mxfp4(packed, s.expand(254, 16).contiguous(), 32, torch.float32).double()
    ok = v32.abs() < 2.0**128
    assert torch.equal(v[ok], v32[ok])
