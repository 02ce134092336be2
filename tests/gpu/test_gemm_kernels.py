"""fp8_gemm and fp4_gemm against kernels.ref within the bound their kernel files state:
|C - C_ref| <= 2**-7 |C_ref| + 2**-12 (|A| @ |B|^T, scaled)."""

import pytest
import torch

from dsv41_convert.kernels import ref
from dsv41_convert.quant import act as act_ref
from dsv41_convert.quant import fp4 as fp4_ref
from dsv41_convert.quant import fp8 as fp8_ref

pytestmark = pytest.mark.gpu


def abs_e4m3(t):
    return (t.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def abs_e2m1(t):
    return (t.view(torch.uint8) & 0x77).view(torch.float4_e2m1fn_x2)


def check(got, want, mag, what):
    got, want, mag = got.float().cpu(), want.float().cpu(), mag.float().cpu()
    bound = 2**-7 * want.abs() + 2**-12 * mag
    err = (got - want).abs()
    assert bool((err <= bound).all()), (
        f"{what}: max err {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"
    )
    assert (got == want).float().mean().item() > 0.5, f"{what}: fewer than half the outputs bit-equal"


@pytest.mark.parametrize("block,fmt,sdtype", [(32, "ue8m0", torch.float8_e8m0fnu), (128, None, torch.float32)])
@pytest.mark.parametrize("m", [1, 100])
def test_fp8_gemm(block, fmt, sdtype, m):
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(5)
    n, k = 512, 1024
    x = torch.randn(m, k, generator=g).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().cuda()
    a, a_s = act_ref.act_quant(x, block, fmt, sdtype)
    b, b_s = fp8_ref.encode_fp8_blocks(w, (block, block), fmt, "w")
    b_s = b_s.to(sdtype)
    got = fp8_gemm(a, a_s, b, b_s, sdtype, block)
    want = ref.fp8_gemm(a, a_s, b, b_s, sdtype, block)
    mag = ref.fp8_gemm(abs_e4m3(a), a_s, abs_e4m3(b), b_s, sdtype, block)
    check(got, want, mag, f"fp8_gemm block={block} m={m}")


@pytest.mark.parametrize("act_block,fmt,sdtype", [(32, "ue8m0", torch.float8_e8m0fnu), (128, None, torch.float32)])
@pytest.mark.parametrize("m", [3, 100])
def test_fp4_gemm(act_block, fmt, sdtype, m):
    from dsv41_convert.kernels.fp4_gemm import fp4_gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(6)
    n, k = 256, 1024
    x = torch.randn(m, k, generator=g).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().cuda()
    a, a_s = act_ref.act_quant(x, act_block, fmt, sdtype)
    b, b_s = (t.cuda() for t in fp4_ref.encode_mxfp4(w.cpu(), 32, "w"))
    got = fp4_gemm(a, a_s, b, b_s, sdtype, act_block)
    want = ref.fp4_gemm(a, a_s, b, b_s, sdtype, act_block)
    mag = ref.fp4_gemm(abs_e4m3(a), a_s, abs_e2m1(b), b_s, sdtype, act_block)
    check(got, want, mag, f"fp4_gemm act_block={act_block} m={m}")
