"""Number formats of the V4.1 checkpoint, as pure-torch CPU reference code (bit-exact, no module state).

e8m0 scales (e8m0.py):
    decode_e8m0, encode_e8m0_ceil, pow2_ceil
fp8 e4m3 block-scaled weights (fp8.py):
    encode_fp8_blocks, decode_fp8_blocks, infer_block, e4m3_saturate, e4m3_to_float, FP8_MAX
fp4 e2m1 codes and MXFP4 weights (fp4.py):
    E2M1_VALUES, encode_e2m1, decode_e2m1, pack_nibbles, unpack_nibbles,
    encode_mxfp4, decode_mxfp4, as_fp4, as_int8, FP4_MAX
MXFP4 -> fp8 lossless expert cast (cast.py; its rule in cast_bytes.py, numpy alone):
    fp4_to_fp8
activation quantizers of the model (act.py, upstream kernel.py semantics):
    act_quant, fp4_act_quant
safetensors dtype names as torch dtypes (file_dtypes.py, imported by its module path):
    SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS, tensor_from_bytes
NaN bytes of a quantized source, and blocks that decode to infinity, refused by every decoder (byte_checks.py,
numpy alone, imported by its module path):
    require_scales_not_nan, require_e4m3_not_nan, require_finite_blocks
The value of every e4m3, e8m0 and e2m1 code, as tables (code_values.py, numpy alone, imported by its path):
    E4M3_F32, E8M0_F32, E2M1_CODE_VALUES

Each docstring states the rounding, floors, clamps, shapes and dtypes.

Imports nothing of this package but `errors`: the bottom layer. The names are looked up lazily (PEP 562):
importing the package imports no torch.
"""

import importlib

_HOME = {  # each name's module: imported at the first use of a name, so that `quant.cast_bytes` (numpy
    # alone) is importable without torch
    "act_quant": "act",
    "fp4_act_quant": "act",
    "fp4_to_fp8": "cast",
    "decode_e8m0": "e8m0",
    "encode_e8m0_ceil": "e8m0",
    "pow2_ceil": "e8m0",
    **dict.fromkeys(
        (
            "E2M1_VALUES",
            "FP4_MAX",
            "as_fp4",
            "as_int8",
            "decode_e2m1",
            "decode_mxfp4",
            "encode_e2m1",
            "encode_mxfp4",
            "pack_nibbles",
            "unpack_nibbles",
        ),
        "fp4",
    ),
    **dict.fromkeys(
        ("FP8_MAX", "decode_fp8_blocks", "e4m3_saturate", "e4m3_to_float", "encode_fp8_blocks", "infer_block"), "fp8"
    ),
}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "E2M1_VALUES",
    "FP4_MAX",
    "FP8_MAX",
    "act_quant",
    "as_fp4",
    "as_int8",
    "decode_e2m1",
    "decode_e8m0",
    "decode_fp8_blocks",
    "decode_mxfp4",
    "e4m3_saturate",
    "e4m3_to_float",
    "encode_e2m1",
    "encode_e8m0_ceil",
    "encode_fp8_blocks",
    "encode_mxfp4",
    "fp4_act_quant",
    "fp4_to_fp8",
    "infer_block",
    "pack_nibbles",
    "pow2_ceil",
    "unpack_nibbles",
]
