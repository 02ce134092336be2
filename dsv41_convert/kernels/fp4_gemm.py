"""fp4_gemm on CUDA: e4m3 activations times MXFP4 weights, matching `kernels.ref.fp4_gemm` within a bound.

The kernel is `block_gemm.block_gemm_kernel` with packed e2m1 weights, K blocks of 32 (the weight's
scale group) and one e8m0 weight scale per row; its docstring gives the numerics, the bound (the
same as fp8_gemm's, for the same reasons) and the layout.
"""

import functools

import torch
from torch import Tensor

from dsv41_convert.kernels.block_gemm import FP4_TILES, block_gemm_kernel, pick_tile

GROUP = 32  # weight scale group along K
STAGES = 3  # pipeline stages (each block_gemm.K_TILE columns of K) in flight


def fp4_gemm_kernel(n: int, k: int, act_block: int, e8m0: bool, tile: tuple[int, int, int] = FP4_TILES[1]):
    """[M, k] e4m3 x [n, k/2] packed e2m1 -> [M, n] bf16."""
    return block_gemm_kernel(n, k, GROUP, act_block, 1, True, e8m0, True, STAGES, tile)


def fp4_gemm(
    a: Tensor,
    a_s: Tensor,
    b: Tensor,
    b_s: Tensor,
    scale_dtype: torch.dtype = torch.float32,
    act_block_size: int = 128,
) -> Tensor:
    """e4m3 activations times packed e2m1 weights; same signature as kernels.ref.fp4_gemm.

    a:   [..., K]                  float8_e4m3fn, CUDA
    a_s: [..., K/act_block_size]   float8_e8m0fnu or float32
    b:   [N, K/2]                  float4_e2m1fn_x2 (logical [N, K])
    b_s: [N, K/32]                 float8_e8m0fnu
    -> [..., N]                    bfloat16
    """
    k, n = a.size(-1), b.size(0)
    if a.dtype != torch.float8_e4m3fn or b.dtype not in (torch.float4_e2m1fn_x2, torch.uint8, torch.int8):
        raise ValueError(f"fp4_gemm: a {a.dtype} {list(a.shape)} must be e4m3, b {b.dtype} {list(b.shape)} packed e2m1")
    if act_block_size not in (32, 128) or k % act_block_size or 2 * b.size(1) != k or not a.is_cuda:
        raise ValueError(f"fp4_gemm: a {list(a.shape)}, b {list(b.shape)} (packed), act block {act_block_size}")
    m = a.numel() // k
    if a_s.numel() != m * (k // act_block_size) or tuple(b_s.shape) != (n, k // GROUP):
        raise ValueError(
            f"fp4_gemm: scales a_s {list(a_s.shape)}, b_s {list(b_s.shape)} "
            f"do not fit a {list(a.shape)}, b {list(b.shape)}"
        )
    if a_s.dtype not in (torch.float32, torch.float8_e8m0fnu) or b_s.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"fp4_gemm: scale dtypes {a_s.dtype}, {b_s.dtype}: want float32/e8m0 and e8m0")
    e8m0 = a_s.dtype == torch.float8_e8m0fnu
    a_s_arg = a_s.contiguous().view(torch.uint8) if e8m0 else a_s.contiguous()
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        kernel = _kernels(n, k, act_block_size, e8m0)[pick_tile(m, n, a.device, FP4_TILES)]
        b_arg = b.contiguous().view(torch.uint8)
        kernel(a.contiguous().view(m, k), a_s_arg.view(m, -1), b_arg, b_s.contiguous().view(torch.uint8), c)
    return c.view(*a.shape[:-1], n)


@functools.cache
def _kernels(n: int, k: int, act_block: int, e8m0: bool) -> dict:
    """tile -> compiled kernel, both tiles on the first call (as fp8_gemm._kernels)."""
    return {tile: fp4_gemm_kernel(n, k, act_block, e8m0, tile) for tile in FP4_TILES}


def warm_up(n: int, k: int, act_block_size: int = 32, e8m0: bool = True) -> None:
    """Compile the kernels (both tiles) for an expert weight [n, k] (logical) before collectives start."""
    for tile in FP4_TILES:
        fp4_gemm_kernel(n, k, act_block_size, e8m0, tile)
