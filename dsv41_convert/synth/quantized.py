"""Random quantized weights drawn directly as codes and scales, already in canonical form.

Instead of drawing floats and quantizing them, each block gets a power-of-two e8m0 scale and codes
drawn from the distribution that rounding N(0, (std/scale)**2) to the format would give (one 16-bit
uniform draw per e4m3 code or per packed pair of e2m1 codes, looked up in a 65536-entry table). One
element per block, at a random position, is then set to an "anchor" code whose magnitude pins the
block's scale, so that the encoders in dsv41_convert.quant pick exactly this scale and these codes
when given the decoded values:

    format  block  anchor magnitude     encoder scale rule                  why it maps back to s
    e4m3    32x32  240..448 (8 codes)   2**ceil(log2(amax * f32(1/448)))    amax/448 in [0.54 s, s]
    e4m3    1x32   240..448             same (Engram rows)                  same
    e2m1    1x32   4 or 6               2**ceil(log2(amax * f32(1/6)))      amax/6 in {0.67 s, s}

(6 * f32(1/6) and 448 * f32(1/448) both round to exactly 1.0 in float32; every other code has a
magnitude <= the format maximum.) Decoded values code * s are exact in float32 and in bfloat16
(at most 3 mantissa bits times a power of two), so the floats re-encode to the same bytes, and the
floor on amax (1e-4 for e4m3, 6 * 2**-126 for e2m1) never applies: scales are checked to keep
240 * s >= 240 * 2**-21 > 1e-4.

The scale exponent is round(log2(std / r0)) plus the per-32x32-tile jitter k in {-1, 0, 1}, with r0
the typical std/scale ratio of a quantized Gaussian block (about 99 for 32x32 e4m3 blocks, 144 for
rows of 32, 1.77 for e2m1 rows of 32). The codes' Gaussian std is then solved for so that rounding,
clamping and the anchor together give mean square (std/scale)**2: unjittered tensors decode to the
Init std within a few percent, and jitter multiplies it by about 1.3, as jittering floats would.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from dsv41_convert.convert.catalogue import BLOCK, Init
from dsv41_convert.quant.fp4 import E2M1_VALUES

_TABLE = 1 << 16  # entries of a lookup table: one uniform 16-bit draw picks one entry
_E4M3_FINITE = 127  # bytes 0..126 are the non-negative finite e4m3 values; 127 is NaN
_E4M3_ANCHOR = 0x77  # bytes 0x77..0x7E are 240, 256, ..., 448
_E2M1_ANCHOR = (6, 7)  # codes of 4 and 6
RATIO_E4M3_TILE = 99.0  # std / scale of a Gaussian 32x32 block quantized to e4m3
RATIO_E4M3_ROW = 144.0  # same, per 32 along a row
RATIO_E2M1 = 1.77  # same for e2m1 per 32 along a row
_MIN_EXP = -21  # smallest scale exponent: keeps 240 * scale above the e4m3 encoder's 1e-4 amax floor
_MAX_EXP = 100


def _table(p_bytes: Tensor) -> Tensor:
    """A 65536-entry lookup table whose entries are the bytes 0..255 in proportion to `p_bytes`.

    p_bytes: [256]  float64, sums to 1
    -> [65536]      uint8
    """
    cum = torch.round(torch.cumsum(p_bytes, 0) * _TABLE).long()
    cum[-1] = _TABLE
    counts = torch.diff(cum, prepend=torch.zeros(1, dtype=torch.long))
    return torch.repeat_interleave(torch.arange(256, dtype=torch.int64).to(torch.uint8), counts)


def _rounding_probs(magnitudes: Tensor, r: float) -> Tensor:
    """P(round-to-nearest of |x| = magnitude), x ~ N(0, r**2), per sign: the mass of each
    magnitude's rounding interval (the last one takes everything above: the encoders clamp).

    magnitudes: [n]  float64, increasing, magnitudes[0] = 0
    -> [n]           float64, half of P(|round(x)| = m) (one sign)
    """
    mids = (magnitudes[1:] + magnitudes[:-1]) / 2
    edges = torch.cat([torch.zeros(1, dtype=torch.float64), mids, torch.full((1,), math.inf, dtype=torch.float64)])
    cdf = torch.special.ndtr(edges / r)
    return cdf[1:] - cdf[:-1]


def _e4m3_magnitudes() -> Tensor:
    return torch.arange(_E4M3_FINITE, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def _e2m1_magnitudes() -> Tensor:
    return E2M1_VALUES[:8].double()


def _gaussian_std(mags: Tensor, anchors: Tensor, block: int, r: float) -> float:
    """The Gaussian std to draw codes with so that a block of `block` codes, one of them an anchor
    (uniform over `anchors`), has mean square value r**2 (rounding and anchors change it otherwise).

    mags: [n] float64 code magnitudes; anchors: [k] float64 anchor magnitudes
    """
    want = (block * r * r - float((anchors**2).mean())) / (block - 1)
    lo, hi = 0.05 * r, 4.0 * r
    for _ in range(60):  # bisection: the mean square grows with the std
        mid = (lo + hi) / 2
        m2 = float(2 * (_rounding_probs(mags, mid) * mags**2).sum())
        lo, hi = (mid, hi) if m2 < want else (lo, mid)
    return (lo + hi) / 2


def e4m3_table(std: float) -> Tensor:
    """Lookup table of e4m3 bytes (both signs, no NaN) distributed as e4m3(N(0, std**2)) clamped at 448.

    -> [65536]  uint8
    """
    half = _rounding_probs(_e4m3_magnitudes(), std)
    p = torch.zeros(256, dtype=torch.float64)
    p[:_E4M3_FINITE] = half
    p[0x80 : 0x80 + _E4M3_FINITE] = half
    return _table(p / p.sum())


def e2m1_pair_table(std: float) -> Tensor:
    """Lookup table of packed bytes holding two independent e2m1 codes, each distributed as
    e2m1(N(0, std**2)) clamped at 6 (low nibble = first element).

    -> [65536]  uint8
    """
    half = _rounding_probs(_e2m1_magnitudes(), std)
    p16 = torch.cat([half, half])
    p = (p16[None, :] * p16[:, None]).flatten()  # index hi * 16 + lo = the byte value
    return _table(p / p.sum())


@functools.lru_cache(maxsize=64)
def _e4m3_block_table(r: float, block: int) -> Tensor:
    """e4m3 table for blocks of `block` codes (one an anchor) with mean square r**2 (cached: few distinct r)."""
    anchors = _e4m3_magnitudes()[_E4M3_ANCHOR : _E4M3_ANCHOR + 8]
    return e4m3_table(_gaussian_std(_e4m3_magnitudes(), anchors, block, r))


@functools.lru_cache(maxsize=64)
def _e2m1_block_table(r: float) -> Tensor:
    """e2m1 pair table for rows of 32 codes (one an anchor) with mean square r**2 (cached)."""
    return e2m1_pair_table(_gaussian_std(_e2m1_magnitudes(), _e2m1_magnitudes()[list(_E2M1_ANCHOR)], BLOCK, r))


def _codes(table: Tensor, shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    u = torch.randint(0, _TABLE, (math.prod(shape),), generator=gen, dtype=torch.int32)
    return table.index_select(0, u).view(shape)


def _exponents(init: Init, ratio: float, grid: tuple[int, int], tile_rows: int, name: str, gen) -> tuple[int, Tensor]:
    """Base scale exponent and per-block exponents, jittered per 32x32 tile when init.jitter.

    grid: (scale rows, scale cols); tile_rows: scale rows per 32-row tile (1 or 32)
    -> (base exponent, [*grid] int32)
    """
    if init.mean != 0.0 or not init.std > 0.0:
        raise ValueError(f"{name}: quantized draws want mean 0 and std > 0, got {init}")
    base = round(math.log2(init.std / ratio))
    exp = torch.full(grid, base, dtype=torch.int32)
    if init.jitter:
        tiles = (-(-grid[0] // tile_rows), grid[1])
        k = torch.randint(-1, 2, tiles, generator=gen, dtype=torch.int32)
        exp += k.repeat_interleave(tile_rows, 0)[: grid[0]]
    lo, hi = int(exp.min()), int(exp.max())
    if lo < _MIN_EXP or hi > _MAX_EXP:
        raise ValueError(f"{name}: std {init.std} needs scale exponents {lo}..{hi}, outside {_MIN_EXP}..{_MAX_EXP}")
    return base, exp


def _anchors(grid: tuple[int, int], block: tuple[int, int], shape: tuple[int, int], gen) -> tuple[Tensor, Tensor]:
    """One random element per block (inside the weight where the last block along a dim is partial).

    -> rows, cols: [*grid]  int64
    """
    (nr, nc), (bo, bi), (out, inp) = grid, block, shape
    r0, c0 = bo * torch.arange(nr), bi * torch.arange(nc)
    height, width = (out - r0).clamp(max=bo), (inp - c0).clamp(max=bi)
    u = torch.randint(0, _TABLE, (2, nr, nc), generator=gen, dtype=torch.int64)
    return r0[:, None] + u[0] % height[:, None], c0[None, :] + u[1] % width[None, :]


def _scales(exp: Tensor) -> Tensor:
    return (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def draw_fp8(shape: tuple[int, int], init: Init, block: tuple[int, int], seed: int, name: str) -> tuple[Tensor, Tensor]:
    """Canonical e4m3 codes and e8m0 scales, one scale per bo x bi block (32x32, or 1x32 for rows).

    -> q: [out, in]                    float8_e4m3fn
       s: [ceil(out/bo), ceil(in/bi)]  float8_e8m0fnu
    """
    (out, inp), (bo, bi) = shape, block
    gen = torch.Generator().manual_seed(seed)
    grid = (-(-out // bo), -(-inp // bi))
    ratio = RATIO_E4M3_TILE if bo == BLOCK else RATIO_E4M3_ROW
    base, exp = _exponents(init, ratio, grid, BLOCK // bo, name, gen)
    q = _codes(_e4m3_block_table(init.std / 2.0**base, bo * bi), shape, gen)
    rows, cols = _anchors(grid, block, shape, gen)
    anchor = _E4M3_ANCHOR + torch.randint(0, 8, grid, generator=gen, dtype=torch.uint8)
    anchor |= torch.randint(0, 2, grid, generator=gen, dtype=torch.uint8) << 7
    q[rows.flatten(), cols.flatten()] = anchor.flatten()
    return q.view(torch.float8_e4m3fn), _scales(exp)


def draw_fp4(shape: tuple[int, int], init: Init, seed: int, name: str) -> tuple[Tensor, Tensor]:
    """Canonical packed e2m1 codes and e8m0 scales, one scale per 32 along each row.

    -> packed: [out, in/2]        int8 (two codes a byte, the even element in the low nibble)
       s: [out, ceil(in/32)]      float8_e8m0fnu
    """
    out, inp = shape
    if inp % 2:
        raise ValueError(f"{name}: fp4 weights want an even in-features, got {list(shape)}")
    gen = torch.Generator().manual_seed(seed)
    grid = (out, -(-inp // BLOCK))
    base, exp = _exponents(init, RATIO_E2M1, grid, BLOCK, name, gen)
    packed = _codes(_e2m1_block_table(init.std / 2.0**base), (out, inp // 2), gen)
    rows, cols = _anchors(grid, (1, BLOCK), shape, gen)
    code = torch.tensor(_E2M1_ANCHOR, dtype=torch.uint8)[torch.randint(0, 2, grid, generator=gen)]
    code |= torch.randint(0, 2, grid, generator=gen, dtype=torch.uint8) << 3
    shift = ((cols % 2) * 4).to(torch.uint8)
    rows, byte = rows.flatten(), (cols // 2).flatten()
    keep = (torch.tensor(0xF0, dtype=torch.uint8) >> shift).flatten()
    packed[rows, byte] = (packed[rows, byte] & keep) | (code.flatten() << shift.flatten())
    return packed.view(torch.int8), _scales(exp)
