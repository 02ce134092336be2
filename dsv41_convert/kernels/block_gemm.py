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
the tensor memory accelerator, software-pipelined by a producer warpgroup); M is symbolic, N and K
compile-time. Each pipeline stage brings `k_tile` columns of K (K_TILE = 4 scale blocks of 32): one
stage wait per four K blocks and four times the bytes per copy (one 32-wide block per stage: 12% fewer
TFLOP/s at 4096 rows on 128 x 128). Each K block is still its own matmul from zero and its own promotion
(acc += partial * scale), in K order, so the bytes do not depend on k_tile. With `pingpong` the
matmuls are asynchronous, into `depth` partial tiles used in turn: the matmuls of K blocks t+1 ..
t+depth-1 are issued before block t's partial is promoted on the CUDA cores, so the tensor cores and
the promotion overlap; a stage is released only after its last matmul has completed. Each warpgroup
takes whole rows of C (one 64 x bn wgmma per K block). Measurements, and what limits the kernel now:
docs/BENCHMARKS.md, "Gemms, 2026-12-01" and "Gemms, 2026-12-01 evening"; the same math with
manual warp specialisation (bench/gemm_ws_kernel.py) and why a stage cannot hand its last promotion to
the next: "Gemms, 2026-12-02, session 12".

The CTA's scales for the whole K range are read into shared memory once, before the K loop, and
decoded where used (e8m0 by integer ops, no branch on loaded data: a branch there made each thread
wait for every scale load). Where the layout allows (`_scale_tma`) they come by TMA: one bulk copy per
operand, issued with the first stages; the consumers wait for it at their first promotion and the
producer does not wait at all (a load loop made the whole CTA wait, the 128-row tile's main stall).
Where they do not fit beside the pipeline (SMEM_BYTES) they are read from global memory where used.
(An earlier kernel staged each K block's scales in shared memory ring slots that the producer could
overwrite while the consumers still read them, a race seen as different bytes from run to run; it is
gone with the staging.)

Tiles (`pick_tile`), measured on an H200 (docs/BENCHMARKS.md): of a wrapper's tiles the one whose
waves of CTAs end first, each wave costing bm x bn / (the tile's TFLOP/s with every SM busy). fp8: 64 x 64
on one consumer warpgroup with three matmuls in flight, 64 x 128 on one, 128 x 128 on two. fp4: 64 x 64
and 128 x 128 on two consumer warpgroups. Each wrapper compiles all of its tiles on first use.
"""

import functools
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from dsv41_convert.kernels.fp8_dequant import e8m0_to_f32_select as e8m0_to_f32
from dsv41_convert.kernels.tl import BF16, E4M3, F32, I32, PASS_CONFIGS, U8, T, tilelang

BLOCK_M, BLOCK_N, THREADS = 64, 128, 128  # block_gemm_kernel's default tile: rows, columns, threads
# (rows, columns, threads) of C per CTA -> the wave rate pick_tile weighs it by: TFLOP/s with every SM busy
# on an H200, fitted to the kernel's measured rows (fp8: "Gemms, 2026-12-02, session 13"; fp4: session 10)
FP8_TILES = {(64, 64, 128): 210, (64, 128, 128): 370, (128, 128, 256): 480}
FP4_TILES = {(64, 64, 256): 70, (128, 128, 256): 144}
SMEM_BYTES = 200 * 1024  # shared memory for the pipeline and the hoisted scales, at most (Hopper: 227 KiB a CTA)
K_TILE = 128  # K columns per pipeline stage
TMA_BOX = 256  # elements a side of one tensor-map copy, at most (Hopper)
E2M1_E4M3_TABLE = (0x3C383000, 0x4C484440)  # e4m3 bytes of the e2m1 magnitudes 0..7, little-endian


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_tile(m: int, n: int, device: torch.device, tiles: dict[tuple[int, int, int], float]) -> tuple[int, int, int]:
    """Of tiles (tile -> wave rate), the one whose CTAs end first for an [m, n] output: waves x bm x bn / rate,
    waves = CTAs / SMs rounded up; on a tie the first.

    A big tile computes more TFLOP/s with every SM busy (fp8 128 x 128: ~1.8x 64 x 64, measured), but a wave
    takes as long with SMs idle or tile rows past M, so where a big tile leaves the last wave part empty a
    smaller one with more, fuller waves ends first. The rates are fits to measured shapes, not peaks (fp8:
    0.2% below the best tile on average over 39 shapes, in the fit's run and in another; 64 x 64's rate is
    below its measured one, perhaps because its small CTAs may share an SM, which the waves ignore).
    """
    sms = _sm_count(device.index if device.index is not None else 0)

    def end(tile: tuple[int, int, int]) -> float:
        bm, bn, _ = tile
        waves = -(-(-(-m // bm) * -(-n // bn)) // sms)
        return waves * bm * bn / tiles[tile]

    return min(tiles, key=end)


def compile_tiles(build: Callable[[tuple[int, int, int]], object], tiles: Iterable[tuple[int, int, int]]) -> dict:
    """tile -> build(tile) for every tile, compiled side by side (TileLang spends most of a compile in nvcc,
    a child process, so a wrapper's tiles take about as long as its slowest one)."""
    tiles = tuple(tiles)
    with ThreadPoolExecutor(len(tiles), thread_name_prefix="compile") as pool:
        return dict(zip(tiles, pool.map(build, tiles), strict=True))


def launcher(kernel):
    """The kernel's cheapest call: TileLang's compiled executable itself where its adapter exposes one (the
    tvm_ffi backend), skipping the Python layer that stitches outputs into the argument list (this
    kernel has none); else the kernel. Takes the kernel's arguments, in order."""
    get = getattr(getattr(kernel, "adapter", None), "_get_executable", None)
    return get() if get is not None and not getattr(kernel.adapter, "result_idx", None) else kernel


def dense(t: torch.Tensor, raw: bool = False) -> torch.Tensor:
    """t as the kernel reads it: contiguous and 16-byte aligned (a tensor map's base), copied only when it
    is not; raw: its bytes as uint8 (e8m0 scales, packed e2m1)."""
    t = t.view(torch.uint8) if raw else t
    return t if t.is_contiguous() and not t.data_ptr() % 16 else t.clone(memory_format=torch.contiguous_format)


def rows(t: torch.Tensor, m: int) -> torch.Tensor:
    """t as a 2-D [m, -1] view (a no-op for a 2-D t)."""
    return t if t.dim() == 2 else t.view(m, -1)


def _scale_tma(
    n: int, k: int, bn: int, a_block: int, k_block: int, b_rows: int, a_bytes: int, b_bytes: int
) -> tuple[bool, bool]:
    """Whether the hoisted scales of A and of B can come by TMA: a tensor map needs each scale row's pitch
    to be a multiple of 16 bytes, and A's box (its CTA's rows by every K block) at most TMA_BOX scales a
    side (TileLang 0.1.15 refuses the copy of the MTP's main_proj, K = 3 x 5120: 480 scales a row); B's
    CTA rows lower to a 1-D bulk copy without bounds checks, so its column tiles must cover N exactly (A's
    2-D copy zero-fills the rows past M)."""
    a_ok = (k // a_block) * a_bytes % 16 == 0 and k // a_block <= TMA_BOX
    b_ok = (k // k_block) * b_bytes % 16 == 0 and n % bn == 0 and (bn % b_rows == 0 or b_rows % bn == 0)
    return a_ok, b_ok


def e2m1_e4m3_byte(code):
    """The e4m3 byte of a 4-bit e2m1 code: one byte-permute lookup and the sign, without branches.

    The same bytes as `bits.e2m1_e4m3_byte`: magnitude m = 0..7 selects byte m of E2M1_E4M3_TABLE (two
    words: 0x00, 0x30 (0.5), 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C (6)); the sign moves from bit 3 to 7.
    """
    c = T.Cast(U8, code)
    lo, hi = E2M1_E4M3_TABLE
    mag = T.call_pure_extern("uint32", "__byte_perm", T.uint32(lo), T.uint32(hi), T.Cast("uint32", c & T.uint8(7)))
    return T.Cast(U8, mag) | ((c & T.uint8(8)) << T.uint8(4))


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
    k_tile: int = K_TILE,
    pingpong: bool = True,
    depth: int = 2,
    scale_tma: bool = True,
    scale_lut: bool = True,
):
    """[M, k] e4m3 x [n, k] e4m3 (or [n, k/2] packed e2m1 when fp4) -> [M, n] bf16.

    a_s: [M, k/a_block] (e8m0 bytes or float32); b_s: [ceil(n/b_rows), k/k_block] (likewise).
    tile: (rows, columns, threads) of C per CTA; 128 threads are one warpgroup, 256 two.
    hoist: read the CTA's scales for the whole K range into shared memory once, before the K loop
    (when they fit next to the pipeline); False reads them from global memory where used.
    k_tile: K columns per pipeline stage (a multiple of k_block dividing k, else k_block): one copy
    per operand brings k_tile / k_block scale blocks, each still its own matmul and promotion.
    pingpong: asynchronous matmuls into `depth` partial tiles (2: the matmul of one K block runs while the
    previous one is promoted; more: up to depth - 1 matmuls queued behind the one being promoted).
    scale_tma: hoist the scales with the tensor memory accelerator (one bulk copy per operand, issued
    before the K loop, waited for at first use), where the layouts allow it (`_scale_tma`).
    scale_lut: decode e8m0 scales by a 256-entry float32 table in shared memory (one load per scale in
    place of five integer ops; the same values).
    """
    bm, bn, threads = tile
    m = T.dynamic("M")
    kb = k // k_block
    kt = k_tile if k_tile % k_block == 0 and k % k_tile == 0 else k_block
    subs = kt // k_block  # K blocks per stage
    per_a = a_block // k_block  # K blocks per activation scale
    nb = -(-n // b_rows)
    b_cols = kt // 2 if fp4 else kt  # bytes of a weight row per stage

    ka = k // a_block  # activation scale columns
    regs = bm * bn // threads  # float32 registers of one partial tile per thread
    # each warpgroup takes whole rows of C where it can (one 64 x bn wgmma per K block); the default
    # square split gave each of two warpgroups 128 x bn/2 (two wgmmas, each re-reading the B tile)
    policy = T.GemmWarpPolicy.FullRow if bm >= 64 * (threads // 128) else T.GemmWarpPolicy.Square
    sb_rows = max(bn // b_rows, 1)  # weight scale rows one CTA's columns use
    a_bytes, b_bytes = (1 if a_e8m0 else 4), (1 if b_e8m0 else 4)
    pipe = stages * (bm * kt + bn * b_cols) + (bn * kt if fp4 else 0)
    hoist = hoist and (bn % b_rows == 0 or b_rows % bn == 0)
    hoist = hoist and bm * ka * a_bytes + sb_rows * kb * b_bytes <= SMEM_BYTES - pipe
    tma_a, tma_b = (
        scale_tma and hoist and ok for ok in _scale_tma(n, k, bn, a_block, k_block, b_rows, a_bytes, b_bytes)
    )
    depth = max(min(depth, subs), 2) if pingpong else 1

    def decode(x, lut):
        return e8m0_to_f32(x) if lut is None else lut[T.Cast(I32, x)]

    def a_scale(x, lut):
        return decode(x, lut) if a_e8m0 else x

    def b_scale(x, lut):
        return decode(x, lut) if b_e8m0 else x

    def b_row_scale(b_s, bx, j, kk):
        # b_s_rows[:, k]: the scale of each output row (N tail: any valid row)
        return b_s[T.min((bx * bn + j) // b_rows, nb - 1), kk]

    @T.macro
    def promote(c_acc, part, kk, sa_s, sb_s, bx, by, lut):
        # acc += partial * a_s[:, k] * b_s[:, k], one multiply-add (a_s * b_s exact for e8m0); sa_s, sb_s:
        # the hoisted scales, or a_s, b_s themselves
        if hoist:
            for i, j in T.Parallel(bm, bn):
                c_acc[i, j] += part[i, j] * (
                    a_scale(sa_s[i, kk // per_a], lut) * b_scale(sb_s[(j // b_rows) if b_rows < bn else 0, kk], lut)
                )
        else:
            for i, j in T.Parallel(bm, bn):
                c_acc[i, j] += part[i, j] * (
                    a_scale(sa_s[T.min(by * bm + i, m - 1), kk // per_a], lut)
                    * b_scale(b_row_scale(sb_s, bx, j, kk), lut)
                )

    @T.prim_func
    def block_gemm_(
        a: T.Tensor[(m, k), E4M3],
        a_s: T.Tensor[(m, k // a_block), U8 if a_e8m0 else F32],
        b: T.Tensor[(n, k // 2 if fp4 else k), U8 if fp4 else E4M3],
        b_s: T.Tensor[(nb, kb), U8 if b_e8m0 else F32],
        c: T.Tensor[(m, n), BF16],
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(m, bm), threads=threads) as (bx, by):
            a_sh = T.alloc_shared((bm, kt), E4M3)
            bin_sh = T.alloc_shared((bn, b_cols), U8 if fp4 else E4M3)
            b8_sh = T.alloc_shared((bn, kt), U8)
            b_sh = T.view(b8_sh, dtype=E4M3) if fp4 else bin_sh  # the tile the tensor cores read
            blk = [T.alloc_fragment((bm, bn), F32) for _ in range(depth)]
            c_acc = T.alloc_fragment((bm, bn), F32)
            c_sh = T.alloc_shared((bm, bn), BF16)
            touch = T.alloc_local((2,), E4M3)
            lut = None
            if scale_lut and (a_e8m0 or b_e8m0):
                lut = T.alloc_shared((256,), F32)  # e8m0 byte -> its float32 value
                for x in T.Parallel(256):
                    lut[x] = e8m0_to_f32(x)
            if hoist:
                # every scale this CTA uses, read once (raw: e8m0 bytes are decoded where used)
                sa_all = T.alloc_shared((bm, ka), U8 if a_e8m0 else F32)
                sb_all = T.alloc_shared((sb_rows, kb), U8 if b_e8m0 else F32)
                if tma_a:
                    T.copy(a_s[by * bm, 0], sa_all)  # rows past M read as zeros (never stored)
                else:
                    for i, t in T.Parallel(bm, ka):
                        sa_all[i, t] = a_s[T.min(by * bm + i, m - 1), t]  # M tail: any valid row
                if tma_b:
                    T.copy(b_s[(bx * bn) // b_rows, 0], sb_all)
                else:
                    for r, t in T.Parallel(sb_rows, kb):
                        sb_all[r, t] = b_s[T.min((bx * bn) // b_rows + r, nb - 1), t]
                sa_s, sb_s = sa_all, sb_all
            else:
                sa_s, sb_s = a_s, b_s

            T.clear(c_acc)
            for kt_i in T.Pipelined(kb // subs, num_stages=stages):
                T.copy(a[by * bm, kt_i * kt], a_sh)
                T.copy(b[bx * bn, kt_i * b_cols], bin_sh)
                if fp4:
                    for j, v in T.Parallel(bn, kt):
                        # decode_fp4_pairs(b), as e4m3 bytes (exact)
                        b8_sh[j, v] = e2m1_e4m3_byte((bin_sh[j, v // 2] >> T.uint8(4 * (v % 2))) & T.uint8(15))
                for s in tuple(range(subs)):
                    cols = slice(s * k_block, (s + 1) * k_block)
                    # partial = a[:, cols] @ b[:, cols].T, float32 from zero
                    if pingpong:
                        T.wgmma_gemm(
                            a_sh[:, cols], b_sh[:, cols], blk[s % depth], False, True, policy, clear_accum=True
                        )
                        if s >= depth - 1:
                            done = s - depth + 1  # the oldest matmul in flight
                            T.wait_wgmma(depth - 1)
                            T.warpgroup_fence_operand(blk[done % depth], 0, regs)  # read it only from here on
                            promote(c_acc, blk[done % depth], kt_i * subs + done, sa_s, sb_s, bx, by, lut)
                    else:
                        T.gemm(a_sh[:, cols], b_sh[:, cols], blk[0], False, True, policy, clear_accum=True)
                        promote(c_acc, blk[0], kt_i * subs + s, sa_s, sb_s, bx, by, lut)
                if pingpong:
                    T.wait_wgmma(0)
                    left = tuple(range(subs - depth + 1, subs))  # K blocks of the stage not yet promoted
                    for done in left:
                        T.warpgroup_fence_operand(blk[done % depth], 0, regs)
                    # the stage is released after the last statement that touches its tiles: touch them
                    # here, after the matmuls that read them are complete
                    touch[0] = a_sh[0, 0]
                    if not fp4:
                        touch[1] = bin_sh[0, 0]
                    for done in left:
                        promote(c_acc, blk[done % depth], kt_i * subs + done, sa_s, sb_s, bx, by, lut)
            T.copy(c_acc, c_sh)  # .to(bfloat16)
            T.copy(c_sh, c[by * bm, bx * bn])

    return block_gemm_
