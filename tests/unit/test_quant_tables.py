"""The CPU table paths of quant/ give the same bytes as the float paths they replace.

decode_fp8_blocks gathers e4m3 values from a table instead of q.float(); decode_mxfp4 to bf16 gathers
both values of a packed byte for its scale; encode_mxfp4 of a bf16 weight codes through a table of every
bf16 bit pattern; pack_nibbles works on byte pairs; the encoders scan for NaN / Inf only when a block
amax is not finite; fp4_to_fp8 skips the per-byte exactness gather when every offset is exact. Each test
compares with the float path (kept for other dtypes and devices) on every table entry or on random data
with the edge cases: zeros, subnormals, +-max, ties, shapes not divisible by the block, NaN / Inf.
"""

import math

import pytest
import torch

from dsv41_convert.errors import FormatError
from dsv41_convert.quant import (
    cast,
    cast_bytes,
    decode_fp8_blocks,
    decode_mxfp4,
    encode_e2m1,
    encode_fp8_blocks,
    encode_mxfp4,
    fp4_bytes,
    fp8_bytes,
)
from dsv41_convert.quant import fp4 as fp4_mod
from dsv41_convert.quant.fp8 import e4m3_to_float, pad_blocks, unpad_blocks

ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
ALL_BF16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
FINITE_BF16 = ALL_BF16[torch.isfinite(ALL_BF16)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal dtype, shape and bytes (NaN payloads and -0 included)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    ua, ub = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    assert torch.equal(ua, ub), (ua != ub).nonzero()[:5].tolist()


def edge_bf16(out: int, inp: int, seed: int) -> torch.Tensor:
    """A bf16 weight with groups spread over many magnitudes, plus zeros, subnormals, +-max and ties."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) * torch.exp2(torch.randint(-40, 40, (out, 1), generator=gen).float())
    w = w.bfloat16()
    flat = w.view(-1)
    big = torch.finfo(torch.bfloat16).max
    edges = [
        [0.0] * 40,
        [1e-39, -1e-39, 9.2e-41, -9.2e-41, 0.0, -0.0, 1e-38, 2e-40],  # subnormals, -0
        [big, -big, 1.0, -0.75],
        [6.0, -6.0, 0.25, 0.75, 1.75, 2.5, 3.5, 5.0],  # e2m1 ties, at scale 1
    ]
    at = 0
    for values in edges:
        k = min(len(values), flat.numel() - at)
        flat[at : at + k] = torch.tensor(values[:k])
        at = min(flat.numel(), at + k + flat.numel() // 5)
    return w


SHAPES = [(64, 128), (33, 70), (1, 32), (5, 2), (96, 40)]


# --- fp8 ------------------------------------------------------------------------------------------


def test_e4m3_table_is_the_cast_for_every_byte_and_layout():
    q = ALL_BYTES.view(torch.float8_e4m3fn)
    same_bits(e4m3_to_float(q), q.float())  # both NaN bytes, +-0, subnormals, +-448
    wide = torch.randint(0, 256, (48, 80), dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    same_bits(e4m3_to_float(wide), wide.float())
    same_bits(e4m3_to_float(wide[:, 3:70:2]), wide[:, 3:70:2].float())  # a strided view


@pytest.mark.parametrize("block", [(32, 32), (1, 32), (128, 128)])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_fp8_blocks_equals_the_float_path(shape, block):
    out, inp = shape
    gen = torch.Generator().manual_seed(out * inp)
    q = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    grid = (-(-out // block[0]), -(-inp // block[1]))
    s = torch.randint(0, 256, grid, generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    for dtype in (torch.bfloat16, torch.float32):
        want = unpad_blocks(pad_blocks(q.float(), *block) * s.float()[:, None, :, None], out, inp).to(dtype)
        same_bits(decode_fp8_blocks(q, s, block, dtype), want)


@pytest.mark.parametrize("block", [(32, 32), (1, 32)])
@pytest.mark.parametrize("shape", SHAPES)
def test_encode_fp8_blocks_bf16_equals_float32(shape, block):
    w = edge_bf16(*shape, seed=shape[0])
    for a, b in zip(encode_fp8_blocks(w, block), encode_fp8_blocks(w.float(), block), strict=True):
        same_bits(a, b)


# --- fp4 ------------------------------------------------------------------------------------------


def test_e2m1_table_of_every_bf16_scaled_by_every_scale():
    """Every finite bf16 value over every power-of-two scale the encoder can pick (2**-126 .. 2**127)."""
    w = FINITE_BF16.view(1, -1)
    exps = torch.arange(-126, 128, dtype=torch.float32)
    for chunk in exps.split(32):
        s = torch.exp2(chunk).view(-1, 1)
        got = fp4_mod._encode_e2m1_scaled_bf16(w.expand(len(chunk), -1), s)
        want = encode_e2m1(w.float() / s)
        assert torch.equal(got, want), (chunk[0].item(), (got != want).nonzero()[:5].tolist())


@pytest.mark.parametrize("block", [32, 16, 2])
@pytest.mark.parametrize("shape", [*SHAPES, (2, 3, 96)])
def test_encode_mxfp4_bf16_equals_float32(shape, block):
    w = edge_bf16(math.prod(shape[:-1]), shape[-1], seed=shape[-1]).view(shape)
    for a, b in zip(encode_mxfp4(w, block), encode_mxfp4(w.float(), block), strict=True):
        same_bits(a, b)


def test_mxfp4_bf16_table_is_the_float_path_for_every_scale_and_byte():
    packed = ALL_BYTES.expand(256, 256).contiguous().view(256, 256)  # row = scale byte, 255 is NaN
    s = ALL_BYTES.view(torch.float8_e8m0fnu).view(256, 1).expand(256, 16).contiguous()
    got = decode_mxfp4(packed, s, 32, torch.bfloat16)
    same_bits(got, fp4_mod._decode_mxfp4_float(packed, s, 32, torch.bfloat16))


@pytest.mark.parametrize("block", [32, 16, 2, 3])
@pytest.mark.parametrize("shape", [(64, 128), (33, 70), (1, 32), (2, 3, 96), (4, 36)])
def test_decode_mxfp4_equals_the_float_path(shape, block):
    gen = torch.Generator().manual_seed(block + shape[-1])
    packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    grid = (*shape[:-1], -(-shape[-1] // block))
    s = torch.randint(0, 256, grid, generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu)
    for dtype in (torch.bfloat16, torch.float32):
        for p in (packed, packed.view(torch.int8), packed.view(torch.float4_e2m1fn_x2)):
            same_bits(decode_mxfp4(p, s, block, dtype), fp4_mod._decode_mxfp4_float(packed, s, block, dtype))


def test_pack_nibbles_pairs_equal_the_strided_formula():
    codes = torch.stack(torch.meshgrid(ALL_BYTES, ALL_BYTES, indexing="ij"), -1).reshape(-1, 2)  # every pair
    want = (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)  # the formula; bytes > 15 masked
    same_bits(fp4_mod.pack_nibbles(codes), want)
    wide = codes.reshape(64, -1)
    same_bits(fp4_mod.pack_nibbles(wide[:, 2:50]), (wide[:, 2:50:2] & 0x0F) | ((wide[:, 3:50:2] & 0x0F) << 4))


# --- NaN / Inf: found from the block amax, reported as before ---------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_anywhere_raises_naming_the_first(bad, dtype):
    for pos in [(0, 0), (2, 39), (40, 69), (40, 0)]:
        w = torch.randn(41, 70).to(dtype)
        w[pos] = bad
        w[40, 69] = bad  # a second one: the message names the first
        where = rf"w: found {'nan' if math.isnan(bad) else '-?inf'} at index \[{pos[0]}, {pos[1]}\] \(\d non-finite"
        with pytest.raises(FormatError, match=where):
            encode_mxfp4(w, 32, "w")
        for block in [(32, 32), (1, 32)]:
            with pytest.raises(FormatError, match=where):
                encode_fp8_blocks(w, block, name="w")


# --- fp4 -> fp8: the per-byte check is skipped only where every byte of every offset is exact --------


def test_cast_skips_the_byte_check_only_for_offsets_that_are_always_exact():
    k = torch.arange(cast_bytes.K_MIN, cast_bytes.MAX_OFFSET_BITS + 1)
    assert torch.equal(torch.from_numpy(cast_bytes.K_EXACT), k >= -8)  # 0.5 * 2**-8 = 2**-9, e4m3's least subnormal
    packed = torch.zeros(2, 16, dtype=torch.uint8)  # logical [2, 32]: one 32x32 block, a scale per row
    packed[1, 0] = 0x01  # 0.5 in row 1, whose scale 2**-15 sits 2**-9 below the block scale 2**-6
    s = torch.tensor([[127], [127 - 15]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(FormatError, match=r"lossy at \[1, 0\]"):
        cast.fp4_to_fp8(packed, s, 32, "w")
    packed[1, 0] = 0x02  # 1.0 there is 2**-9: exact
    w8, _ = cast.fp4_to_fp8(packed, s, 32, "w")
    assert w8.float()[1, 0].item() * 2.0**-6 == 2.0**-15


# --- fp4 -> fp8: offsets from scale bytes, and four codes per gather where every offset is exact -------


def test_quad_table_is_the_float_cast_of_every_byte_pair_and_offset():
    """Every entry of the two-byte table (k = K_ALL_EXACT..6, all 65536 byte pairs) against the float path:
    e2m1 value x 2**k cast to e4m3, -0 written as +0."""
    quads = torch.from_numpy(cast_bytes.quad_table()).view(torch.uint8).view(-1, 1 << 16, 4)
    pair_bytes = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(-1, 2).long()
    codes = torch.stack([pair_bytes[:, 0] & 15, pair_bytes[:, 0] >> 4, pair_bytes[:, 1] & 15, pair_bytes[:, 1] >> 4], 1)
    values = fp4_mod.E2M1_VALUES[codes]
    values = torch.where(values == 0, 0.0, values)
    k = torch.arange(cast_bytes.K_ALL_EXACT, cast_bytes.MAX_OFFSET_BITS + 1, dtype=torch.float32)
    want = (values * torch.exp2(k)[:, None, None]).to(torch.float8_e4m3fn)
    assert quads.shape == want.shape
    same_bits(quads, want.view(torch.uint8))
    assert torch.equal(want.float(), values * torch.exp2(k)[:, None, None])  # exact, as K_ALL_EXACT promises


def _float_block_scales(s: torch.Tensor, block: int) -> torch.Tensor:
    """fp4_to_fp8's block scales by the float formula: max of the block's fp4 scales / 2**6, >= 2**-127."""
    s8 = pad_blocks(s.float(), 32, 32 // block).amax(dim=(1, 3)) / 2.0**6
    return s8.clamp_min(2.0**-127).to(torch.float8_e8m0fnu)


@pytest.mark.parametrize("block", [4, 8, 16, 32])
@pytest.mark.parametrize(("out", "inp"), [(64, 128), (100, 96), (33, 64)])
@pytest.mark.parametrize(("lo", "spread"), [(120, 14), (0, 5), (0, 14), (238, 14)])  # 252: no block overflows
def test_cast_by_quads_equals_the_pair_path_and_the_values(out, inp, lo, spread, block, monkeypatch):
    """fp4 scale bytes spread by up to 14 (so k reaches -8 after the block max), at the bottom of e8m0 (byte 0
    = 2**-127, block scales clamped there) and near its top, rows not a multiple of 32: the quad path gives
    the pair path's bytes, the block scales follow the float formula, and every value is the fp4 value."""
    gen = torch.Generator().manual_seed(out * inp + block + lo + spread)
    packed = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8, generator=gen)
    packed[0, :4] = torch.tensor([0x00, 0x88, 0x80, 0x08], dtype=torch.uint8)  # +0 and -0 codes
    s = (lo + torch.randint(0, spread + 1, (out, inp // block), generator=gen)).to(torch.uint8)
    s = s.view(torch.float8_e8m0fnu)
    quad_w, quad_s = cast.fp4_to_fp8(packed, s, block, "w")
    monkeypatch.setattr(cast_bytes, "K_ALL_EXACT", 1 << 10)  # never true: the pair path
    pair_w, pair_s = cast.fp4_to_fp8(packed, s, block, "w")
    same_bits(quad_w, pair_w)
    same_bits(quad_s, pair_s)
    same_bits(quad_s, _float_block_scales(s, block))
    scale_OI = unpad_blocks(quad_s.float()[:, None, :, None].expand(-1, 32, -1, 32), out, inp)
    fp4_values = fp4_mod.decode_e2m1_pairs(packed) * s.float().repeat_interleave(block, 1)
    assert torch.equal(quad_w.float() * scale_OI, fp4_values)


def test_cast_takes_the_quad_path_only_where_every_offset_is_exact(monkeypatch):
    calls = []
    real = cast_bytes._cast_quads
    monkeypatch.setattr(cast_bytes, "_cast_quads", lambda *a: calls.append(1) or real(*a))
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    for spread, want in ((8 + 6, 1), (9 + 6, 0)):  # k = -8 (exact for every byte) and k = -9 (checked)
        s = torch.tensor([[127], [127 - spread]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
        calls.clear()
        cast.fp4_to_fp8(packed, s, 32, "w")
        assert len(calls) == want, spread
    calls.clear()
    one_scale = torch.full((2, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    cast.fp4_to_fp8(torch.zeros(2, 15, dtype=torch.uint8), one_scale, 32, "w")  # in = 30: not whole blocks
    assert not calls


def test_cast_by_quads_is_the_float_cast_of_every_byte_pair_at_every_offset(monkeypatch):
    """Every packed byte pair at every offset k = K_ALL_EXACT..6, in one weight, through fp4_to_fp8 (so the
    index the quad path builds from scale bytes and packed bytes is checked, not only the table): the bytes
    equal e2m1 value x 2**k cast to e4m3 (-0 written as +0) and the pair path's. k changes from group to
    group along a row and from row to row; row 0 of each 32-row block is all zero codes at the largest
    scale (k = 6), so every block scale is the same."""
    ks = torch.arange(cast_bytes.K_ALL_EXACT, cast_bytes.MAX_OFFSET_BITS + 1)
    inp = 2048  # 512 byte pairs per row: 128 rows hold all 65536 once; len(ks) copies of them
    all_pairs = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(128, inp // 2)
    out = 32 * -(-len(ks) * 128 // 31)  # 31 data rows per 32-row block
    data_rows = [r for r in range(out) if r % 32][: len(ks) * 128]
    top = 137  # largest scale byte: block scale byte 131, and scale byte 131 + k elsewhere
    k_OG = torch.full((out, inp // 32), cast_bytes.MAX_OFFSET_BITS)
    # copy c of the pairs, group g, row q: k = ks[(128 c + q + g) % 15]; 128 c % 15 takes every value
    k_OG[data_rows] = ks[(torch.arange(len(data_rows))[:, None] + torch.arange(inp // 32)) % len(ks)]
    packed = torch.zeros(out, inp // 2, dtype=torch.uint8)
    packed[data_rows] = all_pairs.repeat(len(ks), 1)
    s = (top - cast_bytes.MAX_OFFSET_BITS + k_OG).to(torch.uint8).view(torch.float8_e8m0fnu)
    calls = []
    real = cast_bytes._cast_quads
    monkeypatch.setattr(cast_bytes, "_cast_quads", lambda *a: calls.append(1) or real(*a))
    w8, s8 = cast.fp4_to_fp8(packed, s, 32, "w")
    assert calls and s8.view(torch.uint8).unique().tolist() == [top - cast_bytes.MAX_OFFSET_BITS]
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(out, inp).long()
    values = fp4_mod.E2M1_VALUES[codes]
    values = torch.where(values == 0, 0.0, values) * torch.exp2(k_OG.float()).repeat_interleave(32, 1)
    same_bits(w8, values.to(torch.float8_e4m3fn))
    monkeypatch.setattr(cast_bytes, "K_ALL_EXACT", 1 << 10)  # never true: the pair path
    same_bits(w8, cast.fp4_to_fp8(packed, s, 32, "w")[0])


@pytest.mark.parametrize(
    ("out", "inp", "block", "at"), [(64, 64, 32, (63, 1)), (33, 80, 16, (32, 4)), (5, 40, 8, (0, 0))]
)
def test_cast_finds_a_nan_scale_anywhere(out, inp, block, at):
    """The NaN check (quant/byte_checks.py: one max over the scale bytes, byte 255 wins it): a NaN in a ragged
    last block or at the first scale is still found, and named by its first position."""
    s = torch.full((out, -(-inp // block)), 127, dtype=torch.uint8)
    s[at] = 255
    s[-1, -1] = 255  # a later one is not the one named
    with pytest.raises(FormatError, match=rf"w: scale is NaN \(e8m0 byte 255\) at \[{at[0]}, {at[1]}\]"):
        cast.fp4_to_fp8(torch.zeros(out, inp // 2, dtype=torch.uint8), s.view(torch.float8_e8m0fnu), block, "w")


def test_e4m3_exact_bits_is_torchs_cast_where_exact():
    """cast_bytes.e4m3_exact_bits (numpy, integer arithmetic) against torch's float -> float8_e4m3fn cast: every
    e4m3 value, each times 2**k for k = -12..12 (normals, subnormals, underflow, past 448), halfway and odd
    values, both zeros: exact where the cast round-trips, and then the same byte (-0 written as +0)."""
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    finite = all_bytes[torch.isfinite(all_bytes)]
    y = torch.cat(
        [
            (finite[:, None] * torch.exp2(torch.arange(-12, 13, dtype=torch.float64))).reshape(-1),
            torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 1.0625, 17.0, -(2.0**-6)]),
        ]
    )
    y = y[y.abs() <= 448]
    bits, exact = cast_bytes.e4m3_exact_bits(y.numpy())
    torch_bits = y.to(torch.float8_e4m3fn)
    want_exact = torch_bits.double() == y
    assert torch.equal(torch.from_numpy(exact), want_exact)
    assert want_exact.any() and (~want_exact).any()
    want = torch.where(y == 0, 0, torch_bits.view(torch.uint8).int()).to(torch.uint8)
    same_bits(torch.from_numpy(bits)[want_exact], want[want_exact])
    assert not torch.from_numpy(bits)[~want_exact].any()  # no byte where e4m3 would round


@pytest.fixture
def unchecked(monkeypatch):
    """The byte tables alone, NaN bytes and blocks that overflow decoded: the decoders' refusals off
    (quant/byte_checks.py; their tests are in test_decode_refuses_nan.py and test_decode_refuses_infinity.py)."""
    for mod in (fp8_bytes, fp4_bytes):
        monkeypatch.setattr(mod, "require_scales_not_nan", lambda *args: None)
        monkeypatch.setattr(mod, "require_finite_blocks", lambda *args: None)
    monkeypatch.setattr(fp8_bytes, "require_e4m3_not_nan", lambda q, name: None)


def _nan_bf16(bits: torch.Tensor) -> torch.Tensor:
    return (bits.int() & 0x7FFF) > 0x7F80


def test_fp8_bytes_table_is_decode_fp8_blocks_for_every_scale_and_weight_byte(unchecked):
    """quant/fp8_bytes.py's lookup (every e8m0 byte x every e4m3 byte: overflow to inf, bf16 subnormals,
    NaN in either) against decode_fp8_blocks (torch): the same bfloat16 bits; NaN as NaN (torch writes
    0xFFFF in its vectorized loop and 0x7FC0 in its scalar tail; the table 0x7FC0)."""
    q = ALL_BYTES.repeat(256).view(256 * 256 // 32, 32)  # row r: weight bytes, scale byte r // 8
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(8).view(-1, 1)
    want = decode_fp8_blocks(q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), (1, 32), torch.bfloat16)
    got = torch.from_numpy(fp8_bytes.decode_fp8_blocks_bf16(q.numpy(), s.numpy(), (1, 32)))
    want_bits = want.view(torch.uint16)
    nan = _nan_bf16(want_bits)
    assert torch.equal(_nan_bf16(got), nan) and nan.any()
    same_bits(got[~nan], want_bits[~nan])
    assert bool((got[nan] == 0x7FC0).all())
    assert bool(torch.isinf(want).any()) and bool(((want_bits.int() & 0x7F80) == 0).logical_and(want != 0).any())


FP8_DECODE_SHAPES = [(64, 64, (32, 32)), (100, 70, (32, 32)), (33, 65, (32, 32)), (256, 384, (128, 128)),
                     (130, 100, (128, 128)), (5, 96, (1, 32)),
                     (300, 1000, (128, 128))]  # fmt: skip  # the last: quant/gather.py's runs of rows inside a block


@pytest.mark.parametrize(("out", "inp", "block"), FP8_DECODE_SHAPES)
def test_fp8_bytes_decode_equals_decode_fp8_blocks_on_random_bytes(out, inp, block, unchecked):
    """Random weight and scale bytes (NaN ones included), shapes not divisible by the block: the same bits as
    decode_fp8_blocks wherever it is not NaN, NaN where it is; a scale that does not fit is refused."""
    gen = torch.Generator().manual_seed(out * inp + block[0])
    q = torch.randint(0, 256, (out, inp), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (-(-out // block[0]), -(-inp // block[1])), dtype=torch.uint8, generator=gen)
    want = decode_fp8_blocks(q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), block, torch.bfloat16)
    got = torch.from_numpy(fp8_bytes.decode_fp8_blocks_bf16(q.numpy(), s.numpy(), block))
    nan = _nan_bf16(want.view(torch.uint16))
    assert torch.equal(_nan_bf16(got), nan)
    same_bits(got[~nan], want.view(torch.uint16)[~nan])
    with pytest.raises(ValueError, match="does not fit weight"):
        fp8_bytes.decode_fp8_blocks_bf16(q.numpy(), s[:-1].numpy(), block, "w")


def test_fp4_bytes_table_is_decode_mxfp4_for_every_scale_and_packed_byte(unchecked):
    """quant/fp4_bytes.py's lookup (every e8m0 byte x every packed byte: 6 * 2**127 overflows to inf, -0,
    a NaN scale) against decode_mxfp4's float path (torch): the same bfloat16 bits, NaN as NaN."""
    packed = ALL_BYTES.repeat(256).view(256 * 16, 16)  # row r: 16 packed bytes (32 codes), scale byte r // 16
    s = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat_interleave(16).view(-1, 1)
    want = fp4_mod._decode_mxfp4_float(packed, s.view(torch.float8_e8m0fnu), 32, torch.bfloat16).view(torch.uint16)
    got = torch.from_numpy(fp4_bytes.decode_mxfp4_bf16(packed.numpy(), s.numpy(), 32))
    nan = _nan_bf16(want)
    assert torch.equal(_nan_bf16(got), nan) and nan.any()
    same_bits(got[~nan], want[~nan])
    assert bool((want == 0x7F80).any()) and bool((want == 0x8000).any())  # inf and -0 are in the comparison


@pytest.mark.parametrize(
    ("out", "inp", "block"),
    [(64, 64, 32), (100, 96, 16), (33, 60, 4), (7, 30, 32), (5, 34, 2), (300, 1000, 32)],  # 300: gather.py's runs
)
def test_fp4_bytes_decode_equals_decode_mxfp4_on_random_bytes(out, inp, block, unchecked):
    gen = torch.Generator().manual_seed(out * inp + block)
    packed = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8, generator=gen)
    s = torch.randint(0, 256, (out, -(-inp // block)), dtype=torch.uint8, generator=gen)
    want = decode_mxfp4(packed, s.view(torch.float8_e8m0fnu), block, torch.bfloat16).view(torch.uint16)
    got = torch.from_numpy(fp4_bytes.decode_mxfp4_bf16(packed.numpy(), s.numpy(), block))
    nan = _nan_bf16(want)
    assert torch.equal(_nan_bf16(got), nan)
    same_bits(got[~nan], want[~nan])
    with pytest.raises(ValueError, match="does not fit weight"):
        fp4_bytes.decode_mxfp4_bf16(packed.numpy(), s[:, :-1].numpy(), block, "w")


# --- planted faults that the tests above let through (mutation audit) --------------------------------


@pytest.mark.parametrize(("out", "inp", "block"), [(5, 70, (1, 32)), (7, 45, (1, 32)), (40, 50, (32, 16))])
def test_fp8_bytes_decode_of_non_square_blocks_with_a_ragged_edge(out, inp, block):
    """Blocks of unequal sides over a weight that is not a multiple of them (the row-per-block grid's repeat
    must expand rows by bo and columns by bi). Expected: each e4m3 value from its bit fields times 2**(b - 127)
    of its own block, in float64 (exact for these scales), rounded once to bf16."""
    from quant_reference import e4m3_value

    gen = torch.Generator().manual_seed(out + inp)
    q = torch.randint(0, 256, (out, inp), dtype=torch.int32, generator=gen).to(torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38
    grid = (-(-out // block[0]), -(-inp // block[1]))
    s = torch.randint(110, 145, grid, dtype=torch.int32, generator=gen).to(torch.uint8)
    values = torch.tensor([e4m3_value(int(b)) for b in q.flatten()], dtype=torch.float64).view(out, inp)
    exps = (s.long() - 127).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out, :inp]
    want = (values * torch.exp2(exps.double())).bfloat16().view(torch.uint16)
    got = torch.from_numpy(fp8_bytes.decode_fp8_blocks_bf16(q.numpy(), s.numpy(), block, "w"))
    same_bits(got, want)


@pytest.mark.parametrize("block", [3, 5, 1])
def test_fp4_bytes_refuses_an_odd_block(block):
    """A packed byte holds two values, so an odd block would split bytes between scales; the numpy decoder
    refuses it (ValueError naming the tensor) rather than give a byte one of its two scales."""
    packed = torch.zeros(4, 15, dtype=torch.uint8)  # logical [4, 30]
    s = torch.full((4, -(-30 // block)), 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"w: scale .* \(block {block}\)"):
        fp4_bytes.decode_mxfp4_bf16(packed.numpy(), s.numpy(), block, "w")
