"""e8m0 scales: one unsigned byte that is a power-of-two exponent, never an integer value.

A byte b means 2**(b - 127): byte 0 is 2**-127 (a float32 subnormal), 127 is 1.0, 254 is 2**127 and
255 is NaN (torch's float8_e8m0fnu). Scales are made by rounding up to a power of two straight from
the float32 exponent and mantissa bits, as the upstream kernels do, so no log2 rounding can creep in.
"""

from __future__ import annotations

import torch
from torch import Tensor

E8M0_MIN_EXP = -127  # byte 0
E8M0_MAX_EXP = 127  # byte 254; byte 255 is NaN

_MANTISSA_MASK = (1 << 23) - 1


def decode_e8m0(s: Tensor) -> Tensor:
    """Value of each e8m0 scale.

    s: [...]  float8_e8m0fnu, byte b = 2**(b-127), byte 255 = NaN
    -> [...]  float32, exact (byte 0 gives the subnormal 2**-127)
    """
    if s.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"decode_e8m0 wants float8_e8m0fnu, got {s.dtype} {list(s.shape)}")
    return s.float()


def pow2_ceil(x: Tensor) -> Tensor:
    """2**ceil(log2(|x|)) as float32, from the float32 bits: exponent, plus one when the mantissa is nonzero.

    The upstream kernels' bit trick, edge cases included: a float32 subnormal (exponent field 0) gives
    2**-126, 0 gives 0, a finite x above 2**127 and inf give inf. NaN stays NaN (there the trick's
    integer arithmetic would wrap around to -0). Callers floor their amax first, so in use the result
    is a power of two in [2**-126, 2**127] and >= x.

    x: [...]  any float dtype; read as float32
    -> [...]  float32
    """
    x = x.float().contiguous()
    bits = x.view(torch.int32)
    field = (bits >> 23) & 0xFF
    exp = field - 127 + ((bits & _MANTISSA_MASK) != 0).to(torch.int32)
    # exponent 128 (field 255) is inf's bit pattern; NaN keeps its own bits
    out = ((exp.clamp(max=128) + 127) << 23).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)


def encode_e8m0_ceil(x: Tensor) -> Tensor:
    """Smallest e8m0 scale >= x: 2**ceil(log2(x)) from the float32 bits, clamped to [2**-126, 2**127].

    Subnormal x gives 2**-126 (see `pow2_ceil`); x above 2**127 or inf gives 2**127. NaN or x <= 0 is a
    caller bug (scales come from a floored amax) and raises ValueError.

    x: [...]  float32 (or any float dtype), > 0
    -> [...]  float8_e8m0fnu, bytes 1..254 (0 and 255 are never produced)
    """
    bad = torch.isnan(x) | (x <= 0)
    if bad.any():
        raise ValueError(f"encode_e8m0_ceil wants x > 0, got {int(bad.sum())} NaN or non-positive in {list(x.shape)}")
    # an exact power of two in range: the cast only stores its exponent
    return pow2_ceil(x).clamp(max=2.0**E8M0_MAX_EXP).to(torch.float8_e8m0fnu)
