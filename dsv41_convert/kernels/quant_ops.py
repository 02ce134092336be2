"""The quant/ API on CUDA: the same functions and signatures, computed by the TileLang kernels.

`shard --device cuda` uses this module in place of `dsv41_convert.quant` (the engine's
`quantizer_for("cuda")`). Every function gives bit-for-bit the result of its `quant/` reference
(the kernels' GPU tests check this with atol=0, rtol=0), raises the same FormatError for NaN/Inf
weights, lossy casts and NaN scales, and returns its results on the device of its first input:
a CPU tensor is copied to the current CUDA device, converted there, and the results copied back.
Shapes or options no kernel takes (an odd block, an empty tensor) run the torch reference on the
CPU instead (the same function by definition), and the results go to the input's device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41_convert.quant import act as act_ref
from dsv41_convert.quant import cast as cast_ref
from dsv41_convert.quant import fp4 as fp4_ref
from dsv41_convert.quant import fp8 as fp8_ref
from dsv41_convert.quant.checks import FLOAT_INPUTS, require_dtype, require_finite


def _cuda(*ts: Tensor) -> tuple[Tensor, ...]:
    dev = torch.device("cuda", torch.cuda.current_device())
    return tuple(t if t.is_cuda else t.to(dev, non_blocking=False) for t in ts)


def _back(device: torch.device, *ts: Tensor) -> tuple[Tensor, ...]:
    return tuple(t if t.device == device else t.to(device) for t in ts)


def encode_fp8_blocks(
    w: Tensor, block: tuple[int, int] = (32, 32), scale_fmt: str | None = "ue8m0", name: str = "<tensor>"
) -> tuple[Tensor, Tensor]:
    """quant.fp8.encode_fp8_blocks on CUDA.

    w: [out, in]                        float32 / bfloat16 / float16
    -> q: [out, in]                     float8_e4m3fn
       s: [ceil(out/bo), ceil(in/bi)]   float8_e8m0fnu (ue8m0) or float32
    """
    from dsv41_convert.kernels import fp8_quant

    bo, bi = (int(b) for b in block)
    kernel_ok = (
        w.dim() == 2
        and w.numel() > 0
        and w.dtype in FLOAT_INPUTS
        and scale_fmt in ("ue8m0", None)
        and (
            (bo, bi) in ((32, 32), (128, 128))
            or (bo == 1 and 2 <= bi <= 256 and bi & (bi - 1) == 0 and w.size(1) % 2 == 0)
        )
    )
    if not kernel_ok:
        return _back(w.device, *fp8_ref.encode_fp8_blocks(w.cpu(), block, scale_fmt, name))
    (wc,) = _cuda(w)
    return _back(w.device, *fp8_quant.encode_fp8_blocks(wc, (bo, bi), scale_fmt, name))


def decode_fp8_blocks(
    q: Tensor, s: Tensor, block: tuple[int, int] | None = None, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """quant.fp8.decode_fp8_blocks on CUDA.

    q: [out, in]                        float8_e4m3fn
    s: [ceil(out/bo), ceil(in/bi)]      float8_e8m0fnu or float32
    -> [out, in]                        dtype
    """
    from dsv41_convert.kernels import fp8_dequant

    require_dtype(q, (torch.float8_e4m3fn,), "decode_fp8_blocks weight")
    require_dtype(s, (torch.float8_e8m0fnu, torch.float32), "decode_fp8_blocks scale")
    if q.dim() != 2 or s.dim() != 2 or q.numel() == 0 or dtype not in fp8_dequant.TL_DTYPES:
        return _back(q.device, fp8_ref.decode_fp8_blocks(q.cpu(), s.cpu(), block, dtype))[0]
    qc, sc = _cuda(q, s)
    return _back(q.device, fp8_dequant.decode_fp8_blocks(qc, sc, block, dtype))[0]


def encode_mxfp4(w: Tensor, block: int = 32, name: str = "<tensor>") -> tuple[Tensor, Tensor]:
    """quant.fp4.encode_mxfp4 on CUDA.

    w: [..., in]                 float32 / bfloat16 / float16, in even
    -> packed: [..., in/2]       float4_e2m1fn_x2 (logical [..., in])
       s: [..., ceil(in/block)]  float8_e8m0fnu
    """
    from dsv41_convert.kernels import fp4_act_quant

    fp4_ref.check_mxfp4_input(w, name)
    if w.numel() == 0 or not (2 <= block <= 256 and block & (block - 1) == 0):
        return _back(w.device, *fp4_ref.encode_mxfp4(w.cpu(), block, name))
    (wc,) = _cuda(w)
    n = w.size(-1)
    counter = torch.zeros(1, dtype=torch.int32, device=wc.device)
    packed, s = fp4_act_quant.quantize_rows(wc.contiguous().view(-1, n), block, False, False, counter)
    if int(counter.item()):
        require_finite(wc, name)
    lead = w.shape[:-1]
    packed = packed.view(torch.float4_e2m1fn_x2).view(*lead, n // 2)
    s = s.view(torch.float8_e8m0fnu).view(*lead, s.size(-1))
    return _back(w.device, packed, s)


def decode_mxfp4(packed: Tensor, s: Tensor, block: int = 32, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """quant.fp4.decode_mxfp4 on CUDA.

    packed: [..., in/2]          float4_e2m1fn_x2 / int8 / uint8 (logical [..., in])
    s: [..., ceil(in/block)]     float8_e8m0fnu
    -> [..., in]                 dtype
    """
    from dsv41_convert.kernels import fp4_dequant

    if packed.numel() == 0 or block < 2 or block % 2 or dtype not in fp4_dequant.TL_DTYPES:
        return _back(packed.device, fp4_ref.decode_mxfp4(packed.cpu(), s.cpu(), block, dtype))[0]
    pc, sc = _cuda(packed, s)
    return _back(packed.device, fp4_dequant.decode_mxfp4(pc, sc, block, dtype))[0]


def fp4_to_fp8(packed: Tensor, s: Tensor, block: int = 32, name: str = "<tensor>") -> tuple[Tensor, Tensor]:
    """quant.cast.fp4_to_fp8 on CUDA.

    packed: [out, in/2]                     float4_e2m1fn_x2 / int8 / uint8 (logical [out, in])
    s: [out, ceil(in/block)]                float8_e8m0fnu
    -> w8: [out, in]                        float8_e4m3fn
       s8: [ceil(out/32), ceil(in/32)]      float8_e8m0fnu
    """
    from dsv41_convert.kernels import fp4_to_fp8 as kernel

    take = (
        packed.dim() == 2
        and packed.numel() > 0
        and block == kernel.BLOCK
        and (2 * packed.size(1)) % kernel.BLOCK == 0
        and s.dtype == torch.float8_e8m0fnu
        and packed.dtype in (torch.float4_e2m1fn_x2, torch.int8, torch.uint8)
        and tuple(s.shape) == (packed.size(0), 2 * packed.size(1) // kernel.BLOCK)
    )
    if not take:
        return _back(packed.device, *cast_ref.fp4_to_fp8(packed.cpu(), s.cpu(), block, name))
    pc, sc = _cuda(packed, s)
    return _back(packed.device, *kernel.fp4_to_fp8(pc, sc, block, name))


def act_quant(
    x: Tensor,
    block_size: int = 32,
    scale_fmt: str | None = "ue8m0",
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
    inplace: bool = False,
) -> tuple[Tensor, Tensor] | Tensor:
    """quant.act.act_quant on CUDA (x must already be on the GPU; see kernels/act_quant.py)."""
    from dsv41_convert.kernels import act_quant as kernel

    if not x.is_cuda:
        return act_ref.act_quant(x, block_size, scale_fmt, scale_dtype, inplace)
    return kernel.act_quant(x, block_size, scale_fmt, scale_dtype, inplace)


def fp4_act_quant(
    x: Tensor, block_size: int = 32, inplace: bool = False, scale_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor] | Tensor:
    """quant.act.fp4_act_quant on CUDA (x must already be on the GPU; see kernels/fp4_act_quant.py)."""
    from dsv41_convert.kernels import fp4_act_quant as kernel

    if not x.is_cuda:
        return act_ref.fp4_act_quant(x, block_size, inplace, scale_dtype)
    return kernel.fp4_act_quant(x, block_size, inplace, scale_dtype)
