"""Where the model rounds, pinned bit for bit (upstream equality is bit-exact, so one rounding moved
is a fault even when the values stay close)."""

from __future__ import annotations

import torch

from dsv41_convert.model.layers import RMSNorm


def test_rmsnorm_rounds_once_after_the_weight():
    """fp32 x * rsqrt(mean(x^2) + eps), times the bf16 weight in fp32, then one bf16 rounding."""
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(256, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.03 * (1 + 0.1 * torch.randn(256, generator=gen)))  # off-grid products
    x = torch.randn(64, 256, generator=gen).bfloat16()
    xf = x.float()
    want = (norm.weight.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6))).bfloat16()
    assert torch.equal(norm(x), want)
