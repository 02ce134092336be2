"""The block-scaled gemm on CUDA behind fp8_gemm and fp4_gemm: C = A @ B^T, one K block at a time.

Numerics (as `kernels.ref.fp8_gemm` / `fp4_gemm`): K is walked in blocks of `k_block` (the weight's
scale group); each block is one matmul of exact e4m3 values on the fp8 tensor cores, accumulated in
float32 from zero, then scaled by the activation scale (per row and `a_block` columns) and the weight
scale (per `b_rows` rows) and added to a float32 accumulator in K order; the result is rounded once
to bf16. An e2m1 weight is widened to e4m3 bytes in shared memory first (every e2m1 value is exact in
e4m3, `e2m1_e4m3_byte`).

Bound against the reference (stated, and checked by tests/gpu/test_gemm_kernels.py):
  |C - C_ref| <= 2**-7 * |C_ref| + 2**-12 * (|A| @ |B|^T, scaled)
The first term is one bf16 ulp (the two sides may round a near-tie differently). The second covers
the order of the sum inside one K block: Hopper's fp8 tensor cores add the exact products with a
reduced-precision (about 14-bit) internal accumulator before the float32 add, so a block partial may
differ from the reference's float32 sum by a small multiple of 2**-14 of the block's absolute sum.
With e8m0 scales all other steps are exact powers of two or identical float32 adds.

Every step but one is the reference's: with float32 scales the partial times a_s times b_s
is one rounding fewer (partial * (a_s * b_s) in one fused multiply-add), inside the same bound; with
e8m0 scales a_s * b_s is exact (while it stays a normal float32), so the bytes are the reference
order's.

Layout: one CTA computes a bm x bn tile of C with wgmma (A and B tiles brought into shared memory by
the tensor memory accelerator, software-pipelined over K blocks by a producer warpgroup); M is
symbolic, N and K compile-time. The CTA's scales for the whole K range are read into shared memory
once, before the K loop, and decoded where used (e8m0 by integer ops, no branch on loaded data: a
branch there made each thread wait for every scale load). Where they do not fit (HOIST_BYTES) they
are read from global memory where used. (The kernel this replaced staged each K block's scales in
shared memory ring slots that the producer could overwrite while the consumers still read them, a
race seen as different bytes from run to run; it is gone with the staging.)

Tiles (`pick_tile`): WIDE_TILE, 128 x 128 on two consumer warpgroups, when its CTAs fill every SM at
least once; NARROW_TILE, 64 x 64, for few rows (more CTAs). Each wrapper compiles both on first use.
"""

import functools

import torch

from dsv41_convert.kernels.fp8_dequant import e8m0_to_f32_select as e8m0_to_f32
from dsv41_convert.kernels.tl import BF16, E4M3, F32, PASS_CONFIGS, U8, T, tilelang

BLOCK_M, BLOCK_N, THREADS = 64, 128, 128  # block_gemm_kernel's default tile: rows, columns, threads
WIDE_TILE = (128, 128, 256)  # two consumer warpgroups: the most TFLOP/s with many rows
NARROW_TILE = (64, 64, 128)  # four times the CTAs of WIDE_TILE: the most TFLOP/s with few rows
TILES = (NARROW_TILE, WIDE_TILE)
HOIST_BYTES = 160 * 1024  # shared memory for the hoisted scales, at most (the pipeline needs < 64 KiB)


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_tile(m: int, n: int, device: torch.device) -> tuple[int, int, int]:
    """WIDE_TILE when its CTAs cover every SM at least once for an [m, n] output, else NARROW_TILE."""
    ctas = -(-m // WIDE_TILE[0]) * -(-n // WIDE_TILE[1])
    return WIDE_TILE if ctas >= _sm_count(device.index if device.index is not None else 0) else NARROW_TILE


def e2m1_e4m3_byte(code):
    """The e4m3 byte of a 4-bit e2m1 code, by integer arithmetic without branches.

    The same bytes as `bits.e2m1_e4m3_byte`: magnitude m = 0 -> 0x00, 1 -> 0x30 (0.5), and m >= 2 ->
    0x38 + 4 * (m - 2) (exponent and top mantissa bit one step apart); the sign moves from bit 3 to 7.
    """
    c = T.Cast(U8, code)
    m = c & T.uint8(7)
    ge2 = T.Cast(U8, m >= T.uint8(2))
    mag = T.Cast(U8, m != T.uint8(0)) * (T.uint8(0x2C) + m * T.uint8(4) + ge2 * T.uint8(4))
    return mag | ((c & T.uint8(8)) << T.uint8(4))


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
    hoist: bool = True,
):
    """[M, k] e4m3 x [n, k] e4m3 (or [n, k/2] packed e2m1 when fp4) -> [M, n] bf16.

    a_s: [M, k/a_block] (e8m0 bytes or float32); b_s: [ceil(n/b_rows), k/k_block] (likewise).
    tile: (rows, columns, threads) of C per CTA; 128 threads are one warpgroup, 256 two.
    hoist: read the CTA's scales for the whole K range into shared memory once, before the K loop
    (when they fit in HOIST_BYTES); False reads them from global memory where used.
    """
    bm, bn, threads = tile
    m = T.symbolic("M")
    kb = k // k_block
    per_a = a_block // k_block  # K blocks per activation scale
    nb = -(-n // b_rows)
    b_cols = k_block // 2 if fp4 else k_block  # bytes of a weight row per K block

    ka = k // a_block  # activation scale columns
    sb_rows = max(bn // b_rows, 1)  # weight scale rows one CTA's columns use
    a_bytes, b_bytes = (1 if a_e8m0 else 4), (1 if b_e8m0 else 4)
    hoist = hoist and (bn % b_rows == 0 or b_rows % bn == 0)
    hoist = hoist and bm * ka * a_bytes + sb_rows * kb * b_bytes <= HOIST_BYTES

    def a_scale(x):
        return e8m0_to_f32(x) if a_e8m0 else x

    def b_scale(x):
        return e8m0_to_f32(x) if b_e8m0 else x

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
            c_blk = T.alloc_fragment((bm, bn), F32)
            c_acc = T.alloc_fragment((bm, bn), F32)
            c_sh = T.alloc_shared((bm, bn), BF16)
            if hoist:
                # every scale this CTA uses, read once (raw: e8m0 bytes are decoded where used)
                sa_all = T.alloc_shared((bm, ka), U8 if a_e8m0 else F32)
                sb_all = T.alloc_shared((sb_rows, kb), U8 if b_e8m0 else F32)
                for i, t in T.Parallel(bm, ka):
                    sa_all[i, t] = a_s[T.min(by * bm + i, m - 1), t]  # M tail: any valid row
                for r, t in T.Parallel(sb_rows, kb):
                    sb_all[r, t] = b_s[T.min((bx * bn) // b_rows + r, nb - 1), t]
            T.clear(c_acc)
            for kk in T.Pipelined(kb, num_stages=stages):
                T.copy(a[by * bm, kk * k_block], a_sh)
                T.copy(b[bx * bn, kk * b_cols], bin_sh)
                if fp4:
                    for j, v in T.Parallel(bn, k_block):
                        # decode_fp4_pairs(b), as e4m3 bytes (exact)
                        b8_sh[j, v] = e2m1_e4m3_byte((bin_sh[j, v // 2] >> T.uint8(4 * (v % 2))) & T.uint8(15))
                # partial = a[:, cols] @ b[:, cols].T, float32 from zero
                T.gemm(a_sh, b_sh, c_blk, transpose_B=True, clear_accum=True)
                # acc += partial * a_s[:, k] * b_s[:, k], one multiply-add (a_s * b_s exact for e8m0)
                if hoist:
                    for i, j in T.Parallel(bm, bn):
                        c_acc[i, j] += c_blk[i, j] * (
                            a_scale(sa_all[i, kk // per_a]) * b_scale(sb_all[(j // b_rows) if b_rows < bn else 0, kk])
                        )
                else:
                    for i, j in T.Parallel(bm, bn):
                        c_acc[i, j] += c_blk[i, j] * (
                            a_scale(a_s[T.min(by * bm + i, m - 1), kk // per_a]) * b_scale(b_row_scale(b_s, bx, j, kk))
                        )
            T.copy(c_acc, c_sh)  # .to(bfloat16)
            T.copy(c_sh, c[by * bm, bx * bn])

    return block_gemm_
