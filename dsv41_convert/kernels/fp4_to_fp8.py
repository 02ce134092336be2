"""The lossless MXFP4 -> e4m3 cast of routed experts on CUDA, bit-exact with `quant.cast.fp4_to_fp8`.

Exactness: bit-exact (atol=0, rtol=0); -0 (code 8) is written as +0, as the reference does. The
32x32 block scale is the largest e8m0 byte of the block minus 6 (a division by 2**6 of a power of
two), never below byte 0 (2**-127), as the reference's clamp. Each value is e2m1 value *
2**(byte - block byte), that power of two built from bits exactly as the reference's float32
division of two powers of two produces it (normal, subnormal or zero), then rounded to e4m3 by the
hardware. A value that does not survive exactly, or a NaN scale (byte 255), is counted on the GPU;
the wrapper then runs the reference, which raises its FormatError naming the tensor and the block.

Layout: a CTA converts 2 x 32 rows x 8 blocks; each thread owns the 32 values of one block row in
each of its two block rows (16 packed bytes and one fp4 scale each, loaded before any use), eight
threads side by side cover 256 columns of a row (coalesced), and each block's max scale is combined by
xor-shuffles and shared memory. The usual case (offset >= 2**-5) looks each code's e4m3 byte up in a
16-entry table and shifts its exponent field; only rows with a far smaller scale take the float path.
"""

import tilelang
import tilelang.language as T
import torch
from torch import Tensor

from dsv41_convert.kernels.bits import e2m1_value

# dtype aliases
F32 = "float32"
E4M3 = "float8_e4m3fn"
U8 = "uint8"
I32 = "int32"

# pass configs: exact float ops
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}

THREADS = 256
BLOCK = 32  # fp8 output block, both dims; also the fp4 scale group this kernel takes
MAX_OFFSET_BITS = 6  # 6 * 2**6 = 384 <= 448


@tilelang.jit(pass_configs=PASS_CONFIGS)
def fp4_to_fp8_kernel(in_features: int, block_rows: int = 2):
    """[O, in_features/2] packed e2m1 + [O, in_features/32] e8m0 -> [O, in_features] e4m3 bytes + 32x32 e8m0."""
    o = T.symbolic("O")
    i_dim = in_features
    ib = i_dim // BLOCK
    per_row = THREADS // BLOCK  # block columns per CTA: threads side by side along a row
    warps = THREADS // 32
    rows_per_warp = 32 // per_row
    rb = block_rows  # 32-row blocks per CTA: more loads in flight per thread

    @T.prim_func
    def fp4_to_fp8_(
        packed: T.Tensor[(o, i_dim // 2), U8],
        s: T.Tensor[(o, ib), U8],
        w8: T.Tensor[(o, i_dim), U8],
        s8: T.Tensor[(T.ceildiv(o, BLOCK), ib), U8],
        lossy_count: T.Tensor[(1,), I32],
    ):
        with T.Kernel(T.ceildiv(ib, per_row), T.ceildiv(o, BLOCK * rb), threads=THREADS) as (bx, by):
            tx = T.get_thread_binding()
            pl = T.alloc_local((rb, BLOCK // 2), U8)
            ob = T.alloc_local((BLOCK,), U8)
            e = T.alloc_local((rb,), I32)
            emax = T.alloc_local((rb,), I32)
            bad = T.alloc_local((1,), I32)
            part = T.alloc_shared((rb, warps, per_row), I32)
            lut = T.alloc_shared((16,), U8)
            j = tx % per_row
            bcol = bx * per_row + j
            bad[0] = 0
            if tx < 16:
                # e4m3 byte of each e2m1 code, code 8 (-0) as +0 (as the reference)
                m = tx & 7  # int32 arithmetic: see bits.e2m1_e4m3_byte
                mag = T.if_then_else(m < 2, m * 0x30, (((m >> 1) + 6) << 3) | ((m & 1) << 2))
                lut[tx] = T.Cast(U8, T.if_then_else(tx == 8, 0, mag | ((tx & 8) << 4)))
            for k in T.unroll(rb):
                row = (by * rb + k) * BLOCK + tx // per_row  # thread owns 32 values of one row of one block
                e[k] = 0  # padding rows: byte 0 never wins over a real scale
                if row < o and bcol < ib:
                    for v in T.vectorized(BLOCK // 2):
                        pl[k, v] = packed[row, bcol * (BLOCK // 2) + v]
                    e[k] = T.Cast(I32, s[row, bcol])
                if e[k] == 255:
                    bad[0] = 1  # NaN scale: the reference raises
            for k in T.unroll(rb):
                # block max of the fp4 scales (as bytes): over the warp's rows, then over the warps
                emax[k] = e[k]
                for d in T.unroll(rows_per_warp.bit_length() - 1):
                    emax[k] = T.max(emax[k], T.shfl_xor(emax[k], per_row << d))
                if tx % 32 < per_row:
                    part[k, tx // 32, j] = emax[k]
            T.sync_threads()
            for k in T.unroll(rb):
                for w in T.unroll(warps):
                    emax[k] = T.max(emax[k], part[k, w, j])
                emax[k] = T.max(emax[k] - MAX_OFFSET_BITS, 0)  # s8 = amax / 2**6, clamp_min(2**-127)
            for k in T.unroll(rb):
                row = (by * rb + k) * BLOCK + tx // per_row
                if row < o and bcol < ib:
                    if tx < per_row:
                        s8[by * rb + k, bcol] = T.Cast(U8, emax[k])
                    d = e[k] - emax[k]  # offset = s / s8 = 2**d, d <= 6
                    if d >= -5:
                        # every nonzero e2m1 value times 2**d is a normal e4m3: shift its exponent field
                        # (adding d << 3 never reaches the sign bit: the field stays in 1..15)
                        for v in T.unroll(BLOCK):
                            byte = T.Cast(I32, lut[T.Cast(I32, pl[k, v // 2] >> T.uint8(4 * (v % 2))) & 15])
                            ob[v] = T.Cast(U8, T.if_then_else(byte == 0, 0, byte + (d << 3)))
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
                        for v in T.unroll(BLOCK):
                            code = (pl[k, v // 2] >> T.uint8(4 * (v % 2))) & T.uint8(15)
                            y = e2m1_value(code & T.uint8(7)) * offset  # |v| * offset (-0 written as +0)
                            q = T.Cast(E4M3, y)
                            if code & T.uint8(7) != T.uint8(0):
                                if y == T.float32(0) or T.Cast(F32, q) != y:
                                    bad[0] = 1
                            ob[v] = T.reinterpret(q, U8) | T.if_then_else(
                                (code & T.uint8(8)) != T.uint8(0) and y != T.float32(0), T.uint8(0x80), T.uint8(0)
                            )
                    for v in T.vectorized(BLOCK):
                        w8[row, bcol * BLOCK + v] = ob[v]
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
    w8 = torch.empty(out, inp, dtype=torch.float8_e4m3fn, device=packed.device)
    s8 = torch.empty(-(-out // BLOCK), inp // BLOCK, dtype=torch.uint8, device=packed.device)
    counter = torch.zeros(1, dtype=torch.int32, device=packed.device)
    if out and inp:
        p2 = packed.contiguous().view(torch.uint8)
        fp4_to_fp8_kernel(inp)(p2, s.contiguous().view(torch.uint8), w8.view(torch.uint8), s8, counter)
    if int(counter.item()):
        reference(packed.cpu(), s.cpu(), block, name)  # raises FormatError with the reference's message
        raise AssertionError(f"{name}: fp4_to_fp8 kernel flagged a block the reference accepts")
    return w8, s8.view(torch.float8_e8m0fnu)


def warm_up(in_features: int) -> None:
    """Compile the kernel for expert weights with `in_features` (logical) columns."""
    fp4_to_fp8_kernel(in_features)
