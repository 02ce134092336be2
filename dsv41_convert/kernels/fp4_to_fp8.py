"""The lossless MXFP4 -> e4m3 cast of routed experts on CUDA, bit-exact with `quant.cast.fp4_to_fp8`.

Exactness: bit-exact (atol=0, rtol=0); -0 (code 8) is written as +0, as the reference does. The
32x32 block scale is the largest e8m0 byte of the block minus 6 (a division by 2**6 of a power of
two), never below byte 0 (2**-127), as the reference's clamp. Each value is e2m1 value *
2**(byte - block byte), that power of two built from bits exactly as the reference's float32
division of two powers of two produces it (normal, subnormal or zero), then rounded to e4m3 by the
hardware. A value that does not survive exactly, or a NaN scale (byte 255), is counted on the GPU;
the wrapper then runs the reference, which raises its FormatError naming the tensor and the block.

Layout: a CTA converts 32 rows x 32 blocks (1024 columns); a thread owns half a block row (16 values:
8 packed bytes and the row's fp4 scale) in rows t, t + 4, ..., t + 28 of the 32-row block, all loaded
before any use. Sixty-four threads side by side cover a row's 1024 columns, so every 16-byte store of
a warp lands in 512 contiguous bytes (no half-written sectors) and each row is read in 512-byte runs;
each block's max scale is combined in shared memory. The usual case (offset >= 2**-5) looks the e4m3
bytes of 4 codes up at once in an 8-byte register table that already holds the raised exponent field
(byte permutes, no shared memory); only rows with a far smaller scale take the float path.
"""

import functools

import torch
from torch import Tensor

from dsv41_convert.kernels.bits import e2m1_value
from dsv41_convert.kernels.block_gemm import launcher
from dsv41_convert.kernels.device_c import PRELUDE
from dsv41_convert.kernels.tl import E4M3, F32, I32, PASS_CONFIGS, U8, T, tilelang

THREADS = 256
BLOCK = 32  # fp8 output block, both dims; also the fp4 scale group this kernel takes
MAX_OFFSET_BITS = 6  # 6 * 2**6 = 384 <= 448


@tilelang.jit(pass_configs=PASS_CONFIGS)
def fp4_to_fp8_kernel(in_features: int, block_rows: int = 1, row_threads: int = 64):
    """[O, in_features/2] packed e2m1 + [O, in_features/32] e8m0 -> [O, in_features] e4m3 bytes + 32x32 e8m0.

    block_rows: 32-row blocks per CTA; row_threads: threads side by side along a row (16, 32 or 64: 256,
    512 or 1024 columns per CTA). The defaults were the fastest on an H200 (docs/BENCHMARKS.md).
    """
    o = T.dynamic("O")
    i_dim = in_features
    ib = i_dim // BLOCK
    half = BLOCK // 2  # columns per thread: half a block row (8 packed bytes in, 16 e4m3 bytes out)
    tpr = row_threads
    assert tpr in (16, 32, 64)
    bpc = tpr // 2  # block columns per CTA
    rows_per_pass = THREADS // tpr  # each thread takes rows t, t + rows_per_pass, ... of a 32-row block
    rpt = BLOCK // rows_per_pass
    warps = THREADS // 32
    rb = block_rows  # 32-row blocks per CTA: more loads in flight per thread

    @T.prim_func
    def fp4_to_fp8_(
        packed: T.Tensor[(o, i_dim // 2), U8],
        s: T.Tensor[(o, ib), U8],
        w8: T.Tensor[(o, i_dim), U8],
        s8: T.Tensor[(T.ceildiv(o, BLOCK), ib), U8],
        lossy_count: T.Tensor[(1,), I32],
    ):
        with T.Kernel(T.ceildiv(ib, bpc), T.ceildiv(o, BLOCK * rb), threads=THREADS, prelude=PRELUDE) as (bx, by):
            tx = T.get_thread_binding()
            pl = T.alloc_local((rb, rpt, half // 2), U8)
            ob = T.alloc_local((half,), U8)
            e = T.alloc_local((rb, rpt), I32)
            emax = T.alloc_local((rb,), I32)
            bad = T.alloc_local((1,), I32)
            part = T.alloc_shared((rb, warps, 16), I32)
            j = tx % tpr
            bcol = bx * bpc + j // 2  # this thread's block column
            col = bcol * BLOCK + (j % 2) * half  # ... and its first column
            bad[0] = 0
            for k in T.unroll(rb):
                for i in T.unroll(rpt):
                    row = (by * rb + k) * BLOCK + tx // tpr + i * rows_per_pass
                    e[k, i] = 0  # padding rows: byte 0 never wins over a real scale
                    if row < o and bcol < ib:
                        for v in T.vectorized(half // 2):
                            pl[k, i, v] = packed[row, col // 2 + v]
                        e[k, i] = T.Cast(I32, s[row, bcol])
                    if e[k, i] == 255:
                        bad[0] = 1  # NaN scale: the reference raises
            for k in T.unroll(rb):
                # block max of the fp4 scales (as bytes): this thread's rows, the warp's other row, the warps
                emax[k] = e[k, 0]
                for i in T.unroll(rpt - 1):
                    emax[k] = T.max(emax[k], e[k, i + 1])
                if tpr < 32:
                    emax[k] = T.max(emax[k], T.shfl_xor(emax[k], tpr))  # the warp's other row
                if tx % 32 < tpr and j % 2 == 0:
                    part[k, tx // 32, (tx % 32) // 2] = emax[k]
            T.sync_threads()
            for k in T.unroll(rb):
                for w in T.unroll(warps):
                    if tpr <= 32:
                        emax[k] = T.max(emax[k], part[k, w, j // 2])
                    elif w % (tpr // 32) == (tx // 32) % (tpr // 32):  # the warps that hold this block column
                        emax[k] = T.max(emax[k], part[k, w, (j % 32) // 2])
                emax[k] = T.max(emax[k] - MAX_OFFSET_BITS, 0)  # s8 = amax / 2**6, clamp_min(2**-127)
                if tx < tpr and j % 2 == 0 and bcol < ib and (by * rb + k) * BLOCK < o:
                    s8[by * rb + k, bcol] = T.Cast(U8, emax[k])
            for k in T.unroll(rb):
                for i in T.unroll(rpt):
                    row = (by * rb + k) * BLOCK + tx // tpr + i * rows_per_pass
                    if row < o and bcol < ib:
                        d = e[k, i] - emax[k]  # offset = s / s8 = 2**d, d <= 6
                        if d >= -5:
                            # every nonzero e2m1 value times 2**d is a normal e4m3: its byte with the exponent
                            # field raised by d, looked up 4 at a time by byte permutes (`device_c.tl_fp4_to_e4m3`)
                            T.evaluate(
                                T.call_extern(
                                    "handle",
                                    "tl_fp4_to_e4m3",
                                    T.address_of(pl[k, i, 0]),
                                    half // 8,
                                    d,
                                    T.address_of(ob[0]),
                                )
                            )
                        else:
                            # far below the block max: the general float path, which may round or flush (lossy)
                            offset = T.reinterpret(
                                T.if_then_else(
                                    d >= -126,
                                    (d + 127) << 23,
                                    T.if_then_else(d >= -149, T.shift_left(T.int32(1), d + 149), T.int32(0)),
                                ),
                                F32,
                            )
                            for v in T.unroll(half):
                                code = (pl[k, i, v // 2] >> T.uint8(4 * (v % 2))) & T.uint8(15)
                                y = e2m1_value(code & T.uint8(7)) * offset  # |v| * offset (-0 written as +0)
                                q = T.Cast(E4M3, y)
                                if code & T.uint8(7) != T.uint8(0):
                                    if y == T.float32(0) or T.Cast(F32, q) != y:
                                        bad[0] = 1
                                ob[v] = T.reinterpret(q, U8) | T.if_then_else(
                                    (code & T.uint8(8)) != T.uint8(0) and y != T.float32(0), T.uint8(0x80), T.uint8(0)
                                )
                        for v in T.vectorized(half):
                            w8[row, col + v] = ob[v]  # 16 bytes; a row's 16 threads write 256 contiguous bytes
            if bad[0] != 0:
                T.atomic_add(lossy_count[0], 1)

    return fp4_to_fp8_


def fp4_to_fp8(packed: Tensor, s: Tensor, block: int = 32, name: str = "<tensor>") -> tuple[Tensor, Tensor]:
    """Re-express an MXFP4 weight as e4m3 with 32x32 e8m0 scales; same result as quant.cast.fp4_to_fp8.

    packed: [out, in/2]                     float4_e2m1fn_x2 / int8 / uint8 (logical [out, in]), CUDA
    s: [out, in/32]                         float8_e8m0fnu, CUDA (block 32; in % 32 == 0)
    -> w8: [out, in]                        float8_e4m3fn
       s8: [ceil(out/32), in/32]            float8_e8m0fnu
    Raises FormatError (from the reference) naming `name` when the cast would be lossy or a scale is NaN.
    """
    from dsv41_convert.quant.cast import fp4_to_fp8 as reference

    if packed.dtype not in (torch.float4_e2m1fn_x2, torch.int8, torch.uint8) or s.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"{name}: fp4_to_fp8 got {packed.dtype} {list(packed.shape)} and {s.dtype} {list(s.shape)}")
    if packed.dim() != 2 or block != BLOCK or (2 * packed.size(1)) % BLOCK or not packed.is_cuda:
        raise ValueError(
            f"{name}: fp4_to_fp8 kernel takes 2-d CUDA [out, in/2] with in % 32 == 0 and block 32, "
            f"got {list(packed.shape)}, block {block}"
        )
    out, inp = packed.size(0), 2 * packed.size(1)
    if tuple(s.shape) != (out, inp // BLOCK):
        raise ValueError(
            f"{name}: scale {list(s.shape)} does not fit weight {list(packed.shape)}: want {[out, inp // 32]}"
        )
    w8, s8, lossy = cast_unchecked(packed, s)
    if int(lossy.item()):
        reference(packed.cpu(), s.cpu(), block, name)  # raises FormatError with the reference's message
        raise AssertionError(f"{name}: fp4_to_fp8 kernel flagged a block the reference accepts")
    return w8, s8


def cast_unchecked(packed: Tensor, s: Tensor, lossy: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel alone, without waiting for it: operands as fp4_to_fp8 takes them (checked there).

    -> w8 [out, in] float8_e4m3fn, s8 [ceil(out/32), in/32] float8_e8m0fnu, and lossy [1] int32 on the
    GPU (a new zero, or the one given, added to): the number of CTAs that met a value which did not
    survive exactly or a NaN scale (w8 is then not the weight; 0 means it is, bit for bit).
    """
    out, inp = packed.size(0), 2 * packed.size(1)
    w8 = torch.empty(out, inp, dtype=torch.float8_e4m3fn, device=packed.device)
    s8 = torch.empty(-(-out // BLOCK), inp // BLOCK, dtype=torch.uint8, device=packed.device)
    if lossy is None:
        lossy = torch.zeros(1, dtype=torch.int32, device=packed.device)
    if out and inp:
        p2 = packed.contiguous().view(torch.uint8)
        cast_into(p2, s.contiguous().view(torch.uint8), w8.view(torch.uint8), s8, lossy)
    return w8, s8.view(torch.float8_e8m0fnu), lossy


def cast_into(packed: Tensor, s: Tensor, w8: Tensor, s8: Tensor, lossy: Tensor) -> None:
    """The kernel into tensors the caller keeps (fp4_gemm's workspace): nothing checked, allocated or
    waited for. All uint8, contiguous, non-empty, on one GPU, shaped as cast_unchecked's operands and
    results: packed [out, in/2], s [out, in/32] -> w8 [out, in], s8 [ceil(out/32), in/32]; lossy [1] int32
    is added to."""
    _launch(w8.size(1))(packed, s, w8, s8, lossy)


@functools.cache
def _launch(in_features: int):
    """The kernel's raw launch (`block_gemm.launcher`, 6.1 us of host time on an H200 host): fp4_gemm casts
    on every call, and the kernel itself takes 12.6 us at [4096, 7168], so host time per call counts."""
    return launcher(fp4_to_fp8_kernel(in_features))


def warm_up(in_features: int) -> None:
    """Compile the kernel (and make its raw launch) for expert weights with `in_features` (logical) columns."""
    _launch(in_features)
