"""fp4_act_quant on CUDA: per-row block e2m1 quantization, bit-exact with `quant.act.fp4_act_quant`.

Also the MXFP4 weight encoder (`quant.fp4.encode_mxfp4` is the e8m0 path with block 32).

Exactness: bit-exact (atol=0, rtol=0) on every finite input.
- e8m0 scales: amax floored at 6 * 2**-126, times f32(1/6), rounded up to a power of two from the
  exponent bits; x / scale is a multiply by the exact reciprocal.
- e4m3 scales: amax floored at 6 * 2**-9, divided by 6 (IEEE division, fast math off), rounded to
  e4m3 by the hardware's nearest-even conversion; x / scale is an IEEE division.
- the e2m1 code is chosen by comparisons against the midpoints, ties to the even code, so no
  rounding mode of the device is involved (see `bits.e2m1_code`); -0.0 keeps its sign bit.

Layout: as `act_quant` (rows of static length C, VEC contiguous values per thread, the lanes of a
group adjacent in a warp); each thread writes VEC/2 packed bytes, the even element in the low nibble.
"""

import tilelang
import tilelang.language as T
import torch
from torch import Tensor

from dsv41_convert.kernels.bits import (
    e2m1_code,
    e2m1_value,
    nonfinite,
    pow2_ceil_exp,
    pow2_from_exp,
    recip_pow2_from_exp,
)
from dsv41_convert.kernels.row_launch import rows_per_launch, vector_width

# dtype aliases
F32 = "float32"
E4M3 = "float8_e4m3fn"
U8 = "uint8"
I32 = "int32"
TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: F32}

# pass configs: IEEE division (the e4m3-scale path divides), exact float ops
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}

THREADS = 256
FP4_MAX = 6.0
E8M0_AMAX_FLOOR = 6 * 2.0**-126
E4M3_AMAX_FLOOR = 6 * 2.0**-9


@tilelang.jit(pass_configs=PASS_CONFIGS)
def fp4_act_quant_kernel(c: int, group: int, in_dtype: str, e4m3_scale: bool, inplace: bool, unroll: int = 4):
    """Per-row groups of `group` along rows of static length `c` (c even).

    e4m3_scale: e4m3 scales (the compressed KV path) instead of e8m0 bytes.
    inplace: overwrite x with the dequantized values instead of writing packed codes and scales.
    """
    r = T.symbolic("R")
    elem_bytes = 4 if in_dtype == F32 else 2
    vec = vector_width(c, group, elem_bytes)
    assert vec >= 2, "rows must have an even length"
    lanes = group // vec
    assert lanes <= 32 and lanes & (lanes - 1) == 0, "group / vec must be a power of two <= 32"
    gpr = -(-c // group)
    vpr = gpr * lanes
    per_cta = THREADS * unroll
    s_dtype = E4M3 if e4m3_scale else U8
    shuffles = lanes.bit_length() - 1

    @T.macro
    def load_and_scale(x, xl, amax, sc, inv, bad, bx, tx):
        for k in T.unroll(unroll):
            slot = bx * per_cta + k * THREADS + tx
            row = slot // vpr
            col = (slot % vpr // lanes) * group + (slot % lanes) * vec
            if row < r and col < c:
                for v in T.vectorized(vec):
                    xl[k, v] = T.Cast(F32, x[row, col + v])  # x.float()
            else:
                for v in T.vectorized(vec):
                    xl[k, v] = T.float32(0)  # zero padding of the last group
        for k in T.unroll(unroll):
            amax[k] = T.float32(0)
            for v in T.unroll(vec):
                amax[k] = T.max(amax[k], T.abs(xl[k, v]))  # xg.abs().amax(-1), this thread's part
                if nonfinite(xl[k, v]):
                    bad[0] = 1
            for d in T.unroll(shuffles):
                amax[k] = T.max(amax[k], T.shfl_xor(amax[k], 1 << d))  # ... over the group's lanes
            if e4m3_scale:
                # s = e4m3_saturate(amax.clamp_min(6 * 2**-9) / 6).float()
                sc[k] = T.Cast(F32, T.Cast(E4M3, T.max(amax[k], T.float32(E4M3_AMAX_FLOOR)) / T.float32(FP4_MAX)))
                inv[k] = sc[k]
            else:
                # s = pow2_ceil(amax.clamp_min(6 * 2**-126) * f32(1/6)); kept as its exponent byte
                e = pow2_ceil_exp(T.max(amax[k], T.float32(E8M0_AMAX_FLOOR)) * T.float32(1.0 / FP4_MAX))
                sc[k] = pow2_from_exp(e)
                inv[k] = recip_pow2_from_exp(e)

    def scaled(xl, inv, k, v):
        # x / s: an exact multiply by 1/s for e8m0, an IEEE division for e4m3 scales
        return xl[k, v] / inv[k] if e4m3_scale else xl[k, v] * inv[k]

    if inplace:

        @T.prim_func
        def fp4_act_quant_inplace(x: T.Tensor[(r, c), in_dtype], nonfinite_count: T.Tensor[(1,), I32]):
            with T.Kernel(T.ceildiv(r * vpr, per_cta), threads=THREADS) as bx:
                tx = T.get_thread_binding()
                xl = T.alloc_local((unroll, vec), F32)
                amax = T.alloc_local((unroll,), F32)
                sc = T.alloc_local((unroll,), F32)
                inv = T.alloc_local((unroll,), F32)
                yl = T.alloc_local((vec,), in_dtype)
                bad = T.alloc_local((1,), I32)
                bad[0] = 0
                load_and_scale(x, xl, amax, sc, inv, bad, bx, tx)
                for k in T.unroll(unroll):
                    slot = bx * per_cta + k * THREADS + tx
                    row = slot // vpr
                    col = (slot % vpr // lanes) * group + (slot % lanes) * vec
                    if row < r and col < c:
                        for v in T.unroll(vec):
                            # x.copy_(E2M1_VALUES[encode_e2m1(x / s)] * s)
                            yl[v] = T.Cast(in_dtype, e2m1_value(e2m1_code(scaled(xl, inv, k, v))) * sc[k])
                        for v in T.vectorized(vec):
                            x[row, col + v] = yl[v]  # one vector store
                if bad[0] != 0:
                    T.atomic_add(nonfinite_count[0], 1)

        return fp4_act_quant_inplace

    @T.prim_func
    def fp4_act_quant_(
        x: T.Tensor[(r, c), in_dtype],
        packed: T.Tensor[(r, c // 2), U8],
        s: T.Tensor[(r, gpr), s_dtype],
        nonfinite_count: T.Tensor[(1,), I32],
    ):
        with T.Kernel(T.ceildiv(r * vpr, per_cta), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            xl = T.alloc_local((unroll, vec), F32)
            amax = T.alloc_local((unroll,), F32)
            sc = T.alloc_local((unroll,), F32)
            inv = T.alloc_local((unroll,), F32)
            codes = T.alloc_local((vec,), U8)
            bad = T.alloc_local((1,), I32)
            bad[0] = 0
            load_and_scale(x, xl, amax, sc, inv, bad, bx, tx)
            for k in T.unroll(unroll):
                slot = bx * per_cta + k * THREADS + tx
                row = slot // vpr
                col = (slot % vpr // lanes) * group + (slot % lanes) * vec
                if row < r and col < c:
                    if slot % lanes == 0:
                        if e4m3_scale:
                            s[row, slot % vpr // lanes] = T.Cast(E4M3, sc[k])  # exact: sc is an e4m3 value
                        else:
                            s[row, slot % vpr // lanes] = T.Cast(U8, T.reinterpret(sc[k], I32) >> 23)
                    for v in T.unroll(vec // 2):
                        # encode_e2m1(x / s), then pack_nibbles: element 2k in the low nibble
                        codes[v] = T.Cast(
                            U8, e2m1_code(scaled(xl, inv, k, 2 * v)) | (e2m1_code(scaled(xl, inv, k, 2 * v + 1)) << 4)
                        )
                    for v in T.vectorized(vec // 2):
                        packed[row, col // 2 + v] = codes[v]  # one vector store
            if bad[0] != 0:
                T.atomic_add(nonfinite_count[0], 1)

    return fp4_act_quant_


def quantize_rows(
    x2: Tensor, group: int, e4m3_scale: bool, inplace: bool, nonfinite_count: Tensor
) -> tuple[Tensor, Tensor] | None:
    """Launch the kernel over a contiguous [R, C] CUDA tensor (slices of rows for huge tensors).

    x2: [R, C]  bfloat16 / float16 / float32, contiguous, CUDA, C even
    -> packed [R, C/2] uint8, s [R, ceil(C/group)] uint8 (e8m0 bytes) or float8_e4m3fn; None when inplace
    """
    rows, c = x2.shape
    kernel = fp4_act_quant_kernel(c, group, TL_DTYPES[x2.dtype], e4m3_scale, inplace)
    step = rows_per_launch(c, group)
    if inplace:
        for r0 in range(0, rows, step):
            kernel(x2[r0 : r0 + step], nonfinite_count)
        return None
    packed = torch.empty(rows, c // 2, dtype=torch.uint8, device=x2.device)
    s_dtype = torch.float8_e4m3fn if e4m3_scale else torch.uint8
    s = torch.empty(rows, -(-c // group), dtype=s_dtype, device=x2.device)
    for r0 in range(0, rows, step):
        kernel(x2[r0 : r0 + step], packed[r0 : r0 + step], s[r0 : r0 + step], nonfinite_count)
    return packed, s


def fp4_act_quant(
    x: Tensor, block_size: int = 32, inplace: bool = False, scale_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor] | Tensor:
    """Per-row block e2m1 quantization; same signature and result as quant.act.fp4_act_quant.

    scale_dtype None picks e4m3 for block_size 16 and e8m0 otherwise (as the reference).

    x: [..., N]                          bfloat16 / float16 / float32, CUDA, N % block_size == 0
    -> inplace=False: packed [..., N/2]  float4_e2m1fn_x2 (logical [..., N])
                      s [..., N/B]       scale_dtype
    -> inplace=True:  x itself, overwritten with e2m1 value * scale cast to x.dtype
    """
    if scale_dtype is None:
        scale_dtype = torch.float8_e4m3fn if block_size == 16 else torch.float8_e8m0fnu
    if scale_dtype not in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        raise ValueError(f"fp4_act_quant: scale_dtype must be float8_e8m0fnu or float8_e4m3fn, got {scale_dtype}")
    if x.dtype not in TL_DTYPES or not x.is_cuda:
        raise ValueError(f"fp4_act_quant: x must be a CUDA float tensor, got {x.dtype} {list(x.shape)} on {x.device}")
    if block_size < 2 or x.size(-1) % block_size or block_size & (block_size - 1):
        raise ValueError(f"fp4_act_quant: last dim of {list(x.shape)} must be a multiple of block_size {block_size}")
    e4m3_scale = scale_dtype == torch.float8_e4m3fn
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    if inplace:
        xc = x if x.is_contiguous() else x.contiguous()
        quantize_rows(xc.view(-1, x.size(-1)), block_size, e4m3_scale, True, counter)
        if xc is not x:
            x.copy_(xc)
        return x
    lead, n = x.shape[:-1], x.size(-1)
    packed, s = quantize_rows(x.contiguous().view(-1, n), block_size, e4m3_scale, False, counter)
    s = s if e4m3_scale else s.view(torch.float8_e8m0fnu)
    return packed.view(torch.float4_e2m1fn_x2).view(*lead, n // 2), s.view(*lead, s.size(-1))


def warm_up(n: int, block_size: int = 32, dtype: torch.dtype = torch.bfloat16, inplace: bool = False) -> None:
    """Compile the kernel for rows of length n before collectives start (e4m3 scales for block 16)."""
    fp4_act_quant_kernel(n, block_size, TL_DTYPES[dtype], block_size == 16, inplace)
