"""The model kernels against their references: activation quantizers bit-exact, Sinkhorn and sparse
attention within the bounds their kernel files state."""

import pytest
import torch
from kernel_bytes import same_bytes

from dsv41_convert.kernels import ref
from dsv41_convert.quant import act as act_ref

pytestmark = pytest.mark.gpu


def acts(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1), generator=g).float())
    x.view(-1, shape[-1])[0, :64] = 0.0  # a zero group: the amax floor
    x.view(-1, shape[-1])[1, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # fp4 ties
    return x.to(torch.bfloat16)


def same_act_quant(x, block, fmt, sdtype):
    """act_quant's codes and scales on CUDA are the bytes quant.act makes on the CPU."""
    from dsv41_convert.kernels.act_quant import act_quant

    q, s = act_quant(x.cuda(), block, fmt, sdtype)
    q_ref, s_ref = act_ref.act_quant(x, block, fmt, sdtype)
    same_bytes(q, q_ref, "q")
    same_bytes(s, s_ref, "s")


def same_fp4_act_quant(x, block):
    """fp4_act_quant's packed codes and scales on CUDA are the bytes quant.act makes on the CPU."""
    from dsv41_convert.kernels.fp4_act_quant import fp4_act_quant

    p, s = fp4_act_quant(x.cuda(), block)
    p_ref, s_ref = act_ref.fp4_act_quant(x, block)
    same_bytes(p, p_ref, "packed")
    same_bytes(s, s_ref, "scale")


ACT_FORMATS = [(32, "ue8m0", torch.float8_e8m0fnu), (128, None, torch.float32), (128, "ue8m0", torch.float32)]


@pytest.mark.parametrize("block,fmt,sdtype", ACT_FORMATS)
def test_act_quant(block, fmt, sdtype):
    from dsv41_convert.kernels.act_quant import act_quant

    x = acts((3, 37, 1024), 1)
    same_act_quant(x, block, fmt, sdtype)
    y = x.cuda().clone()
    assert act_quant(y, block, fmt, sdtype, inplace=True) is y
    same_bytes(y, act_ref.act_quant(x.clone(), block, fmt, sdtype, inplace=True), "inplace")


@pytest.mark.parametrize("block", [32, 16])
def test_fp4_act_quant(block):
    from dsv41_convert.kernels.fp4_act_quant import fp4_act_quant

    x = acts((2, 41, 512), 2)
    same_fp4_act_quant(x, block)
    y = x.cuda().clone()
    assert fp4_act_quant(y, block, True) is y
    same_bytes(y, act_ref.fp4_act_quant(x.clone(), block, True), "inplace")


def test_hc_split_sinkhorn():
    from dsv41_convert.kernels.hc_split_sinkhorn import hc_split_sinkhorn

    g = torch.Generator().manual_seed(3)
    mixes = torch.randn(2, 300, 24, generator=g) * 3
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g)
    got = hc_split_sinkhorn(mixes.cuda(), scale.cuda(), base.cuda(), 4, 20, 1e-6)
    want = ref.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    for name, a, b in zip(("pre", "post", "comb"), got, want, strict=True):
        # bound from the kernel file: expf may differ from torch's exp by an ulp or two
        torch.testing.assert_close(a.cpu(), b, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("h", [16, 8])
def test_sparse_attn(h):
    from dsv41_convert.kernels.sparse_attn import sparse_attn

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(4)
    b, m, n, d, topk = 2, 5, 300, 512, 200
    q = torch.randn(b, m, h, d, generator=g).bfloat16()
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idx = torch.randint(0, n, (b, m, topk), generator=g, dtype=torch.int32)
    idx[:, :, 150:] = -1  # a masked tail
    idx[0, 1, :] = -1  # a row with nothing: output 0
    idx[1, 2, 64:128] = -1  # a whole masked block in the middle
    scale = d**-0.5
    got = sparse_attn(q.cuda(), kv.cuda(), sink.cuda(), idx.cuda(), scale).float().cpu()
    want = ref.sparse_attn(q.cuda(), kv.cuda(), sink.cuda(), idx.cuda(), scale).float().cpu()
    assert torch.equal(got[0, 1], torch.zeros_like(got[0, 1]))
    # bound from the kernel file: one bf16 ulp plus a bf16-probability flip weighted by max|v|
    bound = 2**-7 * want.abs() + 2**-8 * kv.float().abs().max()
    err = (got - want).abs()
    assert bool((err <= bound).all()), f"max err {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


def test_sparse_attn_padding_changes_no_bit():
    """Indices padded with -1 (whole masked blocks, another compiled bucket) give the same bytes."""
    from dsv41_convert.kernels.sparse_attn import sparse_attn
    from dsv41_convert.kernels.topk import topk_bucket

    g = torch.Generator().manual_seed(5)
    b, m, n, d, h, topk = 1, 7, 400, 512, 16, 70
    q = torch.randn(b, m, h, d, generator=g).bfloat16().cuda()
    kv = torch.randn(b, n, d, generator=g).bfloat16().cuda()
    sink = torch.randn(h, generator=g).cuda()
    idx = torch.randint(0, n, (b, m, topk), generator=g, dtype=torch.int32).cuda()
    idx[0, 3, 10:] = -1
    scale = d**-0.5
    padded = torch.nn.functional.pad(idx, (0, 300), value=-1)
    assert topk_bucket(topk) == 128 and topk_bucket(topk + 300) == 512
    assert torch.equal(sparse_attn(q, kv, sink, idx, scale), sparse_attn(q, kv, sink, padded, scale))


def nonfinite_acts(shape, seed):
    """acts() with NaN, +Inf and -Inf planted in some groups (one kind per group, and all three in one)."""
    x = acts(shape, seed).float()
    rows = x.view(-1, shape[-1])
    rows[2, 5], rows[3, 40], rows[4, 70] = float("nan"), float("inf"), float("-inf")
    rows[5, 0], rows[5, 1], rows[5, 2] = float("nan"), float("inf"), float("-inf")
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("block,fmt,sdtype", ACT_FORMATS)
def test_act_quant_non_finite(block, fmt, sdtype):
    same_act_quant(nonfinite_acts((2, 9, 1024), 3), block, fmt, sdtype)


@pytest.mark.xfail(
    strict=True,
    reason="known divergence: e2m1 has no NaN code; the kernel clamps a NaN/Inf group, the reference does not "
    "(H200 2026-11-30: 34 / 16 of 4608 packed bytes differ). Activations only: weight encoders raise on NaN/Inf",
)
@pytest.mark.parametrize("block", [32, 16])
def test_fp4_act_quant_non_finite(block):
    same_fp4_act_quant(nonfinite_acts((2, 9, 512), 4), block)
