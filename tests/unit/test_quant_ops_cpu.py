"""kernels/quant_ops.py's CPU paths: the inputs no kernel takes (an odd or non-power-of-two block, a dtype
the kernels do not write, an activation on the CPU) go to the quant/ reference with every argument passed
on. Checked against tests/quant_reference.py and bit-field arithmetic, not against quant/ itself.

Planted faults they catch: a fallback that drops or fixes an argument (scale_fmt, dtype, block,
scale_dtype). Cannot catch: anything on the CUDA side (tests/gpu/test_quant_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_reference import E4M3_POS, MAGS, ceil_exp, e4m3_ref, e4m3_value, encode_ref, mxfp4_ref

pytest.importorskip("tilelang")  # quant_ops imports a kernel module before it picks the CPU path

from dsv41_convert.kernels import quant_ops


def _weight(out: int, inp: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=gen) * torch.exp2(torch.randint(-6, 6, (out, 1), generator=gen).float())


def _e4m3_values(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor([e4m3_value(int(b)) for b in q.view(torch.uint8).flatten()], dtype=torch.float64).view(q.shape)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_encode_fp8_blocks_with_an_odd_block_keeps_the_scale_format(scale_fmt):
    w = _weight(10, 20, 1)
    q, s = quant_ops.encode_fp8_blocks(w, (3, 7), scale_fmt, "w")
    q_ref, s_ref = encode_ref(w.numpy(), 3, 7, ue8m0=scale_fmt is not None)
    assert s.dtype == (torch.float8_e8m0fnu if scale_fmt else torch.float32)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy(), q_ref)
    np.testing.assert_array_equal(s.float().numpy(), s_ref.astype(np.float32))


def test_decode_fp8_blocks_to_float64_keeps_the_dtype():
    """float64 is no kernel's output dtype: the reference decodes, in float64 as asked (exact products)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 256, (40, 70), generator=gen, dtype=torch.int32).to(torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0
    q = q.view(torch.float8_e4m3fn)
    s = torch.randint(110, 140, (2, 3), generator=gen, dtype=torch.int32).to(torch.uint8)
    got = quant_ops.decode_fp8_blocks(q, s.view(torch.float8_e8m0fnu), (32, 32), torch.float64)
    exps = (s.long() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)[:40, :70]
    assert got.dtype == torch.float64
    assert torch.equal(got, _e4m3_values(q) * torch.exp2(exps.double()))


def test_encode_mxfp4_with_a_block_no_kernel_takes():
    w = _weight(4, 96, 3)
    packed, s = quant_ops.encode_mxfp4(w, 24, "w")
    codes_ref, exps_ref = mxfp4_ref(w.numpy(), 24)
    assert s.shape == (4, 4)
    packed_u8 = packed.view(torch.uint8)
    codes = torch.stack([packed_u8 & 15, packed_u8 >> 4], -1).flatten(-2)
    np.testing.assert_array_equal(codes.numpy(), codes_ref)
    np.testing.assert_array_equal(s.view(torch.uint8).numpy(), exps_ref + 127)


def test_fp4_to_fp8_with_a_16_block_keeps_the_values():
    """fp4 scales per 16 columns (no kernel): the fp8 weight decodes to the fp4 weight's own values."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (40, 64), generator=gen, dtype=torch.int32)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    e = torch.randint(-3, 3, (40, 4), generator=gen, dtype=torch.int32)
    w8, s8 = quant_ops.fp4_to_fp8(packed, (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu), 16, "w")
    signs = torch.where(codes >= 8, -1.0, 1.0).double()
    want = signs * torch.from_numpy(MAGS)[codes & 7] * torch.exp2(e.double()).repeat_interleave(16, 1)
    s8_exps = (s8.view(torch.uint8).long() - 127).repeat_interleave(32, 0).repeat_interleave(32, 1)[:40, :64]
    assert torch.equal(_e4m3_values(w8) * torch.exp2(s8_exps.double()), want)


@pytest.mark.parametrize(("scale_fmt", "scale_dtype"), [(None, torch.float32), ("ue8m0", torch.float32)])
def test_act_quant_on_the_cpu_keeps_the_scale_dtype(scale_fmt, scale_dtype):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 128, generator=gen) * 10).bfloat16()
    _, s = quant_ops.act_quant(x, 32, scale_fmt, scale_dtype)
    amax = np.maximum(np.abs(x.float().numpy()).reshape(3, 4, 32).max(-1), np.float32(1e-4))
    want = (amax * np.float32(1 / 448)).astype(np.float32)
    if scale_fmt:
        want = np.exp2(ceil_exp(want)).astype(np.float32)
    assert s.dtype == scale_dtype
    np.testing.assert_array_equal(s.numpy(), want)


def test_fp4_act_quant_on_the_cpu_keeps_the_scale_dtype():
    """Block 32 with e4m3 scales (upstream's other path, asked for explicitly): scale = e4m3(amax / 6)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 64, generator=gen).bfloat16()
    _, s = quant_ops.fp4_act_quant(x, 32, False, torch.float8_e4m3fn)
    assert s.dtype == torch.float8_e4m3fn
    amax = np.abs(x.float().numpy()).reshape(2, 2, 32).max(-1).astype(np.float64)
    np.testing.assert_array_equal(s.float().numpy(), E4M3_POS[e4m3_ref(amax / 6)])  # amax > 0: byte = index
