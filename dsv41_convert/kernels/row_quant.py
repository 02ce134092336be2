"""Per-row block quantization on CUDA: the one kernel behind act_quant (e4m3) and fp4_act_quant (e2m1).

Also the (1, B) weight path of `quant.fp8.encode_fp8_blocks` and the MXFP4 weight encoder
(`quant.fp4.encode_mxfp4` is the e2m1 / e8m0 path with groups of 32).

Formats (`codes`, `scale`), each bit-exact (atol=0, rtol=0) with its reference on every finite input:
- ("e4m3", "e8m0" | "pow2"): s = pow2_ceil(max(amax, 1e-4) * f32(1/448)) from the float32 bits,
  stored as its exponent byte (e8m0) or as float32 (pow2); q = e4m3(x * (1/s)), the reciprocal exact.
- ("e4m3", "f32"): s = max(amax, 1e-4) * f32(1/448); q = e4m3(x / s), the quotient correctly rounded
  (`device_c.tl_div_rn`).
- ("e2m1", "e8m0"): s = pow2_ceil(max(amax, 6 * 2**-126) * f32(1/6)); code = e2m1(x * (1/s)).
- ("e2m1", "e4m3"): s = e4m3(max(amax, 6 * 2**-9) / 6) (IEEE division, once per group); code = e2m1(x / s).
The e4m3 cast is the hardware's nearest-even conversion with saturation, the same result as the
references' clamp to +-448 then cast. An e4m3 group holding NaN/Inf is bit-exact too: its scale is the
group's |x| max (inf, or torch's quiet NaN), its codes x / s (+-0, or the positive NaN 0x7F as quant.act makes
every NaN); the e2m1 formats have no NaN code and clamp such a group (weights never get there: the
weight encoders raise on non-finite input). The amax is an integer max of the |x| bit patterns (exact, and
a NaN or Inf shows in it), so a non-finite value is counted per group at no cost per element.

Layout: x is read as [R, C] (C static: one compiled kernel per row length, group size, dtypes and
format). Each thread owns UNROLL slots of contiguous values: for e4m3 one 16-byte load per slot, the
lanes of a group adjacent in a warp, their maxima combined by xor-shuffles (so q leaves in coalesced
16-byte stores); for e2m1 a whole group of up to 64 bytes per slot (several 16-byte loads, no
shuffle), so its packed codes leave in one 16-byte store. A group that runs past C sees zeros there,
exactly like the reference's zero padding. For bf16 rows with e8m0 e2m1 codes a thread encodes 8
values per helper call (`device_c.tl_e2m1x8_bf16`); other dtypes, e4m3 scales and groups holding
NaN/Inf take the per-pair path (`device_c.tl_e2m1x2`, clamped).
"""

import torch
from torch import Tensor

from dsv41_convert.kernels.bits import e2m1_value, pow2_ceil_exp, pow2_from_exp, recip_pow2_from_exp
from dsv41_convert.kernels.device_c import PRELUDE
from dsv41_convert.kernels.row_launch import rows_per_launch, vector_width
from dsv41_convert.kernels.tl import E4M3, F32, I32, PASS_CONFIGS, TL_DTYPES, U8, T, tilelang

THREADS = 256
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4  # as quant.act and quant.fp8
# (codes, scale) -> (amax floor, factor applied to the floored amax; None: divide by FP4_MAX)
FORMATS = {
    ("e4m3", "e8m0"): (FP8_AMAX_FLOOR, 1.0 / FP8_MAX),
    ("e4m3", "pow2"): (FP8_AMAX_FLOOR, 1.0 / FP8_MAX),
    ("e4m3", "f32"): (FP8_AMAX_FLOOR, 1.0 / FP8_MAX),
    ("e2m1", "e8m0"): (6 * 2.0**-126, 1.0 / FP4_MAX),
    ("e2m1", "e4m3"): (6 * 2.0**-9, None),
}
SCALE_DTYPES = {"e8m0": U8, "pow2": F32, "f32": F32, "e4m3": E4M3}
# slots per thread and threads per CTA (the fastest measured on an H200: docs/BENCHMARKS.md)
UNROLL = {"e4m3": 4, "e2m1": 2}
CTA_THREADS = {"e4m3": 256, "e2m1": 128}
NONFINITE_BITS = 0x7F800000  # |x| bits at or above this: Inf or NaN
QUIET_NAN_BITS = 0x7FC00000  # the NaN torch's reductions return, whatever NaN went in


@tilelang.jit(pass_configs=PASS_CONFIGS)
def row_quant_kernel(
    c: int, group: int, in_dtype: str, codes: str, scale: str, inplace: bool, unroll: int, threads: int = THREADS
):
    """Groups of `group` along rows of static length `c`; `codes`/`scale` name the format (see FORMATS).

    inplace: overwrite x with the dequantized values instead of writing codes and scales.
    unroll: slots per thread; threads: per CTA.
    """
    floor, factor = FORMATS[(codes, scale)]
    pow2 = scale in ("e8m0", "pow2")
    fp4 = codes == "e2m1"
    r = T.dynamic("R")
    elem_bytes = 4 if in_dtype == F32 else 2
    piece = vector_width(c, group, elem_bytes)  # values per 16-byte (or narrower) load
    assert not fp4 or piece >= 2, "e2m1 rows must have an even length"
    # values per thread and slot: one load for e4m3 (16-byte q stores, coalesced); a whole group of up to
    # 64 bytes for e2m1, so its packed bytes leave in one 16-byte store and no shuffle is needed
    span = min(group, 64 // elem_bytes) if fp4 else piece
    pieces = span // piece
    lanes = group // span  # threads per group, adjacent in a warp
    assert lanes <= 32 and lanes & (lanes - 1) == 0, "group / span must be a power of two <= 32"
    gpr = -(-c // group)  # groups per row
    vpr = gpr * lanes  # slots per row (padded)
    per_cta = threads * unroll
    shuffles = lanes.bit_length() - 1
    fast_fp4 = fp4 and scale == "e8m0" and in_dtype == "bfloat16" and piece == 8
    out_span = span // 2 if fp4 else span
    out_piece = piece // 2 if fp4 else piece
    out_cols = c // 2 if fp4 else c
    out_dtype = U8 if fp4 else E4M3

    def slot_of(bx, tx, k):
        slot = bx * per_cta + k * threads + tx
        return slot, slot // vpr, (slot % vpr // lanes) * group + (slot % lanes) * span

    def xf(xr, k, v):
        return T.Cast(F32, xr[k, v])  # x.float()

    @T.macro
    def quotients(xr, k, sc, inv, amax, yl, n):
        # x / s for the slot's first n values: an exact multiply by 1/s for power-of-two scales, else the
        # correctly rounded quotient from RN(1/s); an e4m3 group with NaN/Inf: a plain IEEE division by
        # its inf or NaN scale (finite / inf = +-0, inf / inf = NaN, as the reference)
        if pow2 and fp4:
            for v in T.unroll(n):
                yl[v] = xf(xr, k, v) * inv[k]
        elif pow2 and amax[k] < T.int32(NONFINITE_BITS):
            for v in T.unroll(n):
                yl[v] = xf(xr, k, v) * inv[k]
        elif not pow2 and amax[k] < T.int32(NONFINITE_BITS):
            for v in T.unroll(n):
                yl[v] = T.call_extern(F32, "tl_div_rn", xf(xr, k, v), sc[k], inv[k])
        else:
            for v in T.unroll(n):
                yl[v] = xf(xr, k, v) / sc[k]

    @T.macro
    def quantize_slots(x, nonfinite_count, bx):
        # load the thread's slots, then each group's amax, scale and 1/scale; counts NaN/Inf groups
        tx = T.get_thread_binding()
        xr = T.alloc_local((unroll, span), in_dtype)
        amax = T.alloc_local((unroll,), I32)
        sc = T.alloc_local((unroll,), F32)
        inv = T.alloc_local((unroll,), F32)
        yl = T.alloc_local((span,), F32)  # x / s of one slot (scratch for the callers)
        bad = T.alloc_local((1,), I32)
        bad[0] = 0
        for k in T.unroll(unroll):
            _slot, row, col = slot_of(bx, tx, k)
            for j in T.unroll(pieces):
                if row < r and col + j * piece < c:
                    for v in T.vectorized(piece):
                        xr[k, j * piece + v] = x[row, col + j * piece + v]
                else:
                    for v in T.vectorized(piece):
                        xr[k, j * piece + v] = T.Cast(in_dtype, 0)  # F.pad(..., 0)
        for k in T.unroll(unroll):
            amax[k] = 0
            if fast_fp4:
                for j in T.unroll(pieces):
                    amax[k] = T.max(amax[k], T.call_extern(I32, "tl_absmax_bf16x8", T.address_of(xr[k, j * piece])))
            else:
                for v in T.unroll(span):
                    amax[k] = T.max(amax[k], T.reinterpret(xf(xr, k, v), I32) & T.int32(0x7FFFFFFF))  # |x| bits
            for d in T.unroll(shuffles):
                amax[k] = T.max(amax[k], T.shfl_xor(amax[k], 1 << d))  # xg.abs().amax(-1) over the group's lanes
            if amax[k] >= T.int32(NONFINITE_BITS):
                bad[0] = 1  # NaN or Inf in the group
            a = T.max(T.reinterpret(amax[k], F32), T.float32(floor))  # clamp_min
            if factor is None:
                sc[k] = T.Cast(F32, T.Cast(E4M3, a / T.float32(FP4_MAX)))  # e4m3_saturate(amax / 6)
                inv[k] = T.float32(1) / sc[k]
            elif pow2:
                e = pow2_ceil_exp(a * T.float32(factor))  # pow2_ceil(amax * f32(1/max))
                sc[k] = pow2_from_exp(e)
                inv[k] = recip_pow2_from_exp(e)  # 1/s, exact
            else:
                sc[k] = a * T.float32(factor)
                inv[k] = T.float32(1) / sc[k]  # RN(1/s), for tl_div_rn
            if not fp4 and amax[k] >= T.int32(NONFINITE_BITS):
                # the reference's scale: inf, or the quiet NaN 0x7FC00000 that torch's amax returns
                nan = amax[k] > T.int32(NONFINITE_BITS)
                sc[k] = T.reinterpret(T.if_then_else(nan, T.int32(QUIET_NAN_BITS), amax[k]), F32)
        if bad[0] != 0:
            T.atomic_add(nonfinite_count[0], 1)
        return tx, xr, amax, sc, inv, yl

    @T.macro
    def pack_pairs(xr, k, sc, inv, amax, yl, ql):
        quotients(xr, k, sc, inv, amax, yl, span)
        for v in T.unroll(out_span):
            ql[v] = T.call_extern(U8, "tl_e2m1x2", yl[2 * v], yl[2 * v + 1])

    if inplace:

        @T.prim_func
        def row_quant_inplace(x: T.Tensor[(r, c), in_dtype], nonfinite_count: T.Tensor[(1,), I32]):
            with T.Kernel(T.ceildiv(r * vpr, per_cta), threads=threads, prelude=PRELUDE) as bx:
                tx, xr, amax, sc, inv, yl = quantize_slots(x, nonfinite_count, bx)
                ol = T.alloc_local((span,), in_dtype)
                for k in T.unroll(unroll):
                    _slot, row, col = slot_of(bx, tx, k)
                    quotients(xr, k, sc, inv, amax, yl, span)
                    for v in T.unroll(span):
                        if fp4:
                            # x.copy_(E2M1_VALUES[encode_e2m1(x / s)] * s)
                            dq = e2m1_value(T.call_extern(I32, "tl_e2m1_code", yl[v])) * sc[k]
                        else:
                            # x.copy_(e4m3_saturate(x / s).float() * s)
                            dq = T.Cast(F32, T.Cast(E4M3, yl[v])) * sc[k]
                        ol[v] = T.Cast(in_dtype, dq)
                    for j in T.unroll(pieces):
                        if row < r and col + j * piece < c:
                            for v in T.vectorized(piece):
                                x[row, col + j * piece + v] = ol[j * piece + v]  # one vector store

        return row_quant_inplace

    @T.prim_func
    def row_quant_(
        x: T.Tensor[(r, c), in_dtype],
        q: T.Tensor[(r, out_cols), out_dtype],
        s: T.Tensor[(r, gpr), SCALE_DTYPES[scale]],
        nonfinite_count: T.Tensor[(1,), I32],
    ):
        with T.Kernel(T.ceildiv(r * vpr, per_cta), threads=threads, prelude=PRELUDE) as bx:
            tx, xr, amax, sc, inv, yl = quantize_slots(x, nonfinite_count, bx)
            ql = T.alloc_local((out_span,), out_dtype)
            for k in T.unroll(unroll):
                slot, row, col = slot_of(bx, tx, k)
                if row < r and col < c:
                    if slot % lanes == 0:
                        g = slot % vpr // lanes
                        if scale == "e8m0":
                            s[row, g] = T.Cast(U8, T.reinterpret(sc[k], I32) >> 23)  # s.to(float8_e8m0fnu)
                        elif scale == "e4m3":
                            s[row, g] = T.Cast(E4M3, sc[k])  # exact: sc is an e4m3 value
                        else:
                            s[row, g] = sc[k]
                    if fp4:
                        # encode_e2m1(x / s), then pack_nibbles: element 2k in the low nibble
                        if fast_fp4:
                            if amax[k] < T.int32(NONFINITE_BITS):
                                for j in T.unroll(pieces):
                                    T.evaluate(
                                        T.call_extern(
                                            "handle",
                                            "tl_e2m1x8_bf16",
                                            T.address_of(xr[k, j * piece]),
                                            inv[k],
                                            T.address_of(ql[j * out_piece]),
                                        )
                                    )
                            else:
                                pack_pairs(xr, k, sc, inv, amax, yl, ql)
                        else:
                            pack_pairs(xr, k, sc, inv, amax, yl, ql)
                    else:
                        quotients(xr, k, sc, inv, amax, yl, span)
                        for v in T.vectorized(out_span):
                            ql[v] = T.Cast(E4M3, yl[v])  # e4m3_saturate(x / s), pairs at a time
                    qcol = col // (2 if fp4 else 1)
                    if col + span <= c:
                        for v in T.vectorized(out_span):
                            q[row, qcol + v] = ql[v]  # one vector store
                    else:
                        for j in T.unroll(pieces):
                            if col + j * piece < c:
                                for v in T.vectorized(out_piece):
                                    q[row, qcol + j * out_piece + v] = ql[j * out_piece + v]

    return row_quant_


def quantize_rows(
    x2: Tensor, group: int, codes: str, scale: str, inplace: bool, nonfinite_count: Tensor
) -> tuple[Tensor, Tensor] | None:
    """Launch the kernel over a contiguous [R, C] CUDA tensor (slices of rows for huge tensors).

    x2: [R, C]  bfloat16 / float16 / float32, contiguous, CUDA (C even for e2m1)
    -> q [R, C] float8_e4m3fn or packed [R, C/2] uint8,
       s [R, ceil(C/group)] uint8 (e8m0 bytes), float32 or float8_e4m3fn; None when inplace
    """
    rows, c = x2.shape
    kernel = row_quant_kernel(c, group, TL_DTYPES[x2.dtype], codes, scale, inplace, UNROLL[codes], CTA_THREADS[codes])
    step = rows_per_launch(c, group)
    if inplace:
        for r0 in range(0, rows, step):
            kernel(x2[r0 : r0 + step], nonfinite_count)
        return None
    fp4 = codes == "e2m1"
    q = torch.empty(rows, c // 2 if fp4 else c, dtype=torch.uint8 if fp4 else torch.float8_e4m3fn, device=x2.device)
    s_dtype = {"e8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(scale, torch.float32)
    s = torch.empty(rows, -(-c // group), dtype=s_dtype, device=x2.device)
    for r0 in range(0, rows, step):
        kernel(x2[r0 : r0 + step], q[r0 : r0 + step], s[r0 : r0 + step], nonfinite_count)
    return q, s
