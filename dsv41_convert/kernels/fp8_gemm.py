"""fp8_gemm on CUDA: C = A @ B^T with per-block scales, matching `kernels.ref.fp8_gemm` within a bound.

Numerics (as the reference): every K block of `block_size` is one fp8 x fp8 matmul accumulated in
float32 from zero, then scaled by a_s (per row) and b_s (per weight tile) and added to a float32
accumulator in K order; the result is rounded once to bf16.

Bound against the reference (stated, and checked by tests/gpu/test_gemm_kernels.py):
  |C - C_ref| <= 2**-7 * |C_ref| + 2**-12 * (|A| @ |B|^T, scaled)
The first term is one bf16 ulp (the two sides may round a near-tie differently). The second covers
the order of the sum inside one K block: Hopper's fp8 tensor cores add the 32 exact products with
a reduced-precision (about 14-bit) internal accumulator before the float32 add, so a block partial
may differ from the reference's float32 sum by a small multiple of 2**-14 of the block's absolute
sum. With e8m0 scales all other steps are exact powers of two or identical float32 adds.

Layout: one CTA computes a block_m x block_n tile of C with wgmma (A and B tiles staged through
shared memory, software-pipelined over K blocks); M is symbolic, N and K compile-time.
"""

import tilelang
import tilelang.language as T
import torch
from torch import Tensor

from dsv41_convert.kernels.bits import e8m0_to_f32

# dtype aliases
F32 = "float32"
BF16 = "bfloat16"
E4M3 = "float8_e4m3fn"
U8 = "uint8"

# pass configs: exact float ops in the scaling epilogue
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}

BLOCK_M, BLOCK_N, THREADS, STAGES = 64, 128, 128, 4


@tilelang.jit(pass_configs=PASS_CONFIGS)
def fp8_gemm_kernel(n: int, k: int, block_size: int, e8m0: bool):
    """[M, k] e4m3 x [n, k] e4m3 -> [M, n] bf16; scales per (row, K block) and (block_size tile)."""
    m = T.symbolic("M")
    kb = k // block_size
    nb = -(-n // block_size)
    s_dtype = U8 if e8m0 else F32

    @T.prim_func
    def fp8_gemm_(
        a: T.Tensor[(m, k), E4M3],
        a_s: T.Tensor[(m, kb), s_dtype],
        b: T.Tensor[(n, k), E4M3],
        b_s: T.Tensor[(nb, kb), s_dtype],
        c: T.Tensor[(m, n), BF16],
    ):
        with T.Kernel(T.ceildiv(n, BLOCK_N), T.ceildiv(m, BLOCK_M), threads=THREADS) as (bx, by):
            a_sh = T.alloc_shared((BLOCK_M, block_size), E4M3)
            b_sh = T.alloc_shared((BLOCK_N, block_size), E4M3)
            sa_sh = T.alloc_shared((BLOCK_M,), F32)
            sb_sh = T.alloc_shared((BLOCK_N,), F32)
            c_blk = T.alloc_fragment((BLOCK_M, BLOCK_N), F32)
            c_acc = T.alloc_fragment((BLOCK_M, BLOCK_N), F32)
            c_sh = T.alloc_shared((BLOCK_M, BLOCK_N), BF16)
            T.clear(c_acc)
            for kk in T.Pipelined(kb, num_stages=STAGES):
                T.copy(a[by * BLOCK_M, kk * block_size], a_sh)
                T.copy(b[bx * BLOCK_N, kk * block_size], b_sh)
                if e8m0:
                    # the scales of this K block, decoded once into shared memory
                    for i in T.Parallel(BLOCK_M):
                        sa_sh[i] = e8m0_to_f32(a_s[by * BLOCK_M + i, kk])  # a_s[:, k].float()
                    for j in T.Parallel(BLOCK_N):
                        # b_s_rows[:, k]: the tile scale of each output row (N tail: any valid tile)
                        sb_sh[j] = e8m0_to_f32(b_s[T.min((bx * BLOCK_N + j) // block_size, nb - 1), kk])
                # partial = a[:, cols] @ b[:, cols].T, float32 from zero
                T.gemm(a_sh, b_sh, c_blk, transpose_B=True, clear_accum=True)
                # acc += partial * a_s[:, k] * b_s[:, k]
                if e8m0:
                    for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                        c_acc[i, j] += c_blk[i, j] * sa_sh[i] * sb_sh[j]
                else:
                    # float32 scales are read where they are used: staging them in shared memory like
                    # the e8m0 bytes gave wrong results on the H200 (a plain copy that TileLang turns
                    # into an asynchronous one; not investigated further), so this path is slower
                    for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                        c_acc[i, j] += (
                            c_blk[i, j]
                            * a_s[by * BLOCK_M + i, kk]
                            * b_s[T.min((bx * BLOCK_N + j) // block_size, nb - 1), kk]
                        )
            T.copy(c_acc, c_sh)  # .to(bfloat16)
            T.copy(c_sh, c[by * BLOCK_M, bx * BLOCK_N])

    return fp8_gemm_


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
        kernel = fp8_gemm_kernel(n, k, block_size, e8m0)
        kernel(a.contiguous().view(m, k), arg(a_s).view(m, -1), b.contiguous(), arg(b_s), c)
    return c.view(*a.shape[:-1], n)


def warm_up(n: int, k: int, block_size: int = 32, e8m0: bool = True) -> None:
    """Compile the kernel for a weight [n, k] before collectives start."""
    fp8_gemm_kernel(n, k, block_size, e8m0)
