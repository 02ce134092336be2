"""Every decode path refuses the NaN bytes of a quantized source (quant/byte_checks.py): an e8m0 scale byte 255
and an e4m3 weight byte 0x7F or 0xFF raise FormatError naming the tensor and the first index, in the numpy
decoders (fp8_bytes, fp4_bytes, cast_bytes) and in transform.apply's torch path (on the CPU, and on CUDA
where there is one). Planted faults they catch: a decoder that skips the check (it would write 0x7FC0), a
scan that misses a byte off the block grid or in a ragged last block, a message naming a later index, a
false alarm on a clean array or on fp4 bytes 0x7F / 0xFF (e2m1 codes, not NaN). They cannot catch a wrong
but finite byte."""

import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsv41_convert.convert.transform import apply, quantizer_for
from dsv41_convert.errors import FormatError
from dsv41_convert.quant.byte_checks import Region, require_e4m3_not_nan, require_scales_not_nan
from dsv41_convert.quant.cast_bytes import fp4_to_fp8_bytes
from dsv41_convert.quant.checks import require_finite
from dsv41_convert.quant.fp4_bytes import decode_mxfp4_bf16
from dsv41_convert.quant.fp8_bytes import decode_fp8_blocks_bf16

ALL = np.arange(256, dtype=np.uint8)
FINITE_E4M3 = ALL[(ALL & 0x7F) != 0x7F]  # 254 bytes
FINITE_E8M0 = ALL[:255]


def _bytes(shape: tuple[int, int], values: np.ndarray, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).choice(values, size=shape).astype(np.uint8)


def _scale_error(at) -> str:
    return rf"w: scale is NaN \(e8m0 byte 255\) at \[{at[0]}, {at[1]}\]; expected a power of two; corrupt shard\?"


def _weight_error(byte: int, at) -> str:
    return rf"w: weight is NaN \(e4m3 byte {byte}\) at \[{at[0]}, {at[1]}\]; expected a finite e4m3 value"


def test_a_clean_array_passes():
    require_scales_not_nan(FINITE_E8M0.reshape(5, 51), "w")
    require_e4m3_not_nan(FINITE_E4M3.reshape(2, 127), "w")
    require_scales_not_nan(ALL[:0].reshape(0, 3), "w")
    require_e4m3_not_nan(ALL[:0], "w")


@pytest.mark.parametrize(("shape", "at"), [((8, 3), (0, 0)), ((5, 7), (4, 6)), ((33, 3), (17, 1))])
def test_a_nan_scale_is_named_by_its_first_index(shape, at):
    s = _bytes(shape, FINITE_E8M0)
    s[-1, -1] = 255  # a later one is not the one named
    s[at] = 255
    with pytest.raises(FormatError, match=_scale_error(at)):
        require_scales_not_nan(s, "w")


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
@pytest.mark.parametrize(("shape", "at"), [((64, 96), (37, 45)), ((33, 65), (32, 64)), ((5, 3), (0, 1))])
def test_a_nan_weight_byte_off_the_block_grid_is_named(byte, shape, at):
    q = _bytes(shape, FINITE_E4M3)
    q[-1, -1] = 0xFF if byte == 0x7F else 0x7F  # a later one is not the one named
    q[at] = byte
    with pytest.raises(FormatError, match=_weight_error(byte, at)):
        require_e4m3_not_nan(q, "w")


@pytest.mark.parametrize(("shape", "block"), [((33, 65), (32, 32)), ((130, 100), (128, 128)), ((5, 96), (1, 32))])
def test_decode_fp8_blocks_bf16_refuses_nan_scales_and_weight_bytes(shape, block):
    """Shapes not divisible by the block: the ragged last block is scanned too."""
    q = _bytes(shape, FINITE_E4M3)
    s = _bytes((-(-shape[0] // block[0]), -(-shape[1] // block[1])), np.arange(110, 140))
    assert decode_fp8_blocks_bf16(q, s, block, "w").shape == shape
    last = (s.shape[0] - 1, s.shape[1] - 1)
    bad_s = s.copy()
    bad_s[last] = 255
    with pytest.raises(FormatError, match=_scale_error(last)):
        decode_fp8_blocks_bf16(q, bad_s, block, "w")
    at = (shape[0] - 1, shape[1] - 2)
    q[at] = 0x7F
    with pytest.raises(FormatError, match=_weight_error(0x7F, at)):
        decode_fp8_blocks_bf16(q, s, block, "w")


def test_decode_mxfp4_bf16_refuses_a_nan_scale_not_fp4_bytes_0x7f_or_0xff():
    packed = np.tile(ALL, (6, 1))  # every packed byte, 0x7F and 0xFF included: e2m1 codes, never NaN
    s = _bytes((6, 16), np.arange(110, 140))
    assert decode_mxfp4_bf16(packed, s, 32, "w").shape == (6, 512)
    s[2, 11] = 255
    with pytest.raises(FormatError, match=_scale_error((2, 11))):
        decode_mxfp4_bf16(packed, s, 32, "w")


def test_the_fp4_to_fp8_cast_keeps_its_message():
    s = _bytes((40, 3), np.arange(120, 130))
    s[33, 2] = 255
    with pytest.raises(FormatError, match=_scale_error((33, 2))):
        fp4_to_fp8_bytes(np.zeros((40, 48), np.uint8), s, 32, "w")


def _inputs(action: str) -> list[torch.Tensor]:
    """One row block of `action`'s inputs: q [64, 96] e4m3 or p [64, 48] I8, and its e8m0 scales."""
    if action == "dequant_fp4":  # any byte, 0x7F and 0xFF included: e2m1 codes, never NaN
        packed = _bytes((64, 48), ALL)
        packed[0, :2] = (0x7F, 0xFF)
        return [torch.from_numpy(packed).view(torch.int8),
                torch.from_numpy(_bytes((64, 3), np.arange(120, 130))).view(torch.float8_e8m0fnu)]  # fmt: skip
    return [torch.from_numpy(_bytes((64, 96), FINITE_E4M3)).view(torch.float8_e4m3fn),
            torch.from_numpy(_bytes((2, 3), np.arange(120, 130))).view(torch.float8_e8m0fnu)]  # fmt: skip


DECODES = ["dequant_bf16", "dequant_fp4", "requant_fp4"]
NAN_CASES = [("dequant_bf16", "scale"), ("dequant_bf16", "weight"), ("dequant_fp4", "scale"),
             ("requant_fp4", "scale"), ("requant_fp4", "weight")]  # fmt: skip


def _plant(inputs: list[torch.Tensor], where: str) -> str:
    """Plant a NaN byte in the scale or the weight of `inputs` (in place) -> the message pattern expected."""
    if where == "scale":
        inputs[1].view(torch.uint8)[1, 2] = 255
        return _scale_error((1, 2))
    inputs[0].view(torch.uint8)[45, 67] = 0xFF
    return _weight_error(0xFF, (45, 67))


@pytest.mark.parametrize("action", DECODES)
def test_apply_decodes_clean_inputs(action):
    outs = apply(action, _inputs(action), quantizer_for("cpu"), "w", "BF16", (32, 32))
    assert outs[0].shape[0] == 64


@pytest.mark.parametrize(("action", "where"), NAN_CASES)
def test_apply_refuses_nan_bytes_on_the_cpu(action, where):
    inputs = _inputs(action)
    want = _plant(inputs, where)
    with pytest.raises(FormatError, match=want):
        apply(action, inputs, quantizer_for("cpu"), "w", "BF16", (32, 32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("action", "where"), NAN_CASES)
def test_apply_refuses_nan_bytes_on_cuda(action, where):
    """The device scan, then the host rule: the same message; a clean block (fp4 bytes 0x7F / 0xFF
    included) reaches the decoder."""
    seen = []

    def decoder(*args):
        seen.append(args[0].device.type)
        return torch.zeros(1, device="cuda")

    q = SimpleNamespace(device="cuda", decode_fp8_blocks=decoder, decode_mxfp4=decoder,
                        encode_mxfp4=lambda w, *a: (w, w))  # fmt: skip
    inputs = _inputs(action)
    apply(action, [x.clone() for x in inputs], q, "w", "BF16", (32, 32))
    assert seen == ["cuda"]
    want = _plant(inputs, where)
    with pytest.raises(FormatError, match=want):
        apply(action, inputs, q, "w", "BF16", (32, 32))


def test_the_numpy_decoders_import_without_torch():
    code = (
        "import sys\nimport dsv41_convert.quant.byte_checks, dsv41_convert.quant.fp8_bytes, "
        "dsv41_convert.quant.fp4_bytes, dsv41_convert.quant.cast_bytes\nassert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_region_of_a_tensor_is_named_at_the_tensors_own_index():
    """A row block from row 256 and column 64 of its tensor (a rank's columns, streamed): every decoder's
    message gives the index in the source tensor, of the values or of the scales (per block), not in the
    block's arrays (an audit: [72, 5] said for [200, 5])."""
    region = Region("w", 256, 64, (512, 192))
    s = _bytes((2, 3), np.arange(120, 130))
    s[1, 2] = 255
    with pytest.raises(FormatError, match=_scale_error((1 + 8, 2 + 2))):
        decode_fp8_blocks_bf16(_bytes((64, 96), FINITE_E4M3), s, (32, 32), region)
    q = _bytes((64, 96), FINITE_E4M3)
    q[45, 67] = 0x7F
    with pytest.raises(FormatError, match=_weight_error(0x7F, (45 + 256, 67 + 64))):
        decode_fp8_blocks_bf16(q, _bytes((2, 3), np.arange(120, 130)), (32, 32), region)
    s = _bytes((40, 3), np.arange(120, 130))
    s[33, 2] = 255
    with pytest.raises(FormatError, match=_scale_error((33 + 256, 2 + 2))):
        fp4_to_fp8_bytes(np.zeros((40, 48), np.uint8), s, 32, region)
    s[33, 2] = 254  # 2**127 x e2m1 4.0 (code 6) is 2**129; one scale per row and 32 columns
    packed = np.zeros((40, 48), np.uint8)
    packed[33, 36] = 0x60  # the high nibble: value 73 of the row
    with pytest.raises(FormatError, match=re.escape("block (289, 4) decodes to infinity at [289, 137]")):
        decode_mxfp4_bf16(packed, s, 32, region)
    x = torch.zeros(64, 96)
    x[45, 67] = float("inf")
    want = "found inf at index [301, 131] (1 non-finite of the 6144 read) in F32 [512, 192]"
    with pytest.raises(FormatError, match=re.escape(want)):
        require_finite(x, region)
    assert require_finite(torch.zeros(4), "w") is None  # a plain name: nothing to shift
