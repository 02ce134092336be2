"""fp8 e4m3 weights with one scale per block: encode from a float weight, decode back (the wo_a rule).

Legend: O/I = output/input rows/columns, Ob/Ib = block counts, bo/bi = block sizes.

Formats: the V4.1 dense weights use 32x32 blocks, V4 used 128x128, the Engram tables use (1, 32)
(per-32 along each row). Scales are e8m0 powers of two ("ue8m0") or plain float32. A dimension that
is not a multiple of its block gets a ceil-sized scale grid; the last block covers what is left.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv41_convert.quant.checks import FLOAT_INPUTS, require_amax_finite, require_dtype
from dsv41_convert.quant.e8m0 import pow2_ceil

FP8_MAX = 448.0
# the kernels multiply by this float32 reciprocal rather than divide by 448; we do the same
FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
AMAX_FLOOR = 1e-4  # as upstream: an all-zero block still gets a finite, nonzero scale (2**-22)

# block sizes a scale grid may stand for, tried in this order when decoding without `block`
KNOWN_BLOCKS = ((32, 32), (128, 128), (1, 32))

# float32 value of each e4m3 byte, made by torch's own cast (NaN bytes included): a gather through it
# gives the same bits as q.float(), which converts element by element (about 5x slower on the CPU)
_E4M3_F32 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def e4m3_to_float(q: Tensor) -> Tensor:
    """q.float(), bit for bit, through a 256-entry table on the CPU (q.float() elsewhere).

    q: [...]  float8_e4m3fn
    -> [...]  float32
    """
    if q.device.type != "cpu":
        return q.float()
    return _E4M3_F32.index_select(0, q.reshape(-1).view(torch.uint8).int()).view(q.shape)


def e4m3_saturate(x: Tensor) -> Tensor:
    """Round to e4m3, nearest-even, saturating at +-448 (inf becomes +-448; NaN stays NaN).

    x: [...]  float32
    -> [...]  float8_e4m3fn
    """
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def pad_blocks(x_OI: Tensor, bo: int, bi: int) -> Tensor:
    """Zero-pad up to block multiples and view as tiles (a view when no padding is needed).

    x_OI: [O, I]                         any dtype
    -> [ceil(O/bo), bo, ceil(I/bi), bi]  same dtype, padding is 0
    """
    pad_o, pad_i = -x_OI.size(0) % bo, -x_OI.size(1) % bi
    if pad_o or pad_i:
        x_OI = F.pad(x_OI, (0, pad_i, 0, pad_o))
    return x_OI.unflatten(1, (-1, bi)).unflatten(0, (-1, bo))


def unpad_blocks(tiles: Tensor, out: int, inp: int) -> Tensor:
    """Inverse of `pad_blocks`: drop the padding.

    tiles: [Ob, bo, Ib, bi]  any dtype
    -> [out, inp]            same dtype
    """
    return tiles.flatten(2, 3).flatten(0, 1)[:out, :inp]


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    bo, bi = block
    if bo < 1 or bi < 1:
        raise ValueError(f"block sizes must be >= 1, got {block}")
    return int(bo), int(bi)


def encode_fp8_blocks(
    w: Tensor, block: tuple[int, int] = (32, 32), scale_fmt: str | None = "ue8m0", name: str = "<tensor>"
) -> tuple[Tensor, Tensor]:
    """Quantize a weight to e4m3 with one scale per bo x bi block.

    amax = max |w| over the block, floored at 1e-4 (as upstream);
    scale = 2**ceil(log2(amax * f32(1/448))) from the float32 bits when scale_fmt="ue8m0",
            amax * f32(1/448) (float32) when scale_fmt is None;
    q = w / scale, clamped to +-448, rounded nearest-even to e4m3.
    NaN or Inf in `w` raises FormatError naming `name` and the first bad index.

    w: [out, in]                        float32 / bfloat16 / float16
    -> q: [out, in]                     float8_e4m3fn
       s: [ceil(out/bo), ceil(in/bi)]   float8_e8m0fnu (ue8m0) or float32 (scale_fmt None)
    """
    bo, bi = _check_block(block)
    require_dtype(w, FLOAT_INPUTS, f"{name}: encode_fp8_blocks input")
    if w.dim() != 2:
        raise ValueError(f"{name}: encode_fp8_blocks wants a 2-d weight, got {list(w.shape)}")
    if scale_fmt not in ("ue8m0", None):
        raise ValueError(f"{name}: scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    out, inp = w.shape
    tiles = pad_blocks(w.float(), bo, bi)
    amax = tiles.abs().amax(dim=(1, 3))  # [Ob, Ib]; zero padding never raises it
    require_amax_finite(amax, w, name)
    amax = amax.clamp_min(AMAX_FLOOR)
    s = amax * FP8_MAX_INV
    if scale_fmt == "ue8m0":
        s = pow2_ceil(s)
    q = e4m3_saturate(tiles / s[:, None, :, None])
    q = unpad_blocks(q, out, inp).contiguous()
    return q, (s.to(torch.float8_e8m0fnu) if scale_fmt == "ue8m0" else s)


def infer_block(q_shape: tuple[int, ...] | torch.Size, s_shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The block size (bo, bi) that a scale grid of `s_shape` stands for over a weight of `q_shape`.

    Tries 32x32, 128x128 and (1, 32), in that order. Two of them fit the same shapes only where the
    weight lies in a single block along each dimension where they differ, so they decode alike.
    """
    out, inp = q_shape
    for bo, bi in KNOWN_BLOCKS:
        if tuple(s_shape) == (-(-out // bo), -(-inp // bi)):
            return bo, bi
    raise ValueError(
        f"scale {list(s_shape)} fits no known block over weight {list(q_shape)}; "
        f"expected [ceil(out/b0), ceil(in/b1)] for one of {list(KNOWN_BLOCKS)}"
    )


def decode_fp8_blocks(
    q: Tensor, s: Tensor, block: tuple[int, int] | None = None, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Multiply each e4m3 block by its scale in float32, then cast (upstream's wo_a dequantization).

    value = f32(q) * f32(scale), then the cast to `dtype` (nearest-even): one rounding with e8m0 scales (the
    product is exact unless it overflows), two with float32 scales that are not powers of two (the float32
    product first); f32(q) comes from a 256-entry table on the CPU (`e4m3_to_float`).
    `block` None infers it from the shapes (see `infer_block`).

    q: [out, in]                        float8_e4m3fn
    s: [ceil(out/bo), ceil(in/bi)]      float8_e8m0fnu (byte b = 2**(b-127)) or float32
    -> [out, in]                        dtype (bfloat16 by default)
    """
    require_dtype(q, (torch.float8_e4m3fn,), "decode_fp8_blocks weight")
    require_dtype(s, (torch.float8_e8m0fnu, torch.float32), "decode_fp8_blocks scale")
    if q.dim() != 2 or s.dim() != 2:
        raise ValueError(f"decode_fp8_blocks wants 2-d weight and scale, got {list(q.shape)} and {list(s.shape)}")
    if block is None:
        bo, bi = infer_block(q.shape, s.shape)
    else:
        bo, bi = _check_block(block)
        want = (-(-q.size(0) // bo), -(-q.size(1) // bi))
        if tuple(s.shape) != want:
            raise ValueError(
                f"scale {list(s.shape)} does not fit weight {list(q.shape)} in {bo}x{bi} blocks: want {list(want)}"
            )
    out, inp = q.shape
    w = pad_blocks(e4m3_to_float(q), bo, bi) * s.float()[:, None, :, None]
    return unpad_blocks(w, out, inp).to(dtype)
