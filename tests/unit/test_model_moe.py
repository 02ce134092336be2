"""Routing (sqrtsoftplus, bias for choice only, bias_vl on image tokens), the clamped SwiGLU
expert, and the MoE sum with the shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from model_testing import tiny_args

from dsv41_convert.model.moe import Expert, Gate, MoE


def _fill(module: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))


def test_gate_bias_chooses_but_does_not_weight():
    args = tiny_args(vision_n_layers=1)  # bias_vl exists only with vision
    gate = Gate(0, args)
    _fill(gate, 0)
    x = torch.randn(6, args.dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    scores = F.softplus(x.float() @ gate.weight.float().T).sqrt()
    with torch.no_grad():
        gate.bias.zero_()
        gate.bias[5] = 100.0  # always chosen, whatever its score
        gate.bias_vl.zero_()
        gate.bias_vl[6] = 100.0
    image = torch.tensor([False, True, False, True, False, False])
    weights, indices = gate(x, image)
    assert weights.dtype == torch.float32 and indices.shape == (6, 2)
    for t in range(6):
        forced = 6 if image[t] else 5
        assert forced in indices[t].tolist()
        raw = scores[t, indices[t]]
        # weights: the unbiased scores of the chosen experts, normalised, times route_scale
        torch.testing.assert_close(weights[t], raw / (raw.sum() + 1e-20) * args.route_scale, atol=0, rtol=1e-6)
    # without the vl bias, text bias applies everywhere
    _, text_only = gate(x, None)
    assert all(5 in row for row in text_only.tolist())


def test_expert_clamps_up_both_sides_gate_from_above():
    e = Expert(32, 32, dtype=torch.bfloat16, swiglu_limit=0.5)
    _fill(e, 2, std=1.0)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    w = torch.rand(4, 1, generator=torch.Generator().manual_seed(4))
    gate, up = F.linear(x, e.w1.weight).float(), F.linear(x, e.w3.weight).float()
    assert gate.max() > 0.5 and up.abs().max() > 0.5  # the clamps bite
    h = (w * F.silu(gate.clamp(max=0.5)) * up.clamp(-0.5, 0.5)).to(torch.bfloat16)
    assert torch.equal(e(x, w), F.linear(h, e.w2.weight))


def test_moe_is_routed_sum_plus_shared_expert():
    args = tiny_args(dtype="bf16", expert_dtype=None)  # bf16 experts: exact reference arithmetic
    from dsv41_convert.model.layers import dense_dtype

    with dense_dtype(args):
        moe = MoE(0, args)
    _fill(moe, 5)
    assert moe.experts[0].w1.weight.dtype == torch.bfloat16
    assert all(e is not None for e in moe.experts)  # one rank holds every expert
    x = torch.randn(2, 7, args.dim, generator=torch.Generator().manual_seed(6)).bfloat16()
    y = moe(x)
    flat = x.view(-1, args.dim)
    weights, indices = moe.gate(flat)
    want = torch.zeros(flat.shape, dtype=torch.float32)
    for e in range(args.n_routed_experts):  # same expert order and fp32 accumulation as documented
        rows, slot = torch.where(indices == e)
        if rows.numel():
            want[rows] += moe.experts[e](flat[rows], weights[rows, slot, None])
    want += moe.shared_experts(flat)
    assert torch.equal(y, want.bfloat16().view_as(x))
