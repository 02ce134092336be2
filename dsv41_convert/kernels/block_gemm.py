"""The block-scaled gemm on CUDA behind fp8_gemm and fp4_gemm: C = A @ B^T, one K block at a time.

Numerics (as `kernels.ref.fp8_gemm` / `fp4_gemm`): K is walked in blocks of `k_block` (the weight's
scale group); each block is one matmul of exact e4m3 values on the fp8 tensor cores, accumulated in
float32 from zero, then scaled by the activation scale (per row and `a_block` columns) and the weight
scale (per `b_rows` rows) and added to a float32 accumulator in K order; the result is rounded once
to bf16. An e2m1 weight is widened to e4m3 bytes in shared memory first (every e2m1 value is exact in
e4m3, `bits.e2m1_e4m3_byte`).

Bound against the reference (stated, and checked by tests/gpu/test_gemm_kernels.py):
  |C - C_ref| <= 2**-7 * |C_ref| + 2**-12 * (|A| @ |B|^T, scaled)
The first term is one bf16 ulp (the two sides may round a near-tie differently). The second covers
the order of the sum inside one K block: Hopper's fp8 tensor cores add the exact products with a
reduced-precision (about 14-bit) internal accumulator before the float32 add, so a block partial may
differ from the reference's float32 sum by a small multiple of 2**-14 of the block's absolute sum.
With e8m0 scales all other steps are exact powers of two or identical float32 adds.

Layout: one CTA computes a BLOCK_M x BLOCK_N tile of C with wgmma (A and B tiles staged through
shared memory, software-pipelined over K blocks); M is symbolic, N and K compile-time. e8m0 scales
are decoded once per K block into shared memory. With e4m3 weights float32 scales are read where
they are used (staging them by a plain copy gave wrong results on the H200: TileLang turned it into
an asynchronous one); with e2m1 weights the activation scales are staged by the same loop that
decodes e8m0 ones, and reading them in place gave wrong results there (seen 2026-11-30; neither
cause investigated further).
"""

from dsv41_convert.kernels.bits import e2m1_e4m3_byte, e8m0_to_f32
from dsv41_convert.kernels.tl import BF16, E4M3, F32, PASS_CONFIGS, U8, T, tilelang

BLOCK_M, BLOCK_N, THREADS = 64, 128, 128


@tilelang.jit(pass_configs=PASS_CONFIGS)
def block_gemm_kernel(
    n: int,
    k: int,
    k_block: int,
    a_block: int,
    b_rows: int,
    fp4: bool,
    a_e8m0: bool,
    b_e8m0: bool,
    stages: int,
    tile: tuple[int, int, int] = (BLOCK_M, BLOCK_N, THREADS),
):
    """[M, k] e4m3 x [n, k] e4m3 (or [n, k/2] packed e2m1 when fp4) -> [M, n] bf16.

    a_s: [M, k/a_block] (e8m0 bytes or float32); b_s: [ceil(n/b_rows), k/k_block] (likewise).
    tile: (rows, columns, threads) of C per CTA; 128 threads are one warpgroup, 256 two.
    """
    bm, bn, threads = tile
    m = T.symbolic("M")
    kb = k // k_block
    per_a = a_block // k_block  # K blocks per activation scale
    nb = -(-n // b_rows)
    b_cols = k_block // 2 if fp4 else k_block  # bytes of a weight row per K block

    # activation scales go through shared memory except float32 ones with e4m3 weights, which are read
    # where used (both as in the two kernels this one replaced; measured on the H200 only that way)
    stage_a = a_e8m0 or fp4

    def a_scale(x):
        return e8m0_to_f32(x) if a_e8m0 else x

    def b_row_scale(b_s, bx, j, kk):
        # b_s_rows[:, k]: the scale of each output row (N tail: any valid row)
        return b_s[T.min((bx * bn + j) // b_rows, nb - 1), kk]

    @T.prim_func
    def block_gemm_(
        a: T.Tensor[(m, k), E4M3],
        a_s: T.Tensor[(m, k // a_block), U8 if a_e8m0 else F32],
        b: T.Tensor[(n, k // 2 if fp4 else k), U8 if fp4 else E4M3],
        b_s: T.Tensor[(nb, kb), U8 if b_e8m0 else F32],
        c: T.Tensor[(m, n), BF16],
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=threads) as (bx, by):
            a_sh = T.alloc_shared((bm, k_block), E4M3)
            bin_sh = T.alloc_shared((bn, b_cols), U8 if fp4 else E4M3)
            b8_sh = T.alloc_shared((bn, k_block), U8)
            b_sh = T.view(b8_sh, dtype=E4M3) if fp4 else bin_sh  # the tile the tensor cores read
            sa_sh = T.alloc_shared((bm,), F32)
            sb_sh = T.alloc_shared((bn,), F32)
            c_blk = T.alloc_fragment((bm, bn), F32)
            c_acc = T.alloc_fragment((bm, bn), F32)
            c_sh = T.alloc_shared((bm, bn), BF16)
            T.clear(c_acc)
            for kk in T.Pipelined(kb, num_stages=stages):
                T.copy(a[by * bm, kk * k_block], a_sh)
                T.copy(b[bx * bn, kk * b_cols], bin_sh)
                if stage_a:
                    for i in T.Parallel(bm):
                        sa_sh[i] = a_scale(a_s[by * bm + i, kk // per_a])  # a_s[:, k].float()
                if b_e8m0:
                    for j in T.Parallel(bn):
                        sb_sh[j] = e8m0_to_f32(b_row_scale(b_s, bx, j, kk))  # b_s[:, k].float()
                if fp4:
                    for j, v in T.Parallel(bn, k_block):
                        # decode_fp4_pairs(b), as e4m3 bytes (exact)
                        b8_sh[j, v] = e2m1_e4m3_byte((bin_sh[j, v // 2] >> T.uint8(4 * (v % 2))) & T.uint8(15))
                # partial = a[:, cols] @ b[:, cols].T, float32 from zero
                T.gemm(a_sh, b_sh, c_blk, transpose_B=True, clear_accum=True)
                # acc += partial * a_s[:, k] * b_s[:, k]
                for i, j in T.Parallel(bm, bn):
                    c_acc[i, j] += (
                        c_blk[i, j]
                        * (sa_sh[i] if stage_a else a_s[by * bm + i, kk // per_a])
                        * (sb_sh[j] if b_e8m0 else b_row_scale(b_s, bx, j, kk))
                    )
            T.copy(c_acc, c_sh)  # .to(bfloat16)
            T.copy(c_sh, c[by * bm, bx * bn])

    return block_gemm_
