"""safetensors dtype names as torch dtypes, and a tensor's bytes as a tensor: the one table every reader uses.

F4 (e2m1 pairs, float4_e2m1fn_x2): a header gives the logical shape, whose last dim is twice torch's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
}
TORCH_TO_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def tensor_from_bytes(buf: bytearray | memoryview, dtype: str, shape: Sequence[int]) -> Tensor:
    """A tensor sharing `buf`'s memory, as a header describes it.

    buf: its bytes, row-major; dtype: the header's name; shape: the header's (logical) shape
    -> [*shape]  SAFETENSORS_DTYPES[dtype] (F4: float4_e2m1fn_x2 [..., last / 2])
    """
    raw = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    shape = list(shape)
    if dtype == "F4":
        shape[-1] //= 2
    return raw.view(SAFETENSORS_DTYPES[dtype]).reshape(shape)
