"""fp4_gemm on CUDA: e4m3 activations times MXFP4 weights, matching `kernels.ref.fp4_gemm` within a bound.

Numerics (as the reference): K is walked in blocks of 32 (the weight's scale group); each block is
one matmul of exact values (every e2m1 value is exact in e4m3, so the weight tile is widened to e4m3
in shared memory and multiplied on the fp8 tensor cores) accumulated in float32 from zero, then
scaled by the activation scale (per row, per act_block_size) and the weight's e8m0 scale (per
output row) and added to a float32 accumulator in K order; the result is rounded once to bf16.

Bound against the reference, the same as fp8_gemm's and for the same reasons:
  |C - C_ref| <= 2**-7 * |C_ref| + 2**-12 * (|A| @ |B|^T, scaled)
one bf16 ulp for the final rounding, plus the fp8 tensor cores' reduced-precision addition of the 32
exact products inside one K block.

Layout: one CTA computes a block_m x block_n tile of C; the packed weight tile [block_n, 16] bytes is
loaded, decoded to e4m3 in shared memory, and fed to wgmma with the activation tile.
"""

import tilelang
import tilelang.language as T
import torch
from torch import Tensor

from dsv41_convert.kernels.bits import e2m1_e4m3_byte, e8m0_to_f32

# dtype aliases
F32 = "float32"
BF16 = "bfloat16"
E4M3 = "float8_e4m3fn"
U8 = "uint8"

# pass configs: exact float ops in the scaling epilogue
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}

BLOCK_M, BLOCK_N, THREADS, STAGES = 64, 128, 128, 3
GROUP = 32  # weight scale group along K


@tilelang.jit(pass_configs=PASS_CONFIGS)
def fp4_gemm_kernel(n: int, k: int, act_block: int, e8m0: bool):
    """[M, k] e4m3 x [n, k/2] packed e2m1 -> [M, n] bf16."""
    m = T.symbolic("M")
    kb = k // GROUP
    akb = k // act_block
    per_act = act_block // GROUP
    s_dtype = U8 if e8m0 else F32

    def a_scale(x):
        return e8m0_to_f32(x) if e8m0 else x

    @T.prim_func
    def fp4_gemm_(
        a: T.Tensor[(m, k), E4M3],
        a_s: T.Tensor[(m, akb), s_dtype],
        b: T.Tensor[(n, k // 2), U8],
        b_s: T.Tensor[(n, kb), U8],
        c: T.Tensor[(m, n), BF16],
    ):
        with T.Kernel(T.ceildiv(n, BLOCK_N), T.ceildiv(m, BLOCK_M), threads=THREADS) as (bx, by):
            a_sh = T.alloc_shared((BLOCK_M, GROUP), E4M3)
            bp_sh = T.alloc_shared((BLOCK_N, GROUP // 2), U8)
            b8_sh = T.alloc_shared((BLOCK_N, GROUP), U8)
            b_sh = T.view(b8_sh, dtype=E4M3)  # the same bytes, read as e4m3 by the tensor cores
            sa_sh = T.alloc_shared((BLOCK_M,), F32)
            sb_sh = T.alloc_shared((BLOCK_N,), F32)
            c_blk = T.alloc_fragment((BLOCK_M, BLOCK_N), F32)
            c_acc = T.alloc_fragment((BLOCK_M, BLOCK_N), F32)
            c_sh = T.alloc_shared((BLOCK_M, BLOCK_N), BF16)
            T.clear(c_acc)
            for kk in T.Pipelined(kb, num_stages=STAGES):
                T.copy(a[by * BLOCK_M, kk * GROUP], a_sh)
                T.copy(b[bx * BLOCK_N, kk * (GROUP // 2)], bp_sh)
                for i in T.Parallel(BLOCK_M):
                    sa_sh[i] = a_scale(a_s[by * BLOCK_M + i, kk // per_act])  # a_s32[:, k].float()
                for j in T.Parallel(BLOCK_N):
                    sb_sh[j] = e8m0_to_f32(b_s[T.min(bx * BLOCK_N + j, n - 1), kk])  # b_s[:, k].float()
                for j, v in T.Parallel(BLOCK_N, GROUP):
                    # decode_fp4_pairs(b), as e4m3 bytes (exact): see e2m1_e4m3_byte
                    b8_sh[j, v] = e2m1_e4m3_byte((bp_sh[j, v // 2] >> T.uint8(4 * (v % 2))) & T.uint8(15))
                # partial = a[:, cols] @ b[:, cols].T, float32 from zero
                T.gemm(a_sh, b_sh, c_blk, transpose_B=True, clear_accum=True)
                # acc += partial * a_s32[:, k] * b_s[:, k]
                for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                    c_acc[i, j] += c_blk[i, j] * sa_sh[i] * sb_sh[j]
            T.copy(c_acc, c_sh)  # .to(bfloat16)
            T.copy(c_sh, c[by * BLOCK_M, bx * BLOCK_N])

    return fp4_gemm_


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
        kernel = fp4_gemm_kernel(n, k, act_block_size, e8m0)
        b_arg = b.contiguous().view(torch.uint8)
        kernel(a.contiguous().view(m, k), a_s_arg.view(m, -1), b_arg, b_s.contiguous().view(torch.uint8), c)
    return c.view(*a.shape[:-1], n)


def warm_up(n: int, k: int, act_block_size: int = 32, e8m0: bool = True) -> None:
    """Compile the kernel for an expert weight [n, k] (logical) before collectives start."""
    fp4_gemm_kernel(n, k, act_block_size, e8m0)
