"""NaN bytes in a quantized source, refused before they decode: an e8m0 scale of byte 255 and an e4m3 (fn)
weight byte 0x7F or 0xFF are NaN, and a decoder would write NaN weights from them (every value of a NaN
scale's block). One rule for every decode path, with numpy alone (CPU workers import it without torch):
quant/cast_bytes.py, fp8_bytes.py and fp4_bytes.py call it on their blocks, convert/transform.py's
apply() on host bytes of its torch inputs (on CUDA once a scan on the device found one). e2m1 codes have
no NaN, so an fp4 weight needs only its scales.

The scans are maxima, which allocate nothing: 255 is the largest uint8 and 0x7F the largest int8, so a
NaN byte is present exactly when a maximum reaches it. Only then is the first index looked up.
"""

from __future__ import annotations

import numpy as np

from dsv41_convert.errors import FormatError

E8M0_NAN = 0xFF  # e8m0's only NaN; it has no infinity
E4M3_NAN = 0x7F  # e4m3 (fn)'s NaN without its sign bit (0x7F and 0xFF); it has no infinity


def require_scales_not_nan(s: np.ndarray, name: str) -> None:
    """Raise FormatError naming `name` and the first index of a NaN scale (one max over the scales).

    s: [...]  uint8 (e8m0 bytes)
    """
    if s.size and int(s.max()) == E8M0_NAN:
        raise FormatError(
            f"{name}: scale is NaN (e8m0 byte {E8M0_NAN}) at {_first(s == E8M0_NAN)}; "
            "expected a power of two; corrupt shard?"
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
            f"{name}: weight is NaN (e4m3 byte {int(q[tuple(first)])}) at {first}; "
            "expected a finite e4m3 value; corrupt shard?"
        )


def _first(hit: np.ndarray) -> list[int]:
    """The row-major first True index of `hit` (at least one is True)."""
    return [int(i) for i in np.unravel_index(int(hit.argmax()), hit.shape)]
