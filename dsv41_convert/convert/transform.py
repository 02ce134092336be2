"""Per-chunk tensor operations of the plan's actions, through the quantizers of quant/ (or the kernels).

Each action takes row-chunks of its source tensors and returns its outputs for those rows:

  cast            x [rows, ...] any float             -> (x in the output dtype,)
  dequant_bf16    q [rows, in] e4m3, s [rows/bo, in/bi] e8m0   -> (w [rows, in] bf16,)
  dequant_fp4     p [rows, in/2] I8 (e2m1 pairs), s [rows, in/32] e8m0     -> (w [rows, in] bf16,)
  fp4_to_fp8      p [rows, in/2] I8 (e2m1 pairs), s [rows, in/32] e8m0
                                                      -> (w [rows, in] e4m3, s [rows/32, in/32] e8m0)
  requant_fp4     q [rows, in] e4m3, s [rows/32, in/32] e8m0  -> decoded in float32, then quant_fp4
  quant_fp8       w [rows, in] bf16/f32               -> (q [rows, in] e4m3, s [ceil(rows/32), ceil(in/32)] e8m0)
  quant_fp4       w [rows, in] bf16/f32               -> (p [rows, in/2] e2m1 pairs, s [rows, in/32] e8m0)
  quant_fp4_fp8   w [rows, in] bf16/f32               -> quant_fp4 then fp4_to_fp8
  quant_rows_fp8  w [rows, in] bf16/f32               -> (q [rows, in] e4m3, s [rows, in/32] e8m0)

Row chunks start on multiples of 128, so a chunk never splits a 32x32 or 128x128 block.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch
from torch import Tensor

from dsv41_convert.errors import FormatError
from dsv41_convert.quant.file_dtypes import SAFETENSORS_DTYPES

DTYPES = SAFETENSORS_DTYPES  # the converter's name for the one table
KERNEL_MODULE = "dsv41_convert.kernels.quant_ops"  # same four functions, TileLang on CUDA


def quantizer_for(device: str) -> SimpleNamespace:
    """The quantization functions for `device`: quant/ on "cpu", the TileLang kernels on "cuda".

    -> namespace with encode_fp8_blocks, decode_fp8_blocks, encode_mxfp4, decode_mxfp4, fp4_to_fp8 and `device`
    """
    from dsv41_convert.quant import cast, fp4, fp8

    funcs = {
        "encode_fp8_blocks": fp8.encode_fp8_blocks,
        "decode_fp8_blocks": fp8.decode_fp8_blocks,
        "encode_mxfp4": fp4.encode_mxfp4,
        "decode_mxfp4": fp4.decode_mxfp4,
        "fp4_to_fp8": cast.fp4_to_fp8,
    }
    if device == "cuda":
        kernels = importlib.import_module(KERNEL_MODULE)
        funcs = {k: getattr(kernels, k, v) for k, v in funcs.items()}
    elif device != "cpu":
        raise ValueError(f"device {device!r}: expected cpu or cuda")
    return SimpleNamespace(device=device, **funcs)


def apply(
    action: str, inputs: list[Tensor], q: SimpleNamespace, name: str, out_dtype: str, block, to_host: bool = True
) -> tuple:
    """Run `action` on one row chunk; see the module docstring for shapes. Outputs are on the CPU, or with
    `to_host` False on the quantizer's device (the caller copies them back: convert/stream.py). The decoding
    actions raise FormatError naming `name` and the first index of a NaN scale or e4m3 weight byte."""
    if q.device != "cpu":
        inputs = [x.to(q.device) for x in inputs]
    if action in ("dequant_bf16", "dequant_fp4", "requant_fp4"):
        # NaN bytes are refused by quant/byte_checks.py's rule on host bytes (zero-copy views on the CPU); on
        # CUDA a scan on the device comes first (one sync per block, as the kernels' own checks make), and
        # the bytes come over only when it finds one
        from dsv41_convert.quant import byte_checks as bc

        s8 = inputs[1].view(torch.uint8)
        w8 = inputs[0].view(torch.uint8) if action != "dequant_fp4" else s8[:0]  # e2m1 codes have no NaN
        codes = "e2m1" if action == "dequant_fp4" else "e4m3"
        if not s8.is_cuda or bool((s8 >= bc.HOT[codes]).any() | ((w8 & bc.E4M3_NAN) == bc.E4M3_NAN).any()):
            s_host = s8.cpu().numpy()
            w_block = (1, 32) if action == "dequant_fp4" else tuple(block)
            bc.require_scales_not_nan(s_host, name, w_block)
            bc.require_e4m3_not_nan(w8.cpu().numpy(), name)
            w_host = inputs[0].view(torch.uint8).cpu().numpy()
            bc.require_finite_blocks(w_host, s_host, w_block, codes, name, bc.DECODED_INF)
    if action == "cast":
        outs = (inputs[0].to(DTYPES[out_dtype]),)
        if outs[0].is_floating_point() and not bool(torch.isfinite(outs[0]).all()):
            _require_cast_in_range(inputs[0], outs[0], name)
    elif action == "dequant_bf16":
        outs = (q.decode_fp8_blocks(inputs[0], inputs[1], tuple(block), torch.bfloat16),)
    elif action == "dequant_fp4":
        outs = (q.decode_mxfp4(inputs[0].view(torch.float4_e2m1fn_x2), inputs[1], 32, torch.bfloat16),)
    elif action == "requant_fp4":
        w = q.decode_fp8_blocks(inputs[0], inputs[1], tuple(block), torch.float32)  # exact in float32
        outs = q.encode_mxfp4(w, 32, name)
    elif action == "fp4_to_fp8":
        outs = q.fp4_to_fp8(inputs[0].view(torch.float4_e2m1fn_x2), inputs[1], 32, name)
    elif action == "quant_fp8":
        outs = q.encode_fp8_blocks(inputs[0], (32, 32), "ue8m0", name)
    elif action == "quant_rows_fp8":
        outs = q.encode_fp8_blocks(inputs[0], (1, 32), "ue8m0", name)
    elif action == "quant_fp4":
        outs = q.encode_mxfp4(inputs[0], 32, name)
    elif action == "quant_fp4_fp8":
        packed, s = q.encode_mxfp4(inputs[0], 32, name)
        _require_finite_encoding((packed, s), *ENCODED["quant_fp4"], name)  # before the cast calls it corrupt
        outs = q.fp4_to_fp8(packed, s, 32, name)
    else:
        raise ValueError(f"{name}: unknown action {action!r}")
    if action in ENCODED:
        _require_finite_encoding(outs, *ENCODED[action], name)
    return tuple(o.cpu() for o in outs) if to_host else tuple(outs)


def _require_cast_in_range(x: Tensor, y: Tensor, name: str) -> None:
    """FormatError where the source holds a NaN or an infinity (refused as in a copied tensor: write._copy), or
    where the cast made infinity of a finite value (an f32 value beyond bf16's range rounds to inf)."""
    from dsv41_convert.quant.byte_checks import COPIED_TOO, source_index
    from dsv41_convert.quant.checks import require_finite

    require_finite(x, name, COPIED_TOO)
    made = torch.isinf(y)
    if bool(made.any()):
        first = [int(i) for i in made.nonzero()[0]]
        at = source_index(name, first)
        raise FormatError(
            f"{name}: {float(x[tuple(first)]):g} at index {at} is beyond {y.dtype}'s range (the cast makes it "
            f"inf; {int(made.sum())} such of {x.numel()}); check the source tensor"
        )


# the actions that write quantized weights: what their (weight, scale) outputs hold
ENCODED = {
    "quant_fp8": ("e4m3", (32, 32)),
    "quant_rows_fp8": ("e4m3", (1, 32)),
    "quant_fp4": ("e2m1", (1, 32)),
    "requant_fp4": ("e2m1", (1, 32)),
    "fp4_to_fp8": ("e4m3", (32, 32)),
    "quant_fp4_fp8": ("e4m3", (32, 32)),
}


def _require_finite_encoding(outs: tuple, codes: str, block: tuple[int, int], name: str) -> None:
    """FormatError where an encoded block decodes to infinity (a source value near the bfloat16 maximum rounds
    up to 2**128): one max over the scales (a sync on CUDA), the blocks looked at only above the line."""
    from dsv41_convert.quant import byte_checks as bc

    w, s = outs[0].view(torch.uint8), outs[1].view(torch.uint8)
    if s.numel() and int(s.max()) >= bc.HOT[codes]:
        why = "no finite encoding holds a source value this large; check the source tensor"
        bc.require_finite_blocks(w.cpu().numpy(), s.cpu().numpy(), block, codes, name, why)


def to_bytes(t: Tensor) -> memoryview:
    """The raw bytes of a tensor in row-major order (fp4 pairs and fp8 as their bytes)."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


def from_bytes(buf: bytearray | memoryview, dtype: str, rows: int, row_bytes: int) -> Tensor:
    """A [rows, row_bytes / itemsize] tensor sharing `buf`'s memory.

    buf: rows * row_bytes bytes  -> [rows, cols]  DTYPES[dtype]
    """
    raw = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return raw.view(rows, row_bytes).view(DTYPES[dtype])
