"""act_quant on CUDA: per-row block e4m3 quantization, bit-exact with `quant.act.act_quant`.

Also the (1, B) weight path of `quant.fp8.encode_fp8_blocks` (the Engram tables): the same math.

Exactness: bit-exact (atol=0, rtol=0) with the reference on every finite input. The amax is a max of
absolute values (exact), the scale is amax * f32(1/448) (one float32 multiply, as the reference),
rounded up to a power of two from its exponent bits for ue8m0; x / scale is a multiply by the exact
reciprocal for ue8m0 and an IEEE division (fast math off) for float32 scales; the e4m3 cast is the
hardware's round-to-nearest-even with saturation after the same clamp to +-448.

Layout: x is read as [R, C] (C static: one compiled kernel per row length, group size and dtypes).
Each thread owns VEC contiguous values (16-byte loads), the lanes of one group are adjacent in a
warp and combine their maxima with xor-shuffles. A group that runs past C (C not a multiple of the
group) sees zeros there, exactly like the reference's zero padding.
"""

import tilelang
import tilelang.language as T
import torch
from torch import Tensor

from dsv41_convert.kernels.bits import nonfinite, pow2_ceil_exp, pow2_from_exp, recip_pow2_from_exp
from dsv41_convert.kernels.row_launch import rows_per_launch, vector_width

# dtype aliases
F32 = "float32"
E4M3 = "float8_e4m3fn"
U8 = "uint8"
I32 = "int32"
TL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: F32}

# pass configs: IEEE division and exact float ops (the references are torch's IEEE arithmetic)
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}

THREADS = 256
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # as quant.act / quant.fp8


@tilelang.jit(pass_configs=PASS_CONFIGS)
def act_quant_kernel(c: int, group: int, in_dtype: str, pow2: bool, scale_u8: bool, inplace: bool, unroll: int = 4):
    """Per-row groups of `group` along rows of static length `c`.

    pow2: ue8m0 scales (power of two) rather than plain float32; scale_u8: store e8m0 bytes.
    inplace: overwrite x with the dequantized values instead of writing q and s.
    """
    r = T.symbolic("R")
    elem_bytes = 4 if in_dtype == F32 else 2
    vec = vector_width(c, group, elem_bytes)
    lanes = group // vec  # threads per group, adjacent in a warp
    assert lanes <= 32 and lanes & (lanes - 1) == 0, "group / vec must be a power of two <= 32"
    gpr = -(-c // group)  # groups per row
    vpr = gpr * lanes  # vector slots per row (padded)
    per_cta = THREADS * unroll
    s_dtype = U8 if scale_u8 else F32
    shuffles = lanes.bit_length() - 1

    @T.macro
    def load(x, xl, bx, tx):
        for k in T.unroll(unroll):
            slot = bx * per_cta + k * THREADS + tx
            row = slot // vpr
            col = (slot % vpr // lanes) * group + (slot % lanes) * vec
            if row < r and col < c:
                for v in T.vectorized(vec):
                    xl[k, v] = T.Cast(F32, x[row, col + v])  # x.float()
            else:
                for v in T.vectorized(vec):
                    xl[k, v] = T.float32(0)  # F.pad(..., 0)

    @T.macro
    def scales(xl, amax, bad, bx, tx):
        for k in T.unroll(unroll):
            amax[k] = T.float32(0)
            for v in T.unroll(vec):
                amax[k] = T.max(amax[k], T.abs(xl[k, v]))  # xg.abs().amax(-1), this thread's part
                if nonfinite(xl[k, v]):
                    bad[0] = 1
            for d in T.unroll(shuffles):
                amax[k] = T.max(amax[k], T.shfl_xor(amax[k], 1 << d))  # ... over the group's lanes
            amax[k] = T.max(amax[k], T.float32(AMAX_FLOOR)) * T.float32(1.0 / FP8_MAX)  # clamp_min, * f32(1/448)

    if inplace:

        @T.prim_func
        def act_quant_inplace(x: T.Tensor[(r, c), in_dtype], nonfinite_count: T.Tensor[(1,), I32]):
            with T.Kernel(T.ceildiv(r * vpr, per_cta), threads=THREADS) as bx:
                tx = T.get_thread_binding()
                xl = T.alloc_local((unroll, vec), F32)
                amax = T.alloc_local((unroll,), F32)
                bad = T.alloc_local((1,), I32)
                bad[0] = 0
                load(x, xl, bx, tx)
                scales(xl, amax, bad, bx, tx)
                for k in T.unroll(unroll):
                    slot = bx * per_cta + k * THREADS + tx
                    row = slot // vpr
                    col = (slot % vpr // lanes) * group + (slot % lanes) * vec
                    if pow2:
                        e = pow2_ceil_exp(amax[k])  # pow2_ceil(s)
                        sc = pow2_from_exp(e)
                        inv = recip_pow2_from_exp(e)
                        if row < r and col < c:
                            for v in T.vectorized(vec):
                                # x.copy_((e4m3_saturate(x / s).float() * s)
                                x[row, col + v] = T.Cast(
                                    in_dtype,
                                    T.Cast(F32, T.Cast(E4M3, T.clamp(xl[k, v] * inv, -FP8_MAX, FP8_MAX))) * sc,
                                )
                    else:
                        if row < r and col < c:
                            for v in T.vectorized(vec):
                                x[row, col + v] = T.Cast(
                                    in_dtype,
                                    T.Cast(F32, T.Cast(E4M3, T.clamp(xl[k, v] / amax[k], -FP8_MAX, FP8_MAX))) * amax[k],
                                )
                if bad[0] != 0:
                    T.atomic_add(nonfinite_count[0], 1)

        return act_quant_inplace

    @T.prim_func
    def act_quant_(
        x: T.Tensor[(r, c), in_dtype],
        q: T.Tensor[(r, c), E4M3],
        s: T.Tensor[(r, gpr), s_dtype],
        nonfinite_count: T.Tensor[(1,), I32],
    ):
        with T.Kernel(T.ceildiv(r * vpr, per_cta), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            xl = T.alloc_local((unroll, vec), F32)
            amax = T.alloc_local((unroll,), F32)
            bad = T.alloc_local((1,), I32)
            bad[0] = 0
            load(x, xl, bx, tx)
            scales(xl, amax, bad, bx, tx)
            for k in T.unroll(unroll):
                slot = bx * per_cta + k * THREADS + tx
                row = slot // vpr
                col = (slot % vpr // lanes) * group + (slot % lanes) * vec
                if row < r and col < c:
                    if pow2:
                        e = pow2_ceil_exp(amax[k])  # s = pow2_ceil(amax * f32(1/448))
                        inv = recip_pow2_from_exp(e)  # 1/s, exact
                        if slot % lanes == 0:
                            if scale_u8:
                                s[row, slot % vpr // lanes] = T.Cast(U8, e)  # s.to(float8_e8m0fnu)
                            else:
                                s[row, slot % vpr // lanes] = pow2_from_exp(e)
                        for v in T.vectorized(vec):
                            q[row, col + v] = T.Cast(
                                E4M3, T.clamp(xl[k, v] * inv, -FP8_MAX, FP8_MAX)
                            )  # e4m3_saturate(x/s)
                    else:
                        if slot % lanes == 0:
                            s[row, slot % vpr // lanes] = amax[k]  # s = amax * f32(1/448)
                        for v in T.vectorized(vec):
                            q[row, col + v] = T.Cast(E4M3, T.clamp(xl[k, v] / amax[k], -FP8_MAX, FP8_MAX))
            if bad[0] != 0:
                T.atomic_add(nonfinite_count[0], 1)

    return act_quant_


def quantize_rows(
    x2: Tensor, group: int, pow2: bool, scale_u8: bool, inplace: bool, nonfinite_count: Tensor
) -> tuple[Tensor, Tensor] | None:
    """Launch the kernel over a contiguous [R, C] CUDA tensor (slices of rows for huge tensors).

    x2: [R, C]  bfloat16 / float16 / float32, contiguous, CUDA
    -> q [R, C] float8_e4m3fn, s [R, ceil(C/group)] uint8 (e8m0 bytes) or float32; None when inplace
    """
    rows, c = x2.shape
    kernel = act_quant_kernel(c, group, TL_DTYPES[x2.dtype], pow2, scale_u8, inplace)
    step = rows_per_launch(c, group)
    if inplace:
        for r0 in range(0, rows, step):
            kernel(x2[r0 : r0 + step], nonfinite_count)
        return None
    q = torch.empty(rows, c, dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty(rows, -(-c // group), dtype=torch.uint8 if scale_u8 else torch.float32, device=x2.device)
    for r0 in range(0, rows, step):
        kernel(x2[r0 : r0 + step], q[r0 : r0 + step], s[r0 : r0 + step], nonfinite_count)
    return q, s


def act_quant(
    x: Tensor,
    block_size: int = 32,
    scale_fmt: str | None = "ue8m0",
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
    inplace: bool = False,
) -> tuple[Tensor, Tensor] | Tensor:
    """Per-row block e4m3 quantization of activations; same signature and result as quant.act.act_quant.

    x: [..., N]                       bfloat16 / float16 / float32, CUDA, N % block_size == 0
    -> inplace=False: q [..., N]      float8_e4m3fn
                      s [..., N/B]    scale_dtype (float8_e8m0fnu needs scale_fmt="ue8m0")
    -> inplace=True:  x itself, overwritten with f32(q) * scale cast to x.dtype
    Non-finite activations are not reported (as the reference): NaN propagates, Inf saturates.
    """
    if x.dtype not in TL_DTYPES or not x.is_cuda:
        raise ValueError(f"act_quant: x must be a CUDA float tensor, got {x.dtype} {list(x.shape)} on {x.device}")
    if block_size < 1 or x.size(-1) % block_size or block_size & (block_size - 1):
        raise ValueError(f"act_quant: last dim of {list(x.shape)} must be a multiple of block_size {block_size} (2**k)")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"act_quant: scale_fmt must be 'ue8m0' or None, got {scale_fmt!r}")
    if scale_dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"act_quant: scale_dtype must be float32 or float8_e8m0fnu, got {scale_dtype}")
    if scale_dtype == torch.float8_e8m0fnu and scale_fmt is None:
        raise ValueError("act_quant: e8m0 scales need scale_fmt='ue8m0' (a plain float32 scale is not a power of two)")
    pow2 = scale_fmt is not None
    scale_u8 = scale_dtype == torch.float8_e8m0fnu
    counter = torch.zeros(1, dtype=torch.int32, device=x.device)
    if inplace:
        xc = x if x.is_contiguous() else x.contiguous()
        quantize_rows(xc.view(-1, x.size(-1)), block_size, pow2, scale_u8, True, counter)
        if xc is not x:
            x.copy_(xc)
        return x
    lead = x.shape[:-1]
    q, s = quantize_rows(x.contiguous().view(-1, x.size(-1)), block_size, pow2, scale_u8, False, counter)
    s = s.view(torch.float8_e8m0fnu) if scale_u8 else s
    return q.view(*lead, x.size(-1)), s.view(*lead, s.size(-1))


def warm_up(n: int, block_size: int = 32, dtype: torch.dtype = torch.bfloat16, inplace: bool = False) -> None:
    """Compile the kernel for rows of length n (ue8m0, e8m0 scales) before collectives start."""
    act_quant_kernel(n, block_size, TL_DTYPES[dtype], True, True, inplace)
