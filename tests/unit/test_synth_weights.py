"""Random values of the synthetic checkpoint: seeding, statistics, canonical quantized form."""

from __future__ import annotations

import pytest
import torch

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.catalogue import Fmt, Init, Param, catalogue
from dsv41_convert.quant import decode_fp8_blocks, decode_mxfp4, encode_fp8_blocks, encode_mxfp4
from dsv41_convert.quant.fp4 import as_fp4
from dsv41_convert.synth.presets import MEDIUM, hf_config
from dsv41_convert.synth.quantized import e2m1_pair_table, e4m3_table
from dsv41_convert.synth.weights import decode_file_tensors, draw, param_seed, param_tensors

_BLOCKS = {Fmt.FP8: (32, 32), Fmt.FP8_ROWS: (1, 32)}


def _p(name="layers.0.attn.wq_a", shape=(96, 160), fmt=Fmt.FP8, std=160**-0.5, jitter=True) -> Param:
    return Param(name, shape, fmt, "layer.0", Init(std, jitter=jitter))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _assert_canonical(p: Param, seed: int = 0) -> dict[str, torch.Tensor]:
    """Quantizing the bf16 layout's values gives the fp8 layout's bytes; the bf16 values are their decode."""
    q8, b16 = param_tensors(p, seed, True), param_tensors(p, seed, False)
    q, s = q8[f"{p.name}.weight"], q8[f"{p.name}.scale"]
    w = b16[f"{p.name}.weight"]
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == p.shape
    if p.fmt is Fmt.FP4:
        assert (q.dtype, tuple(q.shape)) == (torch.int8, (p.shape[0], p.shape[1] // 2))
        q2, s2 = encode_mxfp4(w, name=p.name)
        dec = decode_mxfp4(as_fp4(q), s)
    else:
        assert q.dtype == torch.float8_e4m3fn and not torch.isnan(q.float()).any()
        q2, s2 = encode_fp8_blocks(w, block=_BLOCKS[p.fmt], name=p.name)
        dec = decode_fp8_blocks(q, s, _BLOCKS[p.fmt])
    assert s.dtype == torch.float8_e8m0fnu
    assert torch.equal(_bytes(q2), _bytes(q)), p.name
    assert torch.equal(_bytes(s2), _bytes(s)), p.name
    assert torch.equal(w.view(torch.int16), dec.view(torch.int16)), p.name
    assert torch.equal(decode_file_tensors(p, q8).view(torch.int16), w.view(torch.int16))
    return q8


def test_seeded_per_name():
    a = param_tensors(_p(), 0, True)["layers.0.attn.wq_a.weight"]
    assert torch.equal(_bytes(a), _bytes(param_tensors(_p(), 0, True)["layers.0.attn.wq_a.weight"]))
    assert not torch.equal(_bytes(a), _bytes(param_tensors(_p(), 1, True)["layers.0.attn.wq_a.weight"]))
    other = param_tensors(_p(name="layers.1.attn.wq_a"), 0, True)["layers.1.attn.wq_a.weight"]
    assert not torch.equal(_bytes(a), _bytes(other))
    assert param_seed(0, "x") == param_seed(0, "x") != param_seed(0, "y")


def test_float_draw_statistics():
    norm = Param("n.weight", (4096,), Fmt.BF16, "head", Init(0.1, 1.0))
    w = draw(norm, 0)
    assert torch.equal(w, draw(norm, 0))
    assert abs(w.mean().item() - 1.0) < 0.01 and abs(w.std().item() - 0.1) < 0.005
    with pytest.raises(ValueError, match="wq_a"):
        draw(_p(), 0)


@pytest.mark.parametrize(
    ("fmt", "shape", "std"),
    [
        (Fmt.FP8, (512, 512), 0.05),
        (Fmt.FP8, (256, 1024), 1.6 * 1024**-0.5),
        (Fmt.FP8_ROWS, (512, 256), 1.0),
        (Fmt.FP4, (256, 1024), 1.5 * 1024**-0.5),
        (Fmt.FP4, (512, 256), 0.3),
    ],
)
def test_quantized_statistics_follow_the_init(fmt, shape, std):
    """Unjittered: decoded values have mean 0 and the Init std within 4% (rounding and anchors included)."""
    p = _p(shape=shape, fmt=fmt, std=std, jitter=False)
    w = decode_file_tensors(p, param_tensors(p, 0, True)).float()
    assert abs(w.mean().item()) < 0.02 * std
    assert abs(w.std().item() / std - 1) < 0.04, w.std().item()


def test_jitter_spreads_scale_exponents():
    for fmt in (Fmt.FP8, Fmt.FP4):
        p = _p(shape=(256, 256), fmt=fmt)
        s = param_tensors(p, 0, True)["layers.0.attn.wq_a.scale"]
        assert len(torch.unique(_bytes(s))) == 3  # base exponent -1, 0, +1


@pytest.mark.parametrize(
    ("fmt", "shape"),
    [
        *((Fmt.FP8, shape) for shape in ((96, 160), (40, 70), (1, 33))),
        *((Fmt.FP8_ROWS, shape) for shape in ((40, 64), (3, 50))),
        *((Fmt.FP4, shape) for shape in ((64, 96), (33, 70), (1, 2))),
    ],
)
def test_quantized_draws_are_canonical(fmt, shape):
    for seed in range(3):
        _assert_canonical(_p(shape=shape, fmt=fmt), seed)


def test_medium_shaped_slices_are_canonical():
    """Every quantized kind of the medium catalogue, with its real std and in-features, 64 rows of it."""
    config = hf_config(MEDIUM, compressed_vocab_size=MEDIUM.engram_vocab_size, quantized=True, vision=False)
    args = ModelArgs.from_hf_dict(config, "medium")
    seen = {}
    for p in catalogue(args):
        if p.fmt in (Fmt.FP8, Fmt.FP8_ROWS, Fmt.FP4):
            seen.setdefault((p.name.split(".")[-1], p.fmt, p.shape[1]), p)
    assert len(seen) >= 10
    for p in seen.values():
        _assert_canonical(p._replace(shape=(64, p.shape[1])))


def test_tables_hold_no_nan_and_follow_the_gaussian():
    t8 = e4m3_table(100.0)
    assert t8.numel() == 1 << 16 and not ((t8 & 0x7F) == 0x7F).any()
    v = t8.view(torch.float8_e4m3fn).float()
    assert abs(v.std().item() / 100 - 1) < 0.02 and abs(v.mean().item()) < 2
    t4 = e2m1_pair_table(1.5)
    codes = torch.stack([t4 & 0x0F, t4 >> 4])
    vals = decode_mxfp4(t4.view(1, -1), torch.ones(1, 4096, dtype=torch.float8_e8m0fnu), block=32)
    assert abs(vals.float().std().item() / 1.5 - 1) < 0.05
    assert (codes & 7).max() == 7  # the clamped tail (6) is drawn too


def test_bad_init_is_refused():
    with pytest.raises(ValueError, match="mean 0"):
        param_tensors(Param("x", (32, 32), Fmt.FP8, "g", Init(0.1, 1.0)), 0, True)
    with pytest.raises(ValueError, match="exponents"):
        param_tensors(_p(std=1e-9), 0, True)


def test_plain_formats():
    f32 = Param("layers.0.hc_attn_base", (24,), Fmt.F32, "layer.0", Init(0.1))
    bf = Param("norm.weight", (64,), Fmt.BF16, "head", Init(0.1, 1.0))
    assert torch.equal(param_tensors(f32, 0, True)["layers.0.hc_attn_base"], draw(f32, 0))
    assert torch.equal(param_tensors(bf, 0, False)["norm.weight"], draw(bf, 0).bfloat16())
    assert torch.equal(param_tensors(bf, 0, True)["norm.weight"], draw(bf, 0).bfloat16())


@pytest.mark.parametrize("std", [0.6, 0.045, 1.0])
def test_engram_row_scales_are_those_quantizing_gaussian_rows_gives(std):
    """make-tiny's Engram table (e4m3 rows, a scale per 32) draws its scale exponent from the std/scale ratio
    of quantized Gaussian rows of 32, not of 32x32 tiles (larger blocks hold larger maxima): its unjittered
    scales must be the most common scale that encoding Gaussian rows of the same std gives."""
    p = Param("layers.1.engram.embed", (256, 256), Fmt.FP8_ROWS, "engram.1", Init(std))
    s = param_tensors(p, 0, True)[f"{p.name}.scale"]
    g = torch.Generator().manual_seed(1)
    _, real = encode_fp8_blocks(torch.randn(p.shape, generator=g) * std, block=(1, 32))
    assert torch.equal(_bytes(s).unique(), _bytes(real).flatten().mode().values.view(1)), std


@pytest.mark.parametrize("fmt", [Fmt.FP4, Fmt.FP8_ROWS])
def test_jitter_is_one_power_of_two_per_32x32_tile_for_row_scales_too(fmt):
    """Init.jitter multiplies each 32x32 block by one 2**k: for formats with a scale per 32 along each row, the
    32 row scales of a tile share their exponent (drawn per row, a tile's rows had up to 3 scales and values
    4x apart, which no jittered float weight quantizes to)."""
    p = _p(shape=(128, 96), fmt=fmt)
    s = _bytes(param_tensors(p, 0, True)[f"{p.name}.scale"])
    assert tuple(s.shape) == (128, 3)
    tiles = s.view(4, 32, 3)  # [row tile, row in tile, scale column]
    assert bool((tiles == tiles[:, :1, :]).all())
    assert len(s.unique()) > 1  # jittered: the tiles differ


def test_the_smallest_std_drawn_is_one_the_encoders_give_back_and_smaller_ones_are_refused():
    """The e4m3 encoder floors a block's amax at 1e-4, so a scale below 1e-4 / 240 (2**-22 and less) cannot be
    the one it picks for the drawn codes: a draw at std 99 * 2**-21 (scale 2**-21, 240 * 2**-21 > 1e-4) must be
    canonical, and std 3e-6 (scale 2**-25) must be refused naming the exponents, not drawn as bytes that quantizing
    their own values does not give back."""
    _assert_canonical(_p(std=99 * 2.0**-21, jitter=False))
    with pytest.raises(ValueError, match="exponents"):
        param_tensors(_p(std=3e-6, jitter=False), 0, True)
