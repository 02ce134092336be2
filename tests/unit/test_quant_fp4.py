"""fp4 e2m1 codes, nibble packing and MXFP4 weights, against a reference built from the bit layout."""

import math

import numpy as np
import pytest
import torch
from quant_reference import MAGS, e2m1_ref, e2m1_value, mxfp4_ref
from safetensors.torch import load_file, save_file

from dsv41_convert.errors import FormatError
from dsv41_convert.quant import (
    E2M1_VALUES,
    as_fp4,
    as_int8,
    decode_e2m1,
    decode_mxfp4,
    encode_e2m1,
    encode_mxfp4,
    pack_nibbles,
    unpack_nibbles,
)

# --- independent reference -------------------------------------------------------------------------


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal dtype, shape, NaN positions and values (atol=0, rtol=0)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan], b[~nan]), (a[~nan] != b[~nan]).nonzero()[:5].tolist()


# --- code table, rounding --------------------------------------------------------------------------


def test_code_table_matches_bit_layout():
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.shape == (16,)
    want = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float32)
    assert torch.equal(E2M1_VALUES, want)
    assert E2M1_VALUES[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert math.copysign(1.0, E2M1_VALUES[8].item()) == -1.0  # code 8 is -0


def test_code_table_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(E2M1_VALUES.numpy(), want)


def test_decode_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(decode_e2m1(codes), E2M1_VALUES)
    with pytest.raises(ValueError, match=r"0\.\.15"):
        decode_e2m1(torch.tensor([16], dtype=torch.uint8))


def test_encode_every_code_round_trips_including_negative_zero():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(encode_e2m1(E2M1_VALUES), codes)


@pytest.mark.parametrize(
    ("x", "code"),
    [
        (0.25, 0),  # ties: 0 | 0.5 -> even code 0
        (0.75, 2),  # 0.5 | 1.0 -> code 2
        (1.25, 2),  # 1.0 | 1.5 -> code 2
        (1.75, 4),  # 1.5 | 2.0 -> code 4
        (2.5, 4),  # 2 | 3 -> code 4
        (3.5, 6),  # 3 | 4 -> code 6
        (5.0, 6),  # 4 | 6 -> code 6
        (5.0000005, 7),  # just past the tie
        (6.0, 7),
        (7.0, 7),  # clamp
        (math.inf, 7),
        (-0.75, 10),
        (-5.0, 14),
        (-math.inf, 15),
        (-0.1, 8),  # rounds to zero, keeps its sign: -0
        (-0.0, 8),
        (1e-40, 0),
        (math.nan, 0),  # as the upstream comparisons: no bound lies below NaN
    ],
)
def test_encode_rounding_edges(x, code):
    assert encode_e2m1(torch.tensor([x], dtype=torch.float32)).item() == code


def test_encode_matches_reference_and_ml_dtypes_on_random_values():
    gen = np.random.default_rng(4)
    x = (gen.standard_normal(10000) * 3).astype(np.float32)
    mids = (MAGS[:-1] + MAGS[1:]) / 2
    x = np.concatenate([x, mids, -mids, MAGS, -MAGS, np.nextafter(mids, 0), np.nextafter(mids, 7)]).astype(np.float32)
    got = encode_e2m1(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, e2m1_ref(x))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    ml = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(E2M1_VALUES[torch.from_numpy(got).long()].numpy(), ml)


def test_encode_bfloat16_input():
    x = torch.tensor([0.75, 1.75, -3.5], dtype=torch.bfloat16)
    assert encode_e2m1(x).tolist() == [2, 4, 14]


# --- packing, views ---------------------------------------------------------------------------------


def test_pack_puts_even_element_in_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x8F]]
    assert unpack_nibbles(torch.tensor([[0x21, 0x8F]], dtype=torch.uint8)).tolist() == [[1, 2, 15, 8]]


def test_pack_unpack_round_trip_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(4, 64)
    assert torch.equal(pack_nibbles(unpack_nibbles(b)), b)
    assert torch.equal(unpack_nibbles(b.view(torch.int8)), unpack_nibbles(b))


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_views_share_storage():
    raw = torch.randint(-128, 128, (4, 16), dtype=torch.int8)
    f4 = as_fp4(raw)
    assert f4.dtype == torch.float4_e2m1fn_x2 and f4.shape == raw.shape
    assert f4.data_ptr() == raw.data_ptr()
    back = as_int8(f4)
    assert back.dtype == torch.int8 and back.data_ptr() == raw.data_ptr() and torch.equal(back, raw)
    assert as_fp4(raw.view(torch.uint8)).data_ptr() == raw.data_ptr()
    with pytest.raises(ValueError, match="as_fp4"):
        as_fp4(torch.zeros(2, 2))


def test_safetensors_writes_fp4_as_F4_with_logical_shape(tmp_path):
    raw = torch.tensor([[0x21, 0x8F]], dtype=torch.uint8)
    path = tmp_path / "x.safetensors"
    save_file({"w": as_fp4(raw)}, str(path))
    header = path.read_bytes()[8:].split(b"}}")[0]
    assert b'"dtype":"F4"' in header and b'"shape":[1,4]' in header
    assert torch.equal(as_int8(load_file(str(path))["w"]).view(torch.uint8), raw)


# --- MXFP4 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 64), (5, 70), (3, 2, 96), (1, 32)])
def test_encode_mxfp4_matches_reference(shape):
    gen = np.random.default_rng(sum(shape))
    w = (gen.standard_normal(shape) * np.exp2(gen.integers(-20, 20, (*shape[:-1], 1)))).astype(np.float32)
    packed, s = encode_mxfp4(torch.from_numpy(w))
    codes_ref, exps_ref = mxfp4_ref(w)
    assert packed.dtype == torch.float4_e2m1fn_x2 and s.dtype == torch.float8_e8m0fnu
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and s.shape == exps_ref.shape
    np.testing.assert_array_equal(unpack_nibbles(packed).numpy(), codes_ref)
    np.testing.assert_array_equal(s.view(torch.uint8).numpy(), exps_ref + 127)


def test_encode_mxfp4_exact_max_six_and_ties():
    w = torch.zeros(1, 32)
    w[0, :8] = torch.tensor([6.0, -6.0, 0.25, 0.75, 1.75, 2.5, 3.5, 5.0])
    packed, s = encode_mxfp4(w)
    assert s.float().item() == 1.0
    assert decode_mxfp4(packed, s, dtype=torch.float32)[0, :8].tolist() == [6.0, -6.0, 0.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_encode_mxfp4_tiny_and_zero_groups_use_the_floor():
    w = torch.zeros(2, 32)
    w[1, 0] = 1.5 * 2.0**-126  # a float32 normal just above the floor's scale: code 1.5
    w[1, 1] = 2.0**-140  # float32 subnormal: flushes to 0
    packed, s = encode_mxfp4(w)
    assert s.view(torch.uint8).tolist() == [[1], [1]]  # 2**-126
    assert unpack_nibbles(packed)[1, :2].tolist() == [3, 0]


def test_encode_mxfp4_bfloat16_same_as_float32():
    w = torch.randn(4, 64).bfloat16()
    a, b = encode_mxfp4(w), encode_mxfp4(w.float())
    assert torch.equal(as_int8(a[0]), as_int8(b[0])) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_encode_mxfp4_non_finite_names_tensor(bad):
    w = torch.randn(4, 64)
    w[2, 40] = bad
    with pytest.raises(
        FormatError, match=r"layers\.0\.ffn\.experts\.3\.w1\.weight: found (nan|inf) at index \[2, 40\]"
    ):
        encode_mxfp4(w, name="layers.0.ffn.experts.3.w1.weight")


@pytest.mark.parametrize(("shape", "scales", "fp8_scales"), [((0, 64), (0, 2), (0, 2)), ((5, 0), (5, 0), (1, 0))])
def test_an_empty_weight_quantizes_to_empty_bytes(shape, scales, fp8_scales):
    """No rows, or rows of no elements: pack_nibbles' int16 view of no bytes raised a bare RuntimeError and
    the fp4 -> fp8 cast a numpy ValueError (an audit); now empty codes and scales of the block grid's shape."""
    from dsv41_convert.convert import transform

    w = torch.ones(shape, dtype=torch.bfloat16)
    codes, s = encode_mxfp4(w, 32, "t")
    assert (tuple(codes.shape), tuple(s.shape)) == ((shape[0], shape[1] // 2), scales)
    w8, s8 = transform.apply("quant_fp4_fp8", [w], transform.quantizer_for("cpu"), "t", "t", (32, 32))
    assert (tuple(w8.shape), tuple(s8.shape), w8.dtype) == (shape, fp8_scales, torch.float8_e4m3fn)


def test_encode_mxfp4_rejects_odd_last_dim():
    with pytest.raises(ValueError, match="even"):
        encode_mxfp4(torch.zeros(2, 33))


def decode_mxfp4_ref(codes: np.ndarray, exps: np.ndarray, block: int = 32) -> np.ndarray:
    vals = MAGS[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return vals * np.exp2(np.repeat(exps, block, axis=-1)[..., : codes.shape[-1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 64), (3, 80)])
def test_decode_mxfp4_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    s_bytes = torch.randint(1, 254, (shape[0], -(-shape[1] // 32)), generator=gen, dtype=torch.int32).to(torch.uint8)
    got = decode_mxfp4(as_fp4(pack_nibbles(codes)), s_bytes.view(torch.float8_e8m0fnu), dtype=dtype)
    # float64 holds every product; float32 overflow at the top scales is part of the contract
    want = torch.from_numpy(decode_mxfp4_ref(codes.numpy(), s_bytes.numpy().astype(np.int64) - 127)).to(dtype)
    assert got.dtype == dtype
    assert_same(got, want)


def test_decode_mxfp4_accepts_raw_int8_and_checks_scale_shape():
    packed, s = encode_mxfp4(torch.randn(4, 64))
    assert torch.equal(decode_mxfp4(as_int8(packed), s), decode_mxfp4(packed, s))
    with pytest.raises(ValueError, match="does not fit"):
        decode_mxfp4(packed, s[:, :1])


def test_mxfp4_round_trip_bound_and_idempotence():
    w = torch.randn(16, 96) * torch.logspace(-4, 4, 16).unsqueeze(1)
    packed, s = encode_mxfp4(w)
    d = decode_mxfp4(packed, s, dtype=torch.float32)
    step = s.float().repeat_interleave(32, 1)  # grid step is at most 2 * scale: error at most one scale
    assert bool(((d - w).abs() <= step).all())
    packed2, s2 = encode_mxfp4(d)
    assert torch.equal(decode_mxfp4(packed2, s2, dtype=torch.float32), d)


# --- planted faults that the tests above let through (mutation audit) --------------------------------


def test_encode_mxfp4_float16_input_matches_reference():
    """float16 is an accepted input (FLOAT_INPUTS): its codes and scales are those of its float32 value, by
    the loop reference (a bf16-only fast path applied to float16 would misread its bits)."""
    gen = np.random.default_rng(9)
    w = (gen.standard_normal((6, 96)) * np.exp2(gen.integers(-6, 6, (6, 1)))).astype(np.float16)
    w[0, :8] = [6.0, -6.0, 0.25, 0.75, 1.75, 2.5, 3.5, 5.0]  # exact ties at scale 1
    packed, s = encode_mxfp4(torch.from_numpy(w))
    codes_ref, exps_ref = mxfp4_ref(w.astype(np.float32))
    np.testing.assert_array_equal(unpack_nibbles(packed).numpy(), codes_ref)
    np.testing.assert_array_equal(s.view(torch.uint8).numpy(), exps_ref + 127)


def test_encode_mxfp4_odd_last_dim_names_the_tensor():
    with pytest.raises(
        ValueError, match=r"layers\.0\.ffn\.experts\.3\.w1\.weight: encode_mxfp4 wants an even last dim"
    ):
        encode_mxfp4(torch.zeros(2, 33), name="layers.0.ffn.experts.3.w1.weight")
