"""act_quant on CUDA: per-row block e4m3 quantization, bit-exact with `quant.act.act_quant`.

The kernel is `row_quant.row_quant_kernel` with e4m3 codes (its docstring gives the numerics and the
layout); this module maps the reference's arguments onto it.
"""

import torch
from torch import Tensor

from dsv41_convert.kernels import row_quant
from dsv41_convert.kernels.row_quant import TL_DTYPES


def scale_kind(pow2: bool, scale_u8: bool) -> str:
    """row_quant's scale format: e8m0 bytes, power-of-two float32, or plain float32."""
    return "e8m0" if scale_u8 else ("pow2" if pow2 else "f32")


def act_quant_kernel(
    c: int, group: int, in_dtype: str, pow2: bool, scale_u8: bool, inplace: bool, unroll: int | None = None
):
    """The compiled kernel for rows of length c (pow2: ue8m0 scales; scale_u8: store e8m0 bytes)."""
    return row_quant.row_quant_kernel(
        c,
        group,
        in_dtype,
        "e4m3",
        scale_kind(pow2, scale_u8),
        inplace,
        unroll or row_quant.UNROLL["e4m3"],
        row_quant.CTA_THREADS["e4m3"],
    )


def quantize_rows(
    x2: Tensor, group: int, pow2: bool, scale_u8: bool, inplace: bool, nonfinite_count: Tensor
) -> tuple[Tensor, Tensor] | None:
    """e4m3 codes over a contiguous [R, C] CUDA tensor; see `row_quant.quantize_rows`.

    x2: [R, C]  bfloat16 / float16 / float32, contiguous, CUDA
    -> q [R, C] float8_e4m3fn, s [R, ceil(C/group)] uint8 (e8m0 bytes) or float32; None when inplace
    """
    return row_quant.quantize_rows(x2, group, "e4m3", scale_kind(pow2, scale_u8), inplace, nonfinite_count)


def act_quant(
    x: Tensor,
    block_size: int = 32,
    scale_fmt: str | None = "ue8m0",
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
    inplace: bool = False,
) -> tuple[Tensor, Tensor] | Tensor:
    """Per-row block e4m3 quantization of activations; same signature and result as quant.act.act_quant.

    x: [..., N]                       bfloat16 / float16 / float32, CUDA, N % block_size == 0
    -> inplace=False: q [..., N]      float8_e4m3fn
                      s [..., N/B]    scale_dtype (float8_e8m0fnu needs scale_fmt="ue8m0")
    -> inplace=True:  x itself, overwritten with f32(q) * scale cast to x.dtype
    Non-finite activations are not reported (as the reference).
    """
    if x.dtype not in TL_DTYPES or not x.is_cuda:
        raise ValueError(f"act_quant: x must be a CUDA float tensor, got {x.dtype} {list(x.shape)} on {x.device}")
    if block_size < 1 or x.size(-1) % block_size or block_size & (block_size - 1):
        raise ValueError(f"act_quant: last dim of {list(x.shape)} must be a multiple of block_size {block_size} (2**k)")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"act_quant: scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    if scale_dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"act_quant: scale_dtype must be float32 or float8_e8m0fnu, got {scale_dtype}")
    if scale_dtype == torch.float8_e8m0fnu and scale_fmt is None:
        raise ValueError("act_quant: e8m0 scales need scale_fmt='ue8m0' (a plain float32 scale is not a power of two)")
    pow2 = scale_fmt is not None
    scale_u8 = scale_dtype == torch.float8_e8m0fnu
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    if inplace:
        xc = x if x.is_contiguous() else x.contiguous()
        quantize_rows(xc.view(-1, x.size(-1)), block_size, pow2, scale_u8, True, counter)
        if xc is not x:
            x.copy_(xc)
        return x
    lead = x.shape[:-1]
    q, s = quantize_rows(x.contiguous().view(-1, x.size(-1)), block_size, pow2, scale_u8, False, counter)
    s = s.view(torch.float8_e8m0fnu) if scale_u8 else s
    return q.view(*lead, x.size(-1)), s.view(*lead, s.size(-1))


def warm_up(n: int, block_size: int = 32, dtype: torch.dtype = torch.bfloat16, inplace: bool = False) -> None:
    """Compile the kernel for rows of length n (ue8m0, e8m0 scales) before collectives start."""
    act_quant_kernel(n, block_size, TL_DTYPES[dtype], True, True, inplace)
