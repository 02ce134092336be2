"""Number formats of the V4.1 checkpoint, as pure-torch CPU reference code (bit-exact, no module state).

e8m0 scales (e8m0.py):
    decode_e8m0, encode_e8m0_ceil, pow2_ceil
fp8 e4m3 block-scaled weights (fp8.py):
    encode_fp8_blocks, decode_fp8_blocks, infer_block, e4m3_saturate, e4m3_to_float, FP8_MAX
fp4 e2m1 codes and MXFP4 weights (fp4.py):
    E2M1_VALUES, encode_e2m1, decode_e2m1, pack_nibbles, unpack_nibbles,
    encode_mxfp4, decode_mxfp4, as_fp4, as_int8, FP4_MAX
MXFP4 -> fp8 lossless expert cast (cast.py):
    fp4_to_fp8
activation quantizers of the model (act.py, upstream kernel.py semantics):
    act_quant, fp4_act_quant

Each docstring states the rounding, floors, clamps, shapes and dtypes.

Imports nothing of this package but `errors`: the bottom layer.
"""

from dsv41_convert.quant.act import act_quant, fp4_act_quant
from dsv41_convert.quant.cast import fp4_to_fp8
from dsv41_convert.quant.e8m0 import decode_e8m0, encode_e8m0_ceil, pow2_ceil
from dsv41_convert.quant.fp4 import (
    E2M1_VALUES,
    FP4_MAX,
    as_fp4,
    as_int8,
    decode_e2m1,
    decode_mxfp4,
    encode_e2m1,
    encode_mxfp4,
    pack_nibbles,
    unpack_nibbles,
)
from dsv41_convert.quant.fp8 import (
    FP8_MAX,
    decode_fp8_blocks,
    e4m3_saturate,
    e4m3_to_float,
    encode_fp8_blocks,
    infer_block,
)

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
