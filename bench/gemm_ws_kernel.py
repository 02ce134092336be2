"""Prototype block GEMMs with manual warp specialisation (issue 19 goal 2); bench/gemm_ws.py measures them.

C = A @ B^T as `dsv41_convert.kernels.block_gemm` computes it (e8m0 scales per 32-wide K block, each K
block its own wgmma from zero and its own promotion acc += partial * a_s * b_s in K order, bf16 once),
so the bytes equal fp8_gemm's / fp4_gemm's; measured equal on an H200 (docs/BENCHMARKS.md, "Gemms,
2026-12-02, session 12"). Not used by the package: a prototype, N % bn == 0, K % 128 == 0 and scale rows
whose pitch (K / 32 bytes) is a multiple of 16 only (every scale is hoisted by TMA).

Structure: `producers` warpgroups load each 128-column K stage by TMA into a ring of `stages` slots
(full/empty mbarrier pairs written out with T.ws, T.tma_copy and T.barrier_*), bm / 64 consumer
warpgroups run the wgmmas and promotions. With fp4 the weight comes as packed e2m1 into a staging ring
and the producers widen it to e4m3 in the slot the tensor cores read, times 2**(s - S) (s the row's
fp4 scale, S the 32x32 block scale of the lossless cast, `fp4_to_fp8`): the cast's bytes, so the
fp8 route's GEMM without the cast's pass over the weight. The widening is the cast kernel's own
(`device_c.tl_fp4_to_e4m3`, 4 words of codes per call; -0 written as +0, as the cast).

`cross` (fp8 only) promotes each stage's last K block after the next stage's first wgmma is issued, so
no stage ends with the tensor cores idle; ptxas serializes every wgmma of that loop (C7514: a wgmma in
flight across the loop's back-edge while another accumulator is read), so it lowers but is not timed.

TileLang 0.1.15 details this needs: its thread-sync pass would put __syncthreads between the two roles
(a deadlock, or lockstep) and its shared-memory planner would overlap buffers of the two roles (it
placed the e8m0 table inside the fp4 staging ring): both are off (CONFIGS), the syncs are written out.
setmaxnreg moves registers within the CTA's pool (launch registers x threads); a request beyond the
pool waits forever (a 128 x 128 fp4 variant asking 216 + 80 of a 168 x 384 pool hung), hence `_pool`.
"""

from dsv41_convert.kernels.block_gemm import K_TILE
from dsv41_convert.kernels.device_c import PRELUDE
from dsv41_convert.kernels.fp8_dequant import e8m0_to_f32_select as e8m0_to_f32
from dsv41_convert.kernels.tl import BF16, E4M3, F32, I32, PASS_CONFIGS, U8, T, tilelang

CONFIGS = {
    **PASS_CONFIGS,
    tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
    tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True,
}
K_BLOCK = 32


def _pool(threads: int, producers: int, consumers: int, nreg: tuple[int, int]) -> None:
    """Raise where setmaxnreg would ask more registers than the CTA holds (ptxas launches with at most
    65536 / threads, a multiple of 8, at most 248)."""
    launch = min(65536 // threads // 8 * 8, 248)
    want = 128 * (producers * nreg[0] + consumers * nreg[1])
    if want > launch * threads:
        raise ValueError(f"registers: {nreg} for {producers} + {consumers} warpgroups need {want} > {launch * threads}")


@tilelang.jit(pass_configs=CONFIGS)
def ws_gemm(
    n: int,
    k: int,
    fp4: bool = False,
    tile: tuple[int, int] = (128, 128),
    stages: int = 4,
    producers: int = 1,
    nreg: tuple[int, int] = (24, 240),
    cross: bool = False,
):
    """a [M, k] e4m3, a_s [M, k/32] e8m0 bytes, b [n, k] e4m3 (fp4: [n, k/2] packed e2m1 bytes), b_s
    [n/32, k/32] e8m0 bytes (fp4: the cast's block scales), b4_s [n, k/32] e8m0 bytes (fp4's row scales;
    unused for fp8) -> c [M, n] bf16.

    tile: (rows, columns) of C per CTA, rows / 64 consumer warpgroups; nreg: setmaxnreg of (producers,
    consumers).
    """
    m = T.dynamic("M")
    bm, bn = tile
    subs = K_TILE // K_BLOCK
    kb = k // K_BLOCK
    nk = kb // subs
    sb_rows = bn // 32
    consumers = bm // 64
    cthreads, pthreads = 128 * consumers, 128 * producers
    _pool(cthreads + pthreads, producers, consumers, nreg)
    regs = bm * bn // cthreads
    policy = T.GemmWarpPolicy.FullRow
    look = stages - 1  # fp4 stages loaded ahead into the staging ring
    per_thread = bn * subs // pthreads  # (row, K block) pairs a producer thread widens per stage
    assert per_thread * pthreads == bn * subs and not (cross and fp4)

    @T.macro
    def promote(c_acc, part, kk, sa_all, sb_all, lut):
        T.warpgroup_fence_operand(part, 0, regs)
        for i, j in T.Parallel(bm, bn):
            c_acc[i, j] += part[i, j] * (lut[T.Cast(I32, sa_all[i, kk])] * lut[T.Cast(I32, sb_all[j // 32, kk])])

    @T.prim_func
    def ws_gemm_(
        a: T.Tensor[(m, k), E4M3],
        a_s: T.Tensor[(m, kb), U8],
        b: T.Tensor[(n, k // 2 if fp4 else k), U8 if fp4 else E4M3],
        b_s: T.Tensor[(n // 32, kb), U8],
        b4_s: T.Tensor[(n, kb), U8],
        c: T.Tensor[(m, n), BF16],
    ):
        threads = cthreads + pthreads
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=threads, prelude=PRELUDE) as (bx, by):
            a_sh = T.alloc_shared((stages, bm, K_TILE), E4M3)
            b_sh = T.alloc_shared((stages, bn, K_TILE), E4M3)
            sa_all = T.alloc_shared((bm, kb), U8)
            sb_all = T.alloc_shared((sb_rows, kb), U8)
            lut = T.alloc_shared((256,), F32)
            c_sh = T.alloc_shared((bm, bn), BF16)
            blk = [T.alloc_fragment((bm, bn), F32) for _ in range(2)]
            c_acc = T.alloc_fragment((bm, bn), F32)
            full = T.alloc_barrier([pthreads] * stages)
            empty = T.alloc_barrier([cthreads] * stages)
            scales = T.alloc_barrier(pthreads)
            if fp4:
                b4_sh = T.alloc_shared((stages, bn, K_TILE // 2), U8)
                s4_all = T.alloc_shared((bn, kb), U8)
                raw = T.alloc_barrier([pthreads] * stages)
                out_bytes = T.alloc_local((32,), E4M3)

            with T.ws(*range(consumers, consumers + producers)):
                T.dec_max_nreg(nreg[0])
                T.tma_copy(a_s[by * bm : (by + 1) * bm, 0:kb], sa_all, barrier=scales)
                T.tma_copy(b_s[bx * sb_rows : (bx + 1) * sb_rows, 0:kb], sb_all, barrier=scales)
                if fp4:
                    T.tma_copy(b4_s[bx * bn : (bx + 1) * bn, 0:kb], s4_all, barrier=scales)
                T.barrier_arrive(scales)
                if fp4:
                    for p in T.serial(look):
                        T.tma_copy(b[bx * bn : (bx + 1) * bn, p * 64 : (p + 1) * 64], b4_sh[p, :, :], barrier=raw[p])
                        T.barrier_arrive(raw[p])
                    T.barrier_wait(scales, 0)
                for ko in T.serial(nk):
                    st = ko % stages
                    T.barrier_wait(empty[st], ((ko // stages) % 2) ^ 1)
                    rows_a = a[by * bm : (by + 1) * bm, ko * K_TILE : (ko + 1) * K_TILE]
                    T.tma_copy(rows_a, a_sh[st, :, :], barrier=full[st])
                    if fp4:
                        T.barrier_wait(raw[st], (ko // stages) % 2)
                        tx = T.get_thread_binding() - cthreads
                        for q in T.unroll(per_thread):
                            j = (tx + q * pthreads) % bn
                            blk_k = (tx + q * pthreads) // bn
                            kk = ko * subs + blk_k
                            d = T.Cast(I32, s4_all[j, kk]) - T.Cast(I32, sb_all[j // 32, kk])
                            # the cast's widening (device_c.tl_fp4_to_e4m3): 4 words of codes times 2**d
                            T.evaluate(
                                T.call_extern(
                                    "handle",
                                    "tl_fp4_to_e4m3",
                                    T.address_of(b4_sh[st, j, blk_k * 16]),
                                    4,
                                    d,
                                    T.address_of(out_bytes[0]),
                                )
                            )
                            for h in T.unroll(2):
                                for e in T.vectorized(16):
                                    b_sh[st, j, blk_k * 32 + h * 16 + e] = out_bytes[h * 16 + e]
                        T.fence_proxy_async()
                        T.sync_threads(2, pthreads)  # every producer thread is done with the slot refilled next
                        if ko + look < nk:
                            ahead = (ko + look) % stages
                            cols = b[bx * bn : (bx + 1) * bn, (ko + look) * 64 : (ko + look + 1) * 64]
                            T.tma_copy(cols, b4_sh[ahead, :, :], barrier=raw[ahead])
                            T.barrier_arrive(raw[ahead])
                    else:
                        rows_b = b[bx * bn : (bx + 1) * bn, ko * K_TILE : (ko + 1) * K_TILE]
                        T.tma_copy(rows_b, b_sh[st, :, :], barrier=full[st])
                    T.barrier_arrive(full[st])

            with T.ws(*range(consumers)):
                T.inc_max_nreg(nreg[1])
                for x in T.Parallel(256):
                    lut[x] = e8m0_to_f32(x)
                T.clear(c_acc)
                T.sync_threads(1, cthreads)
                T.barrier_wait(scales, 0)
                for ko in T.serial(nk):
                    st = ko % stages
                    T.barrier_wait(full[st], (ko // stages) % 2)
                    for s in tuple(range(subs)):
                        cols = slice(s * K_BLOCK, (s + 1) * K_BLOCK)
                        T.wgmma_gemm(
                            a_sh[st, :, cols], b_sh[st, :, cols], blk[s % 2], False, True, policy, clear_accum=True
                        )
                        if s > 0:
                            T.wait_wgmma(1)
                            promote(c_acc, blk[(s - 1) % 2], ko * subs + s - 1, sa_all, sb_all, lut)
                        elif cross:
                            T.wait_wgmma(1)
                            if ko > 0:  # the previous stage's last block, then its slot
                                promote(c_acc, blk[1], ko * subs - 1, sa_all, sb_all, lut)
                                T.barrier_arrive(empty[(ko + stages - 1) % stages])
                    if not cross:
                        T.wait_wgmma(0)
                        T.barrier_arrive(empty[st])
                        promote(c_acc, blk[(subs - 1) % 2], ko * subs + subs - 1, sa_all, sb_all, lut)
                if cross:
                    T.wait_wgmma(0)
                    promote(c_acc, blk[(subs - 1) % 2], kb - 1, sa_all, sb_all, lut)
                T.copy(c_acc, c_sh)
                T.fence_proxy_async()
                T.sync_threads(1, cthreads)
                T.copy(c_sh, c[by * bm, bx * bn])

    return ws_gemm_
