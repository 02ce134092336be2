"""Hypothesis: rounding against scalar references, round trips, idempotence, and the cast never losing bits."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41_convert.errors import FormatError
from dsv41_convert.quant import (
    as_fp4,
    decode_e8m0,
    decode_fp8_blocks,
    decode_mxfp4,
    e4m3_saturate,
    encode_e2m1,
    encode_e8m0_ceil,
    encode_fp8_blocks,
    encode_mxfp4,
    fp4_to_fp8,
    pack_nibbles,
    unpack_nibbles,
)

FAST = settings(max_examples=40, deadline=None)

f32 = st.floats(width=32, allow_nan=False)
f32_lists = st.lists(f32, min_size=1, max_size=64)


def scalar_rne(v: float, grid: list[float]) -> int:
    """Index of the grid value nearest to |v| (saturating at the top), ties to the even index; one value at a time."""
    mag = min(abs(v), grid[-1])
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - mag), i % 2))
    return best


E4M3_GRID = [m * 2.0**-9 for m in range(8)] + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
E4M3_GRID = E4M3_GRID[:127]  # drop S.1111.111 (NaN)
E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@FAST
@given(f32_lists)
def test_e4m3_matches_scalar_reference(xs):
    got = e4m3_saturate(torch.tensor(xs, dtype=torch.float32)).view(torch.uint8).tolist()
    want = [scalar_rne(v, E4M3_GRID) | (0x80 if math.copysign(1, v) < 0 else 0) for v in xs]
    assert got == want


@FAST
@given(f32_lists)
def test_e2m1_matches_scalar_reference(xs):
    got = encode_e2m1(torch.tensor(xs, dtype=torch.float32)).tolist()
    want = [scalar_rne(v, E2M1_GRID) | (0x8 if math.copysign(1, v) < 0 else 0) for v in xs]
    assert got == want


@FAST
@given(st.floats(min_value=2.0**-126, max_value=2.0**127, width=32))
def test_e8m0_ceil_is_the_least_power_of_two_above(x):
    s = decode_e8m0(encode_e8m0_ceil(torch.tensor([x], dtype=torch.float32))).item()
    assert s >= x and s / 2 < x and math.frexp(s)[0] == 0.5


@FAST
@given(st.lists(st.integers(0, 15), min_size=1, max_size=40).map(lambda c: c + c[:1] if len(c) % 2 else c))
def test_nibbles_round_trip(codes):
    c = torch.tensor(codes, dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(c)), c)


def weights(seed: int, out: int, inp: int, exp_spread: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-exp_spread, exp_spread + 1, (out, 1), generator=gen).float())
    return torch.randn(out, inp, generator=gen) * rows


@FAST
@given(
    st.integers(0, 2**31),
    st.integers(1, 80),
    st.integers(1, 80),
    st.sampled_from([(32, 32), (128, 128), (1, 32), (3, 7)]),
    st.integers(0, 30),
)
def test_fp8_blocks_round_trip_and_idempotence(seed, out, inp, block, spread):
    w = weights(seed, out, inp, spread)
    q, s = encode_fp8_blocks(w, block)
    assert s.shape == (-(-out // block[0]), -(-inp // block[1]))
    d = decode_fp8_blocks(q, s, block, torch.float32)
    unit = decode_fp8_blocks(torch.ones(out, inp).to(torch.float8_e4m3fn), s, block, torch.float32)
    assert bool(((d - w).abs() <= torch.maximum(w.abs() * 2.0**-4, unit * 2.0**-10)).all())
    q2, s2 = encode_fp8_blocks(d, block)
    assert torch.equal(decode_fp8_blocks(q2, s2, block, torch.float32), d)


@FAST
@given(st.integers(0, 2**31), st.integers(1, 20), st.integers(1, 50).map(lambda n: 2 * n), st.integers(0, 40))
def test_mxfp4_round_trip_and_idempotence(seed, out, inp, spread):
    w = weights(seed, out, inp, spread)
    packed, s = encode_mxfp4(w)
    assert packed.shape == (out, inp // 2) and s.shape == (out, -(-inp // 32))
    d = decode_mxfp4(packed, s, dtype=torch.float32)
    step = s.float().repeat_interleave(32, 1)[:, :inp]
    assert bool(((d - w).abs() <= step).all())
    packed2, s2 = encode_mxfp4(d)
    assert torch.equal(decode_mxfp4(packed2, s2, dtype=torch.float32), d)


def cast_is_exact_ref(codes: np.ndarray, exps: np.ndarray) -> bool:
    """Every nonzero value times 2**(its exponent - its 32x32 block's largest + 6) lies on the e4m3 grid."""
    grid = set(E4M3_GRID)
    e_cols = np.repeat(exps, 32, axis=1)[:, : codes.shape[1]]
    for r in range(0, codes.shape[0], 32):
        for c in range(0, codes.shape[1], 32):
            blk_e = e_cols[r : r + 32, c : c + 32]
            vals = np.array(E2M1_GRID * 2)[codes[r : r + 32, c : c + 32]] * np.exp2(blk_e - blk_e.max() + 6)
            if not all(v == 0 or v in grid for v in vals.ravel().tolist()):
                return False
    return True


@FAST
@given(st.integers(0, 2**31), st.integers(1, 70), st.integers(1, 48).map(lambda n: 2 * n), st.integers(0, 20))
def test_fp4_to_fp8_is_exact_or_refuses(seed, out, inp, spread):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.int32).to(torch.uint8)
    e = torch.randint(-spread, 1, (out, -(-inp // 32)), generator=gen, dtype=torch.int32)
    packed, s = as_fp4(pack_nibbles(codes)), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    if not cast_is_exact_ref(codes.numpy(), e.numpy()):
        with pytest.raises(FormatError, match="is lossy"):
            fp4_to_fp8(packed, s, name="w")
        return
    w8, s8 = fp4_to_fp8(packed, s, name="w")
    assert torch.equal(decode_fp8_blocks(w8, s8, dtype=torch.float32), decode_mxfp4(packed, s, dtype=torch.float32))


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6).map(lambda n: 32 * n))
def test_fp4_to_fp8_never_refuses_small_spread(seed, inp):
    """Scales spanning at most 2**14 in a block keep every offset >= 2**-8: 0.5 * 2**-8 is e4m3's least value."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (32, inp), generator=gen, dtype=torch.int32).to(torch.uint8)
    e = torch.randint(-14, 1, (32, inp // 32), generator=gen, dtype=torch.int32)
    packed, s = as_fp4(pack_nibbles(codes)), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    w8, s8 = fp4_to_fp8(packed, s)
    np.testing.assert_array_equal(
        decode_fp8_blocks(w8, s8, dtype=torch.float32).numpy(), decode_mxfp4(packed, s, dtype=torch.float32).numpy()
    )
