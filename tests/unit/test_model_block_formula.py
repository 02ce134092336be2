"""The hyper-connection wiring of a Block, written out copy by copy, with the attention and the MoE
replaced by fixed stand-ins: the collapse weights lag one sublayer (attention collapses with the
pre_mix handed in, the FFN with the attention step's `pre`, the FFN step's `pre` goes to the next
block), and new copy j = post[j] * out + sum_i comb[i, j] * residual[i].

The Sinkhorn split is the kernel reference (tested against its definition in
test_model_ref_kernels.py); everything around it is restated here.
"""

from __future__ import annotations

import torch
from model_testing import tiny_args
from torch import nn

from dsv41_convert.kernels.ref import hc_split_sinkhorn
from dsv41_convert.model.block import Block
from dsv41_convert.model.layers import dense_dtype

ARGS = tiny_args(dtype="bf16", expert_dtype=None)


class _Attn(nn.Module):
    def forward(self, x, start_pos, *args):
        return (torch.tanh(x.float()) * 2 + 0.1).bfloat16()


class _Ffn(nn.Module):
    def forward(self, x, image_mask=None):
        return (x.float().square() - 0.3).bfloat16()


def _block() -> Block:
    with dense_dtype(ARGS):
        block = Block(1, ARGS)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.startswith("hc_"):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if name.endswith("_fn") else 0.5))
            elif name in ("attn_norm.weight", "ffn_norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    block.attn, block.ffn = _Attn(), _Ffn()
    return block


def _mixes(block: Block, x: torch.Tensor, fn, scale, base):
    flat = x.flatten(2).float()
    mixes = torch.nn.functional.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + ARGS.norm_eps)
    return hc_split_sinkhorn(mixes, scale, base, ARGS.hc_mult, ARGS.hc_sinkhorn_iters, ARGS.hc_eps)


def _rms(x, w):
    xf = x.float()
    return (w.float() * xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + ARGS.norm_eps)).bfloat16()


def _collapse(x, pre):
    return sum(pre[..., i, None] * x[..., i, :].float() for i in range(ARGS.hc_mult)).bfloat16()


def _expand(out, residual, post, comb):
    copies = []
    for j in range(ARGS.hc_mult):
        mixed = sum(comb[..., i, j, None] * residual[..., i, :].float() for i in range(ARGS.hc_mult))
        copies.append(post[..., j, None] * out.float() + mixed)
    return torch.stack(copies, dim=2).bfloat16()


def test_block_collapses_with_lagged_weights_and_expands_through_comb():
    block = _block()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, ARGS.hc_mult, ARGS.dim, generator=gen).bfloat16()
    pre_in = torch.softmax(torch.randn(2, 5, ARGS.hc_mult, generator=gen), -1)
    got, got_pre = block(x, 0, pre_in, None)

    a_pre, a_post, a_comb = _mixes(block, x, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base)
    assert not torch.allclose(a_comb, a_comb.transpose(-1, -2))  # comb's orientation matters here
    h = block.attn(_rms(_collapse(x, pre_in), block.attn_norm.weight), 0)
    x1 = _expand(h, x, a_post, a_comb)
    f_pre, f_post, f_comb = _mixes(block, x1, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base)
    h = block.ffn(_rms(_collapse(x1, a_pre), block.ffn_norm.weight))
    want = _expand(h, x1, f_post, f_comb)

    torch.testing.assert_close(got_pre, f_pre, atol=1e-6, rtol=1e-6)
    # fp32 sums in another order, then one bf16 rounding: one bf16 step at most
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)
