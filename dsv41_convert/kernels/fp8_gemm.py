"""fp8_gemm on CUDA: C = A @ B^T with per-block scales, matching `kernels.ref.fp8_gemm` within a bound.

The kernel is `block_gemm.block_gemm_kernel` with e4m3 weights in square `block_size` tiles (its
docstring gives the numerics, the bound checked by tests/gpu/test_gemm_kernels.py, and the layout).
A call checks its operands once per shape (`_launch`, cached): at 128 rows the kernel takes tens of
microseconds, and Python time before the launch is time the GPU waits.
"""

import functools

import torch
from torch import Tensor

from dsv41_convert.kernels.block_gemm import (
    FP8_TILES,
    block_gemm_kernel,
    compile_tiles,
    dense,
    launcher,
    pick_tile,
    rows,
)

STAGES = 4  # pipeline stages (each block_gemm.K_TILE columns of K) in flight
DEPTH = {(64, 64, 128): 3}  # matmuls in flight (block_gemm_kernel's depth) where not 2; the bigger tiles
# have registers for two partial tiles only


def fp8_gemm_kernel(
    n: int,
    k: int,
    block_size: int,
    e8m0: bool,
    tile: tuple[int, int, int] = max(FP8_TILES),
    a_block: int | None = None,
    b_e8m0: bool | None = None,
):
    """[M, k] e4m3 x [n, k] e4m3 -> [M, n] bf16; scales per (row, a_block columns) and (block_size tile).

    a_block defaults to block_size, b_e8m0 (the weight scales' format) to e8m0 (the activation scales').
    """
    a_block = block_size if a_block is None else a_block
    b_e8m0 = e8m0 if b_e8m0 is None else b_e8m0
    depth = DEPTH.get(tile, 2)
    return block_gemm_kernel(n, k, block_size, a_block, block_size, False, e8m0, b_e8m0, STAGES, tile, depth=depth)


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
    run, m, n, e8m0 = _launch(
        a.shape, a_s.shape, b.shape, b_s.shape, a.dtype, a_s.dtype, b.dtype, b_s.dtype, block_size, a.device
    )
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        run(rows(dense(a), m), rows(dense(a_s, e8m0), m), dense(b), dense(b_s, e8m0), c)
    return c if a.dim() == 2 else c.view(*a.shape[:-1], n)


@functools.cache
def _launch(a_shape, a_s_shape, b_shape, b_s_shape, a_dtype, s_dtype, b_dtype, b_s_dtype, block_size, device):
    """-> (launch, M, N, e8m0) for operands of these shapes and dtypes, checked here once; raises ValueError."""
    k, n = a_shape[-1], b_shape[0]
    if a_dtype != torch.float8_e4m3fn or b_dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: a {a_dtype} {list(a_shape)} and b {b_dtype} {list(b_shape)} must be e4m3")
    if block_size not in (32, 128) or k % block_size or b_shape[1] != k or device.type != "cuda":
        raise ValueError(f"fp8_gemm: a {list(a_shape)}, b {list(b_shape)}, block {block_size}: K must match and divide")
    m = a_shape.numel() // k
    if a_s_shape.numel() != m * (k // block_size) or tuple(b_s_shape) != (-(-n // block_size), k // block_size):
        raise ValueError(
            f"fp8_gemm: scales a_s {list(a_s_shape)}, b_s {list(b_s_shape)} "
            f"do not fit a {list(a_shape)}, b {list(b_shape)}"
        )
    if s_dtype != b_s_dtype or s_dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"fp8_gemm: scale dtypes {s_dtype}, {b_s_dtype}: want both float32 or both e8m0")
    e8m0 = s_dtype == torch.float8_e8m0fnu
    run = launcher(kernels(n, k, block_size, e8m0)[pick_tile(m, n, device, FP8_TILES)]) if m else None
    return run, m, n, e8m0


@functools.cache
def kernels(
    n: int, k: int, block_size: int, e8m0: bool, a_block: int | None = None, b_e8m0: bool | None = None
) -> dict:
    """tile -> compiled kernel, every tile on the first call (a warm-up with one row readies the many-row
    ones too); arguments as fp8_gemm_kernel's."""
    return compile_tiles(lambda tile: fp8_gemm_kernel(n, k, block_size, e8m0, tile, a_block, b_e8m0), FP8_TILES)


def warm_up(n: int, k: int, block_size: int = 32, e8m0: bool = True) -> None:
    """Compile the kernels (every tile) for a weight [n, k] before collectives start."""
    kernels(n, k, block_size, e8m0)
