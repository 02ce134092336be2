"""Linear dispatch on the weight dtype, parameter layouts, RMSNorm and RoPE."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from model_testing import tiny_args

from dsv41_convert.model.layers import (
    ColumnParallelLinear,
    Linear,
    ParallelEmbedding,
    RMSNorm,
    RowParallelLinear,
    default_dtype,
    dense_dtype,
)
from dsv41_convert.model.rope import apply_rotary_emb, precompute_freqs_cis
from dsv41_convert.quant.act import act_quant
from dsv41_convert.quant.fp4 import decode_mxfp4, encode_mxfp4
from dsv41_convert.quant.fp8 import decode_fp8_blocks, encode_fp8_blocks


def test_linear_layouts():
    fp8 = Linear(64, 40)  # default outside a model: the published fp8
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.weight.shape == (40, 64)
    assert fp8.scale.dtype == torch.float8_e8m0fnu and fp8.scale.shape == (2, 2)  # ceil(40/32), 64/32
    assert fp8.weight.scale is fp8.scale
    fp4 = Linear(64, 40, dtype=torch.float4_e2m1fn_x2)
    assert fp4.weight.shape == (40, 32) and fp4.scale.shape == (40, 2)
    bf16 = Linear(64, 40, dtype=torch.bfloat16)
    assert bf16.scale is None and bf16.weight.dtype == torch.bfloat16
    assert set(dict(bf16.named_parameters())) == {"weight"}
    with dense_dtype(tiny_args(dtype="bf16", expert_dtype=None)):
        assert default_dtype() == torch.bfloat16 and Linear(32, 32).weight.dtype == torch.bfloat16
    assert default_dtype() == torch.float8_e4m3fn
    assert ColumnParallelLinear(64, 96).weight.shape == (96, 64)  # world size 1: nothing split
    assert RowParallelLinear(64, 96).weight.shape == (96, 64)
    assert ParallelEmbedding(10, 4).weight.dtype == torch.bfloat16


def _x(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_fp8_linear_is_quantized_activation_times_dequantized_weight():
    lin = Linear(96, 48)
    w, s = encode_fp8_blocks(torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.1)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.scale.copy_(s)
    x = _x(1, 2, 3, 96)
    xq, xs = act_quant(x, 32)
    x_deq = (xq.double().unflatten(-1, (-1, 32)) * xs.double().unsqueeze(-1)).flatten(-2)
    want = (x_deq @ decode_fp8_blocks(w, s, dtype=torch.float32).double().T).bfloat16()
    torch.testing.assert_close(lin(x).double(), want.double(), atol=1e-6, rtol=2**-8)


def test_fp4_linear_is_quantized_activation_times_dequantized_weight():
    lin = Linear(64, 32, dtype=torch.float4_e2m1fn_x2)
    w, s = encode_mxfp4(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.scale.copy_(s)
    x = _x(3, 5, 64)
    xq, xs = act_quant(x, 32)
    x_deq = (xq.double().unflatten(-1, (-1, 32)) * xs.double().unsqueeze(-1)).flatten(-2)
    want = (x_deq @ decode_mxfp4(w, s, dtype=torch.float32).double().T).bfloat16()
    torch.testing.assert_close(lin(x).double(), want.double(), atol=1e-6, rtol=2**-8)


def test_bf16_and_fp32_linear_are_plain():
    for dtype in (torch.bfloat16, torch.float32):
        lin = Linear(32, 16, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(16, 32, generator=torch.Generator().manual_seed(4)))
        x = _x(5, 3, 32).to(dtype)
        assert torch.equal(lin(x), F.linear(x, lin.weight))


def test_rmsnorm_formula():
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    x = _x(6, 4, 64)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    xd = x.double()
    want = norm.weight.double() * xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y.double(), want.bfloat16().double(), atol=0, rtol=2**-8)


def test_rope_rotates_pairs_and_inverse_undoes_it():
    freqs = precompute_freqs_cis(16, 32, 0, 10000.0, 4.0, 32, 1)
    assert freqs.shape == (32, 8) and freqs.dtype == torch.complex64
    # plain RoPE: angle = position * theta^(-2k/dim)
    k = torch.arange(8)
    angle = 5 * 10000.0 ** (-2 * k / 16)
    torch.testing.assert_close(freqs[5], torch.polar(torch.ones(8), angle.float()), atol=1e-6, rtol=0)
    x = _x(7, 2, 32, 3, 16)
    y = apply_rotary_emb(x.clone(), freqs)
    pair_norm = lambda t: t.float().unflatten(-1, (-1, 2)).norm(dim=-1)
    torch.testing.assert_close(pair_norm(y), pair_norm(x), atol=0, rtol=2**-7)
    back = apply_rotary_emb(y.clone(), freqs, inverse=True)
    torch.testing.assert_close(back.float(), x.float(), atol=2e-2, rtol=2**-7)
    # 3-d input ([b, s, d]) rotates the same way as one head of a 4-d input
    y3 = apply_rotary_emb(x[:, :, 0].clone(), freqs)
    assert torch.equal(y3, y[:, :, 0])


def test_yarn_keeps_fast_dims_and_slows_slow_dims():
    dim, base, factor, orig = 64, 10000.0, 16.0, 4096
    plain = precompute_freqs_cis(dim, 2, 0, base, factor, 32, 1)[1].angle()
    yarn = precompute_freqs_cis(dim, 2, orig, base, factor, 32, 1)[1].angle()

    def turns_dim(turns):
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = math.floor(turns_dim(32)), math.ceil(turns_dim(1))
    assert torch.equal(yarn[:lo], plain[:lo])  # many turns over the context: unchanged
    torch.testing.assert_close(yarn[hi:], plain[hi:] / factor, atol=1e-7, rtol=1e-6)  # few turns: / factor
    mid = yarn[lo:hi] / plain[lo:hi]
    assert bool(((mid <= 1 + 1e-6) & (mid >= 1 / factor - 1e-6)).all())


@pytest.mark.parametrize("bad", ["column", "row", "embed"])
def test_parallel_layers_reject_indivisible_sizes(bad, monkeypatch):
    from dsv41_convert.model import parallel

    monkeypatch.setattr(parallel, "world_size", lambda: 3)
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        if bad == "column":
            ColumnParallelLinear(32, 64)
        elif bad == "row":
            RowParallelLinear(64, 32)
        else:
            ParallelEmbedding(64, 8)
