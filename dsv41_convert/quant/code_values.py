"""The value of every code of the file formats, as tables (numpy alone): what the byte decoders and the byte
checks look codes up in, one copy each.

E4M3_F32 [256] float32: each e4m3 (fn) byte (0x7F and 0xFF NaN; no infinity); E8M0_F32 [256] float32: byte
b is 2**(b - 127) (255 NaN); E2M1_CODE_VALUES [16] float64: each 4-bit e2m1 code (8..15 the negatives of
0..7, code 8 is -0.0).
"""

from __future__ import annotations

import numpy as np


def _e4m3_values() -> np.ndarray:
    """float32 [256]: the value of each e4m3 (fn) byte; 0x7F and 0xFF are NaN, there is no infinity."""
    b = np.arange(256)
    exp, mant = (b >> 3) & 15, b & 7
    mag = np.where(exp == 0, mant * 2.0**-9, (8 + mant) * np.exp2(exp - 10.0))  # (1 + mant/8) * 2**(exp-7)
    vals = np.where(b >= 128, -mag, mag)
    vals[(b & 0x7F) == 0x7F] = np.nan
    return vals.astype(np.float32)


def _e8m0_values() -> np.ndarray:
    """float32 [256]: byte b is 2**(b - 127) (byte 0 a float32 subnormal); byte 255 is NaN."""
    vals = np.exp2(np.arange(256) - 127.0)
    vals[255] = np.nan
    return vals.astype(np.float32)


E4M3_F32, E8M0_F32 = _e4m3_values(), _e8m0_values()
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; codes 8..15 are their negatives
E2M1_CODE_VALUES = np.array(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES))
