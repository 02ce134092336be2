"""fp4_act_quant on CUDA: per-row block e2m1 quantization, bit-exact with `quant.act.fp4_act_quant`.

Also the MXFP4 weight encoder (`quant.fp4.encode_mxfp4` is the e8m0 path with block 32). The kernel
is `row_quant.row_quant_kernel` with e2m1 codes (its docstring gives the numerics and the layout);
this module maps the reference's arguments onto it.
"""

import torch
from torch import Tensor

from dsv41_convert.kernels import row_quant
from dsv41_convert.kernels.row_quant import TL_DTYPES


def fp4_act_quant_kernel(c: int, group: int, in_dtype: str, e4m3_scale: bool, inplace: bool, unroll: int | None = None):
    """The compiled kernel for rows of length c (e4m3_scale: e4m3 scales instead of e8m0 bytes)."""
    return row_quant.row_quant_kernel(
        c,
        group,
        in_dtype,
        "e2m1",
        "e4m3" if e4m3_scale else "e8m0",
        inplace,
        unroll or row_quant.UNROLL["e2m1"],
        row_quant.CTA_THREADS["e2m1"],
    )


def quantize_rows(
    x2: Tensor, group: int, e4m3_scale: bool, inplace: bool, nonfinite_count: Tensor
) -> tuple[Tensor, Tensor] | None:
    """e2m1 codes over a contiguous [R, C] CUDA tensor; see `row_quant.quantize_rows`.

    x2: [R, C]  bfloat16 / float16 / float32, contiguous, CUDA, C even
    -> packed [R, C/2] uint8, s [R, ceil(C/group)] uint8 (e8m0 bytes) or float8_e4m3fn; None when inplace
    """
    return row_quant.quantize_rows(x2, group, "e2m1", "e4m3" if e4m3_scale else "e8m0", inplace, nonfinite_count)


def fp4_act_quant(
    x: Tensor, block_size: int = 32, inplace: bool = False, scale_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor] | Tensor:
    """Per-row block e2m1 quantization; same signature and result as quant.act.fp4_act_quant.

    scale_dtype None picks e4m3 for block_size 16 and e8m0 otherwise (as the reference).

    x: [..., N]                          bfloat16 / float16 / float32, CUDA, N % block_size == 0
    -> inplace=False: packed [..., N/2]  float4_e2m1fn_x2 (logical [..., N])
                      s [..., N/B]       scale_dtype
    -> inplace=True:  x itself, overwritten with e2m1 value * scale cast to x.dtype
    """
    if scale_dtype is None:
        scale_dtype = torch.float8_e4m3fn if block_size == 16 else torch.float8_e8m0fnu
    if scale_dtype not in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        raise ValueError(f"fp4_act_quant: scale_dtype must be float8_e8m0fnu or float8_e4m3fn, got {scale_dtype}")
    if x.dtype not in TL_DTYPES or not x.is_cuda:
        raise ValueError(f"fp4_act_quant: x must be a CUDA float tensor, got {x.dtype} {list(x.shape)} on {x.device}")
    if block_size < 2 or x.size(-1) % block_size or block_size & (block_size - 1):
        raise ValueError(f"fp4_act_quant: last dim of {list(x.shape)} must be a multiple of block_size {block_size}")
    e4m3_scale = scale_dtype == torch.float8_e4m3fn
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    if inplace:
        xc = x if x.is_contiguous() else x.contiguous()
        quantize_rows(xc.view(-1, x.size(-1)), block_size, e4m3_scale, True, counter)
        if xc is not x:
            x.copy_(xc)
        return x
    lead, n = x.shape[:-1], x.size(-1)
    packed, s = quantize_rows(x.contiguous().view(-1, n), block_size, e4m3_scale, False, counter)
    s = s if e4m3_scale else s.view(torch.float8_e8m0fnu)
    return packed.view(torch.float4_e2m1fn_x2).view(*lead, n // 2), s.view(*lead, s.size(-1))


def warm_up(n: int, block_size: int = 32, dtype: torch.dtype = torch.bfloat16, inplace: bool = False) -> None:
    """Compile the kernel for rows of length n before collectives start (e4m3 scales for block 16)."""
    fp4_act_quant_kernel(n, block_size, TL_DTYPES[dtype], block_size == 16, inplace)
