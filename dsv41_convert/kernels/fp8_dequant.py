"""fp8 e4m3 -> bf16 block dequantization on CUDA, bit-exact with `quant.fp8.decode_fp8_blocks`.

Exactness: bit-exact (atol=0, rtol=0). Each value is f32(q) * f32(scale) (one float32 multiply, the
e8m0 byte decoded from its exponent bits, byte 0 as the subnormal 2**-127) rounded once to the
output dtype with the hardware's nearest-even conversion, exactly the reference's arithmetic.

Layout: q is [O, I] with I static; each thread converts 8 contiguous e4m3 bytes of one row per slot
(an 8-byte load, a 16-byte store), reading the one scale they share; UNROLL slots a CTA-width apart.
The e8m0 byte is decoded without a branch (`e8m0_to_f32_select`), so a thread issues all its loads
before the first one arrives.
"""

import torch
from torch import Tensor

from dsv41_convert.kernels.tl import E4M3, F32, I32, PASS_CONFIGS, TL_DTYPES, U8, T, tilelang

THREADS = 256
UNROLL = 2  # slots per thread (H200, 65536 x 7168: 2 -> 96% of a copy, 4 -> 91%, 8 -> 82%)


def e8m0_to_f32_select(byte):
    """Value of an e8m0 byte as float32, without branches: the same values as `bits.e8m0_to_f32`.

    bits = b << 23, with bit 22 set for b = 0 (the subnormal 2**-127) and b = 255 (NaN 0x7FC00000).
    Integer compares and shifts only: a kernel that decodes a loaded scale this way can issue its
    next loads before the scale arrives (a branch on the loaded byte made each slot wait for it).
    """
    e = T.Cast(I32, byte)
    special = T.Cast(I32, e == T.int32(0)) | T.Cast(I32, e == T.int32(255))
    return T.reinterpret((e << T.int32(23)) | (special << T.int32(22)), F32)


@tilelang.jit(pass_configs=PASS_CONFIGS)
def fp8_dequant_kernel(
    in_features: int,
    bo: int,
    bi: int,
    e8m0: bool,
    out_dtype: str,
    unroll: int = UNROLL,
    vec: int = 8,
    threads: int = THREADS,
):
    """[O, in_features] e4m3 with bo x bi block scales (e8m0 bytes or float32) -> out_dtype.

    vec: e4m3 values per thread and slot (at most). 8 make one 16-byte bf16 store per slot, so a warp's
    stores cover 512 contiguous bytes (16 would leave gaps in every store instruction).
    """
    o = T.dynamic("O")
    i_dim = in_features
    while i_dim % vec or bi % vec:
        vec //= 2
    vpr = i_dim // vec
    per_cta = threads * unroll
    ib = -(-i_dim // bi)
    s_dtype = U8 if e8m0 else F32

    @T.prim_func
    def fp8_dequant_(
        q: T.Tensor[(o, i_dim), E4M3],
        s: T.Tensor[(T.ceildiv(o, bo), ib), s_dtype],
        y: T.Tensor[(o, i_dim), out_dtype],
    ):
        with T.Kernel(T.ceildiv(o * vpr, per_cta), threads=threads) as bx:
            tx = T.get_thread_binding()
            ql = T.alloc_local((unroll, vec), E4M3)
            sl = T.alloc_local((unroll,), F32)
            for k in T.unroll(unroll):
                slot = bx * per_cta + k * threads + tx
                row = slot // vpr
                col = (slot % vpr) * vec
                if row < o:
                    for v in T.vectorized(vec):
                        ql[k, v] = q[row, col + v]
                    if e8m0:
                        sl[k] = e8m0_to_f32_select(s[row // bo, col // bi])  # s.float()
                    else:
                        sl[k] = s[row // bo, col // bi]
            for k in T.unroll(unroll):
                slot = bx * per_cta + k * threads + tx
                row = slot // vpr
                col = (slot % vpr) * vec
                if row < o:
                    for v in T.vectorized(vec):
                        y[row, col + v] = T.Cast(out_dtype, T.Cast(F32, ql[k, v]) * sl[k])  # (q.float() * s).to(dtype)

    return fp8_dequant_


def decode_fp8_blocks(
    q: Tensor, s: Tensor, block: tuple[int, int] | None = None, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """Multiply each e4m3 block by its scale; same result as quant.fp8.decode_fp8_blocks.

    q: [out, in]                        float8_e4m3fn, CUDA
    s: [ceil(out/bo), ceil(in/bi)]      float8_e8m0fnu or float32, CUDA
    -> [out, in]                        dtype (bfloat16 / float16 / float32)
    `block` None infers it from the shapes, as the reference does.
    """
    from dsv41_convert.quant.fp8 import infer_block

    if q.dtype != torch.float8_e4m3fn or s.dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise ValueError(f"decode_fp8_blocks: got {q.dtype} {list(q.shape)} and {s.dtype} {list(s.shape)}")
    if q.dim() != 2 or s.dim() != 2 or not (q.is_cuda and s.is_cuda) or dtype not in TL_DTYPES:
        raise ValueError(f"decode_fp8_blocks: wants 2-d CUDA q and s, got {list(q.shape)} and {list(s.shape)}")
    bo, bi = infer_block(q.shape, s.shape) if block is None else (int(block[0]), int(block[1]))
    want = (-(-q.size(0) // bo), -(-q.size(1) // bi))
    if tuple(s.shape) != want:
        raise ValueError(
            f"scale {list(s.shape)} does not fit weight {list(q.shape)} in {bo}x{bi} blocks: want {list(want)}"
        )
    e8m0 = s.dtype == torch.float8_e8m0fnu
    y = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.numel():
        s_arg = s.contiguous().view(torch.uint8) if e8m0 else s.contiguous()
        fp8_dequant_kernel(q.size(1), bo, bi, e8m0, TL_DTYPES[dtype])(q.contiguous(), s_arg, y)
    return y


def warm_up(in_features: int, block: tuple[int, int] = (32, 32), dtype: torch.dtype = torch.bfloat16) -> None:
    """Compile the e8m0 kernel for weights with `in_features` columns before collectives start."""
    fp8_dequant_kernel(in_features, block[0], block[1], True, TL_DTYPES[dtype])
