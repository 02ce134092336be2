"""MXFP4 -> bf16 dequantization on CUDA, bit-exact with `quant.fp4.decode_mxfp4`.

Exactness: bit-exact (atol=0, rtol=0). Each e2m1 code is decoded from its bits (exact), multiplied
by its e8m0 scale in float32 (exact unless it overflows, like the reference) and rounded once to
the output dtype with the hardware's nearest-even conversion. For bf16 output with a scale byte in
2..252 every product is a normal bf16, so its two bytes are looked up instead (`device_c.
tl_mxfp4_to_bf16`: per-scale byte tables in registers, byte permutes), which gives the same bits.

Layout: packed is [R, C/2] bytes with C static; each thread expands 4 bytes (8 values, one scale) of
one row per slot, UNROLL slots a CTA-width apart: loads of 128 and stores of 512 contiguous bytes
per warp.
"""

import torch
from torch import Tensor

from dsv41_convert.kernels.bits import e2m1_value, e8m0_to_f32
from dsv41_convert.kernels.device_c import PRELUDE
from dsv41_convert.kernels.tl import I32, PASS_CONFIGS, TL_DTYPES, U8, T, tilelang

THREADS = 256


@tilelang.jit(pass_configs=PASS_CONFIGS)
def fp4_dequant_kernel(c: int, group: int, out_dtype: str, unroll: int = 4, vec: int = 4):
    """[R, c/2] packed e2m1 with one e8m0 byte per `group` values -> [R, c] out_dtype.

    vec: packed bytes per thread and slot (at most; all under one scale). 4 bytes make one 16-byte bf16
    store per slot, so a warp's stores cover 512 contiguous bytes (wider vectors leave gaps per store).
    """
    r = T.dynamic("R")
    half = c // 2
    while half % vec or (group // 2) % vec:
        vec //= 2
    vpr = half // vec
    per_cta = THREADS * unroll
    gpr = -(-c // group)
    fast = out_dtype == "bfloat16" and vec % 4 == 0

    @T.macro
    def decode_values(pl, bl, ol, k):
        sc = e8m0_to_f32(bl[k])  # s.float(): 2**-127 for byte 0, NaN for 255
        for v in T.unroll(2 * vec):
            ol[v] = T.Cast(out_dtype, e2m1_value(pl[k, v // 2] >> T.uint8(4 * (v % 2))) * sc)

    @T.prim_func
    def fp4_dequant_(
        packed: T.Tensor[(r, half), U8],
        s: T.Tensor[(r, gpr), U8],
        y: T.Tensor[(r, c), out_dtype],
    ):
        with T.Kernel(T.ceildiv(r * vpr, per_cta), threads=THREADS, prelude=PRELUDE) as bx:
            tx = T.get_thread_binding()
            pl = T.alloc_local((unroll, vec), U8)
            bl = T.alloc_local((unroll,), I32)
            ol = T.alloc_local((2 * vec,), out_dtype)
            for k in T.unroll(unroll):
                slot = bx * per_cta + k * THREADS + tx
                row = slot // vpr
                col = (slot % vpr) * vec  # packed column
                if row < r:
                    for v in T.vectorized(vec):
                        pl[k, v] = packed[row, col + v]
                    bl[k] = T.Cast(I32, s[row, col * 2 // group])
            for k in T.unroll(unroll):
                slot = bx * per_cta + k * THREADS + tx
                row = slot // vpr
                col = (slot % vpr) * vec
                if row < r:
                    # E2M1_VALUES[unpack_nibbles(packed)] * s.float(), then .to(dtype)
                    if fast:
                        if bl[k] >= 2 and bl[k] <= 252:
                            # every value times 2**(b-127) is a normal bf16: bytes from tables, no arithmetic
                            T.evaluate(
                                T.call_extern(
                                    "handle",
                                    "tl_mxfp4_to_bf16",
                                    T.address_of(pl[k, 0]),
                                    vec // 4,
                                    bl[k],
                                    T.address_of(ol[0]),
                                )
                            )
                        else:
                            decode_values(pl, bl, ol, k)
                    else:
                        decode_values(pl, bl, ol, k)
                    for v in T.vectorized(2 * vec):
                        y[row, 2 * col + v] = ol[v]

    return fp4_dequant_


def decode_mxfp4(packed: Tensor, s: Tensor, block: int = 32, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Decode an MXFP4 weight; same result as quant.fp4.decode_mxfp4.

    packed: [..., in/2]          float4_e2m1fn_x2 / int8 / uint8 (logical [..., in]), CUDA
    s: [..., ceil(in/block)]     float8_e8m0fnu, CUDA
    -> [..., in]                 dtype (bfloat16 / float16 / float32)
    """
    if packed.dtype not in (torch.float4_e2m1fn_x2, torch.int8, torch.uint8) or s.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"decode_mxfp4: got {packed.dtype} {list(packed.shape)} and {s.dtype} {list(s.shape)}")
    if not (packed.is_cuda and s.is_cuda) or dtype not in TL_DTYPES or block < 2 or block % 2:
        raise ValueError(f"decode_mxfp4: wants CUDA tensors and an even block, got block {block}, {dtype}")
    inp = 2 * packed.size(-1)
    want = (*packed.shape[:-1], -(-inp // block))
    if tuple(s.shape) != want:
        raise ValueError(
            f"decode_mxfp4: scale {list(s.shape)} does not fit weight {list(packed.shape)}: want {list(want)}"
        )
    lead = packed.shape[:-1]
    y = torch.empty(*lead, inp, dtype=dtype, device=packed.device)
    if y.numel():
        p2 = packed.contiguous().view(torch.uint8).view(-1, inp // 2)
        s2 = s.contiguous().view(torch.uint8).view(-1, want[-1])
        fp4_dequant_kernel(inp, block, TL_DTYPES[dtype])(p2, s2, y.view(-1, inp))
    return y


def warm_up(in_features: int, block: int = 32, dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile the kernel for weights with `in_features` (logical) columns."""
    fp4_dequant_kernel(in_features, block, TL_DTYPES[dtype])
