"""NaN bytes in a quantized source, refused before they decode: an e8m0 scale of byte 255 and an e4m3 (fn)
weight byte 0x7F or 0xFF are NaN, and a decoder would write NaN weights from them (every value of a NaN
scale's block). One rule for every decode path, with numpy alone (CPU workers import it without torch):
quant/cast_bytes.py, fp8_bytes.py and fp4_bytes.py call it on their blocks, convert/transform.py's
apply() on host bytes of its torch inputs (on CUDA once a scan on the device found one). e2m1 codes have
no NaN, so an fp4 weight needs only its scales.

The scans are maxima, which allocate nothing: 255 is the largest uint8 and 0x7F the largest int8, so a
NaN byte is present exactly when a maximum reaches it. Only then is the first index looked up.

Infinity the same way (require_finite_blocks): a finite code times a finite scale can still reach 2**128,
which no float32 or bfloat16 holds (e4m3's 448 times 2**120, e2m1's 6 times 2**126). Only scales from
HOT[codes] up can, so one max over the scales clears a tensor; a block above is looked at whole.
Decoders refuse such a block in their input, encoders in their output (a source value near the bfloat16
maximum rounds up to 2**128).

What the source holds itself (first_nonfinite): a NaN or an infinity in a tensor copied or cast unchanged
(bf16 norms and embeddings, f32 gate biases, fp8 weights and scales kept as they are) would reach the
converted model as it is; the writers refuse it as the decoders do. Two maxima, over the bits as unsigned
and as signed integers: a dtype's non-finite values are the top of either range.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dsv41_convert.errors import FormatError
from dsv41_convert.quant.code_values import E2M1_CODE_VALUES, E4M3_F32  # NaN bytes are refused before a lookup

E8M0_NAN = 0xFF  # e8m0's only NaN; it has no infinity
E4M3_NAN = 0x7F  # e4m3 (fn)'s NaN without its sign bit (0x7F and 0xFF); it has no infinity
# by codes: the lowest e8m0 byte at which a code times the scale can reach 2**128, 2**(255 - byte) <= the
# largest code (e4m3: 448 >= 2**8; e2m1: 6 >= 2**2)
HOT = {"e4m3": 247, "e2m1": 253}
DECODED_INF = "expected finite weights; corrupt shard?"  # require_finite_blocks's `why` for a decoder
# safetensors dtype -> (its bits as, whether it has a sign bit (the top one), the least non-finite of the
# other bits, infinity's or None where the format has none); dtypes not here hold no NaN (F4, I8 holding
# e2m1 pairs, integers)
NONFINITE_BITS = {
    "F8_E4M3": (np.uint8, True, 0x7F, None),
    "F8_E5M2": (np.uint8, True, 0x7C, 0x7C),
    "F8_E8M0": (np.uint8, False, 0xFF, None),
    "BF16": (np.uint16, True, 0x7F80, 0x7F80),
    "F16": (np.uint16, True, 0x7C00, 0x7C00),
    "F32": (np.uint32, True, 0x7F80_0000, 0x7F80_0000),
    "F64": (np.uint64, True, 0x7FF0_0000_0000_0000, 0x7FF0_0000_0000_0000),
}


class Region(str):
    """The name messages give a source tensor, for a region of it whose first element is [row, col] of the
    tensor (a row block of a streamed tensor, a rank's columns): an index the checks find in the region's
    arrays is said in the tensor's own coordinates (`source_index`), its shape as the tensor's. A plain str
    names a whole tensor. row and col count values (an e2m1 pair is two). scale: where the tensor's scale is
    stored ("FILE: NAME"), when another file than the tensor's holds it; else "" (the published layout)."""

    row: int
    col: int
    shape: tuple[int, ...]
    scale: str

    def __new__(cls, text: str, row: int = 0, col: int = 0, shape: tuple[int, ...] = (), scale: str = "") -> Region:
        region = super().__new__(cls, text)
        region.row, region.col, region.shape, region.scale = row, col, tuple(shape), scale
        return region


def source_index(name: str, index: list[int], per: tuple[int, int] = (1, 1)) -> list[int]:
    """`index` into an array of region `name` (one entry per `per` rows and columns of values: (1, 1) for the
    values, the block for its scales) as an index into the whole source tensor (or its scales)."""
    if not isinstance(name, Region) or not index:
        return list(index)
    shifted = list(index)
    shifted[0] += name.row // per[0]
    if len(shifted) == 2:
        shifted[1] += name.col // per[1]
    return shifted


def source_shape(name: str, shape) -> list[int]:
    """The shape a message gives: the source tensor's where `name` is a Region of it, else `shape`."""
    return list(name.shape) if isinstance(name, Region) and name.shape else list(shape)


def require_scales_not_nan(s: np.ndarray, name: str, block: tuple[int, int] = (1, 1)) -> None:
    """Raise FormatError naming `name` and the first index of a NaN scale (one max over the scales).

    s: [...]  uint8 (e8m0 bytes), one per `block` (rows, columns) of values of region `name`
    """
    if s.size and int(s.max()) == E8M0_NAN:
        # a scale stored in another file than its weight's is named there: the weight's file holds no scale
        held = f" (in {name.scale})" if isinstance(name, Region) and name.scale else ""
        raise FormatError(
            f"{name}: scale is NaN (e8m0 byte {E8M0_NAN}) at {source_index(name, _first(s == E8M0_NAN), block)}"
            f"{held}; expected a power of two; corrupt shard?"
        )


def require_e4m3_not_nan(q: np.ndarray, name: str) -> None:
    """Raise FormatError naming `name` and the first index of a NaN weight byte (two maxima over the
    bytes: for 4096x7168, 4.4 ms on the 2-core dev box and 2.2 ms on the 16-core H200 host, 2-4% of
    decode_fp8_blocks_bf16 there).

    q: [...]  uint8 (e4m3 bytes)
    """
    if q.size and (int(q.max()) == E4M3_NAN | 0x80 or int(q.view(np.int8).max()) == E4M3_NAN):
        first = _first((q & E4M3_NAN) == E4M3_NAN)
        raise FormatError(
            f"{name}: weight is NaN (e4m3 byte {int(q[tuple(first)])}) at {source_index(name, first)}; "
            "expected a finite e4m3 value; corrupt shard?"
        )


def require_finite_blocks(
    w: np.ndarray, s: np.ndarray, block: tuple[int, int], codes: str, name: str, why: str
) -> None:
    """Raise FormatError naming `name`, the block and the first index where a code times its block's scale is
    2**128 or more (infinite in float32 and bfloat16). `why`: what the message says it means.

    w: [out, in] uint8 e4m3 bytes (codes "e4m3"), or [out, in / 2] uint8 e2m1 pairs, low nibble first ("e2m1")
    s: [ceil(out / bo), ceil(in / bi)] uint8 (e8m0 bytes); block: (bo, bi) in values
    """
    hot = HOT[codes]
    if not s.size or int(s.max()) < hot:
        return
    bo, bi = block
    for b_o, b_i in zip(*np.nonzero(s >= hot), strict=True):
        exp = int(s[b_o, b_i]) - 127
        r0, c0 = int(b_o) * bo, int(b_i) * bi
        if codes == "e4m3":
            mags = np.abs(E4M3_F32[w[r0 : r0 + bo, c0 : c0 + bi]])
        else:
            pairs = w[r0 : r0 + bo, c0 // 2 : (c0 + bi) // 2]
            mags = np.abs(np.stack([E2M1_CODE_VALUES[pairs & 15], E2M1_CODE_VALUES[pairs >> 4]], axis=-1))
            mags = mags.reshape(pairs.shape[0], -1)
        over = mags >= 2.0 ** (128 - exp)
        if over.any():
            r, c = _first(over)
            at = source_index(name, [r0 + r, c0 + c])
            raise FormatError(
                f"{name}: block {tuple(source_index(name, [int(b_o), int(b_i)], block))} decodes to infinity at "
                f"{at}: {codes} value {mags[r, c]:g} x scale 2**{exp} >= 2**128, beyond float32 and bfloat16; {why}"
            )


def first_nonfinite(data, dtype: str) -> tuple[int, float] | None:
    """(index, value: nan, inf or -inf) of the first non-finite element of `data`, the raw bytes of whole
    `dtype` elements (a safetensors dtype name); None where all are finite or the dtype has none.

    Two maxima, no temporary: a negative non-finite value has the largest unsigned bits (sign and the top
    exponent), a positive one the largest signed bits. Its cost against sha256 of the same bytes, in one
    run: docs/BENCHMARKS.md, "session 23"."""
    bits = NONFINITE_BITS.get(dtype)
    if bits is None:
        return None
    kind, signed, least, inf = bits
    x = np.frombuffer(data, dtype=kind, count=len(data) // np.dtype(kind).itemsize)
    if not x.size:
        return None
    sign = 1 << (8 * x.itemsize - 1) if signed else 0
    if int(x.max()) < sign | least and not (signed and int(x.view(f"i{x.itemsize}").max()) >= least):
        return None
    mag = x & kind(sign - 1) if signed else x
    i = int((mag >= least).argmax())
    if int(mag[i]) != inf:
        return i, float("nan")
    return i, float("-inf") if int(x[i]) & sign else float("inf")


COPIED_TOO = "in a tensor written unchanged too (copied or cast)"  # nonfinite_error's `why` for the writers


def require_finite_copy(data, dtype: str, name: str, shape, index: Callable[[int], list[int]]) -> None:
    """FormatError naming `name` (file: tensor), the tensor's `dtype` and `shape`, and `index(i)` (its index in
    the source tensor) of the first NaN or infinity among `data`, whole elements to be copied unchanged."""
    hit = first_nonfinite(data, dtype)
    if hit is not None:
        raise nonfinite_error(name, hit[1], index(hit[0]), f"in {dtype} {list(shape)}", COPIED_TOO)


def flat_index(shape, flat: int) -> list[int]:
    """The row-major index in `shape` of element `flat` ([] for a 0-d tensor)."""
    return [int(i) for i in np.unravel_index(flat, tuple(shape))] if shape else []


def nonfinite_error(name: str, value: float, index: list[int], what: str, why: str) -> FormatError:
    """The error for a NaN or an infinity found in a source tensor: `what` says where (its dtype and shape),
    `why` what finite values were needed for."""
    return FormatError(
        f"{name}: found {value} at index {index} {what}; expected finite values {why}; check the source tensor"
    )


def _first(hit: np.ndarray) -> list[int]:
    """The row-major first True index of `hit` (at least one is True)."""
    return [int(i) for i in np.unravel_index(int(hit.argmax()), hit.shape)]
