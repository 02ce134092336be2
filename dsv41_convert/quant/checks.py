"""Input checks shared by the weight encoders: a quantized weight must come from finite values."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41_convert.quant.byte_checks import nonfinite_error, source_index, source_shape
from dsv41_convert.quant.file_dtypes import TORCH_TO_SAFETENSORS


def require_finite(w: Tensor, name: str, why: str = "to quantize") -> None:
    """Raise FormatError naming `name` and the first NaN/Inf index; saturating one would hide it. `why`: what
    the values are for (the message says "expected finite values {why}").

    w: [...]  any float dtype
    """
    bad = ~torch.isfinite(w)
    if not bad.any():
        return
    first = tuple(int(i) for i in bad.nonzero()[0])
    dtype = TORCH_TO_SAFETENSORS.get(w.dtype, str(w.dtype))  # as the file names it, as for copied tensors
    shape = source_shape(name, w.shape)
    of = f"{w.numel()}" if shape == list(w.shape) else f"the {w.numel()} read"  # a region's
    what = f"({int(bad.sum())} non-finite of {of}) in {dtype} {shape}"
    raise nonfinite_error(name, float(w[first]), source_index(name, list(first)), what, why)


def require_amax_finite(amax: Tensor, w: Tensor, name: str) -> None:
    """Raise as `require_finite(w, name)` does when a block amax is not finite: a NaN or Inf in `w`
    reaches its block's amax (torch's amax propagates NaN), so the whole-tensor scan runs only then.

    amax: [...]  float32, max |w| per block;  w: the weight it came from
    """
    if not bool(torch.isfinite(amax).all()):
        require_finite(w, name)


def require_dtype(t: Tensor, allowed: tuple[torch.dtype, ...], what: str) -> None:
    """ValueError when a caller hands over a tensor of the wrong dtype (a programming error)."""
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{what}: got {t.dtype} {list(t.shape)}, expected one of {names}")


FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
