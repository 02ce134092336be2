"""fp4_gemm on CUDA: e4m3 activations times MXFP4 weights, matching `kernels.ref.fp4_gemm` within a bound.

The kernel is `block_gemm.block_gemm_kernel` with packed e2m1 weights, K blocks of 32 (the weight's
scale group) and one e8m0 weight scale per row; its docstring gives the numerics, the bound (the
same as fp8_gemm's, for the same reasons) and the layout. Operands are checked once per shape, as in
fp8_gemm.
"""

import functools

import torch
from torch import Tensor

from dsv41_convert.kernels.block_gemm import FP4_TILES, block_gemm_kernel, dense, launcher, pick_tile, rows

GROUP = 32  # weight scale group along K
STAGES = 3  # pipeline stages (each block_gemm.K_TILE columns of K) in flight
PACKED_DTYPES = (torch.float4_e2m1fn_x2, torch.uint8, torch.int8)


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
    run, m, n, e8m0 = _launch(
        a.shape, a_s.shape, b.shape, b_s.shape, a.dtype, a_s.dtype, b.dtype, b_s.dtype, act_block_size, a.device
    )
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        run(rows(dense(a), m), rows(dense(a_s, e8m0), m), dense(b, True), dense(b_s, True), c)
    return c if a.dim() == 2 else c.view(*a.shape[:-1], n)


@functools.cache
def _launch(a_shape, a_s_shape, b_shape, b_s_shape, a_dtype, s_dtype, b_dtype, b_s_dtype, act_block, device):
    """-> (launch, M, N, e8m0) for operands of these shapes and dtypes, checked here once; raises ValueError."""
    k, n = a_shape[-1], b_shape[0]
    if a_dtype != torch.float8_e4m3fn or b_dtype not in PACKED_DTYPES:
        raise ValueError(f"fp4_gemm: a {a_dtype} {list(a_shape)} must be e4m3, b {b_dtype} {list(b_shape)} packed e2m1")
    if act_block not in (32, 128) or k % act_block or 2 * b_shape[1] != k or device.type != "cuda":
        raise ValueError(f"fp4_gemm: a {list(a_shape)}, b {list(b_shape)} (packed), act block {act_block}")
    m = a_shape.numel() // k
    if a_s_shape.numel() != m * (k // act_block) or tuple(b_s_shape) != (n, k // GROUP):
        raise ValueError(
            f"fp4_gemm: scales a_s {list(a_s_shape)}, b_s {list(b_s_shape)} "
            f"do not fit a {list(a_shape)}, b {list(b_shape)}"
        )
    if s_dtype not in (torch.float32, torch.float8_e8m0fnu) or b_s_dtype != torch.float8_e8m0fnu:
        raise ValueError(f"fp4_gemm: scale dtypes {s_dtype}, {b_s_dtype}: want float32/e8m0 and e8m0")
    e8m0 = s_dtype == torch.float8_e8m0fnu
    run = launcher(_kernels(n, k, act_block, e8m0)[pick_tile(m, n, device, FP4_TILES)]) if m else None
    return run, m, n, e8m0


@functools.cache
def _kernels(n: int, k: int, act_block: int, e8m0: bool) -> dict:
    """tile -> compiled kernel, both tiles on the first call (as fp8_gemm._kernels)."""
    return {tile: fp4_gemm_kernel(n, k, act_block, e8m0, tile) for tile in FP4_TILES}


def warm_up(n: int, k: int, act_block_size: int = 32, e8m0: bool = True) -> None:
    """Compile the kernels (both tiles) for an expert weight [n, k] (logical) before collectives start."""
    _kernels(n, k, act_block_size, e8m0)
