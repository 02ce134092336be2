"""The lossless MXFP4 -> fp8 cast of routed experts (upstream convert.py --expert-dtype fp8) for torch
tensors: the rule is quant/cast_bytes.py's (numpy, on the tensors' bytes; the formulas are there)."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41_convert.quant.cast_bytes import FP8_BLOCK, fp4_to_fp8_bytes
from dsv41_convert.quant.checks import require_dtype

__all__ = ["FP8_BLOCK", "fp4_to_fp8"]


def fp4_to_fp8(packed: Tensor, s: Tensor, block: int = 32, name: str = "<tensor>") -> tuple[Tensor, Tensor]:
    """Re-express an MXFP4 weight as e4m3 with 32x32 e8m0 block scales, bit-exact in value
    (cast_bytes.fp4_to_fp8_bytes: the block scale, the offsets, the errors).

    So decode_fp8_blocks(w8, s8) == decode_mxfp4(packed, s) value for value (in float32, before any cast).

    packed: [out, in/2]                     float4_e2m1fn_x2 / int8 / uint8 (logical [out, in]), on the CPU
    s: [out, ceil(in/block)]                float8_e8m0fnu; `block` an even divisor of 32
    -> w8: [out, in]                        float8_e4m3fn
       s8: [ceil(out/32), ceil(in/32)]      float8_e8m0fnu
    """
    require_dtype(packed, (torch.float4_e2m1fn_x2, torch.int8, torch.uint8), f"{name}: fp4_to_fp8 weight")
    require_dtype(s, (torch.float8_e8m0fnu,), f"{name}: fp4_to_fp8 scale")
    w8, s8 = fp4_to_fp8_bytes(packed.view(torch.uint8).numpy(), s.view(torch.uint8).numpy(), block, name)
    return torch.from_numpy(w8).view(torch.float8_e4m3fn), torch.from_numpy(s8).view(torch.float8_e8m0fnu)
