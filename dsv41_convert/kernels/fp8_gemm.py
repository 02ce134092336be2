"""fp8_gemm on CUDA: C = A @ B^T with per-block scales, matching `kernels.ref.fp8_gemm` within a bound.

The kernel is `block_gemm.block_gemm_kernel` with e4m3 weights in square `block_size` tiles (its
docstring gives the numerics, the bound checked by tests/gpu/test_gemm_kernels.py, and the layout).
"""

import functools

import torch
from torch import Tensor

from dsv41_convert.kernels.block_gemm import FP8_TILES, block_gemm_kernel, pick_tile

STAGES = 4  # pipeline stages (each block_gemm.K_TILE columns of K) in flight


def fp8_gemm_kernel(n: int, k: int, block_size: int, e8m0: bool, tile: tuple[int, int, int] = FP8_TILES[1]):
    """[M, k] e4m3 x [n, k] e4m3 -> [M, n] bf16; scales per (row, K block) and (block_size tile)."""
    return block_gemm_kernel(n, k, block_size, block_size, block_size, False, e8m0, e8m0, STAGES, tile)


def fp8_gemm(
    a: Tensor,
    a_s: Tensor,
    b: Tensor,
    b_s: Tensor,
    scale_dtype: torch.dtype = torch.float32,
    block_size: int = 128,
) -> Tensor:
    """a @ b^T with per-block scales; same signature as kernels.ref.fp8_gemm (bound in the docstring).

    a:   [..., K]                              float8_e4m3fn, CUDA
    a_s: [..., K/block_size]                   float8_e8m0fnu or float32
    b:   [N, K]                                float8_e4m3fn
    b_s: [ceil(N/block_size), K/block_size]    same dtype as a_s
    -> [..., N]                                bfloat16
    """
    k, n = a.size(-1), b.size(0)
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: a {a.dtype} {list(a.shape)} and b {b.dtype} {list(b.shape)} must be e4m3")
    if block_size not in (32, 128) or k % block_size or b.size(1) != k or not a.is_cuda:
        raise ValueError(f"fp8_gemm: a {list(a.shape)}, b {list(b.shape)}, block {block_size}: K must match and divide")
    m = a.numel() // k
    if a_s.numel() != m * (k // block_size) or tuple(b_s.shape) != (-(-n // block_size), k // block_size):
        raise ValueError(
            f"fp8_gemm: scales a_s {list(a_s.shape)}, b_s {list(b_s.shape)} "
            f"do not fit a {list(a.shape)}, b {list(b.shape)}"
        )
    if a_s.dtype != b_s.dtype or a_s.dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"fp8_gemm: scale dtypes {a_s.dtype}, {b_s.dtype}: want both float32 or both e8m0")
    e8m0 = a_s.dtype == torch.float8_e8m0fnu

    def arg(t: Tensor) -> Tensor:
        return t.contiguous().view(torch.uint8) if e8m0 else t.contiguous()

    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        kernel = _kernels(n, k, block_size, e8m0)[pick_tile(m, n, a.device, FP8_TILES)]
        kernel(a.contiguous().view(m, k), arg(a_s).view(m, -1), b.contiguous(), arg(b_s), c)
    return c.view(*a.shape[:-1], n)


@functools.cache
def _kernels(n: int, k: int, block_size: int, e8m0: bool) -> dict:
    """tile -> compiled kernel, both tiles on the first call (a warm-up with one row readies the many-row
    one too); cached here, so that a call costs one dict lookup, not TileLang's argument hashing per tile
    (a 128-row gemm takes only tens of microseconds)."""
    return {tile: fp8_gemm_kernel(n, k, block_size, e8m0, tile) for tile in FP8_TILES}


def warm_up(n: int, k: int, block_size: int = 32, e8m0: bool = True) -> None:
    """Compile the kernels (both tiles) for a weight [n, k] before collectives start."""
    for tile in FP8_TILES:
        fp8_gemm_kernel(n, k, block_size, e8m0, tile)
