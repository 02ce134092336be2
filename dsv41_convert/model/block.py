"""A transformer block whose residual stream is `hc_mult` parallel copies (hyper-connections)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsv41_convert.kernels.dispatch import ops_for
from dsv41_convert.model.attention import Attention
from dsv41_convert.model.layers import RMSNorm
from dsv41_convert.model.moe import MoE

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs
    from dsv41_convert.model.engram_hash import EngramLayout


def make_identity_pre_mix(x: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The first block's collapse weights: copy 0 only (all copies are equal at that point).

    x: [b, s, hc, d] -> [b, s, hc] float32, one-hot on copy 0
    """
    pre_mix = x.new_zeros(x.size(0), x.size(1), hc_mult, dtype=torch.float32)
    pre_mix[:, :, 0] = 1.0
    return pre_mix


class Block(nn.Module):
    """Attention then MoE, each between a collapse of the hc copies (`hc_pre`) and an expansion
    back into them (`hc_post`). The three coefficient sets (pre, post, comb) come from the stream
    itself (`hc_mixes`); comb is made doubly stochastic by Sinkhorn iterations.

    The collapse weights lag one sublayer: attention collapses with the `pre` computed by the
    previous block's FFN step, the FFN with the `pre` of this block's attention step, and the
    FFN step's own `pre` is returned for the next block.

    hc_{attn,ffn}_fn:    [(2+hc)*hc, hc*dim]  float32
    hc_{attn,ffn}_base:  [(2+hc)*hc]          float32
    hc_{attn,ffn}_scale: [3]                  float32
    attn_norm, ffn_norm: [dim]                bfloat16
    """

    attention_cls = Attention

    def __init__(self, layer_id: int, args: ModelArgs, engram_layout: EngramLayout | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.norm_eps = args.norm_eps
        self.attn = self.attention_cls(layer_id, args)
        self.ffn = MoE(layer_id, args)
        self.engram = None
        if engram_layout is not None and layer_id in engram_layout.layer_ids:
            from dsv41_convert.model.engram import Engram  # only configs with Engram need it

            self.engram = Engram(args, layer_id, engram_layout)
        self.attn_norm = RMSNorm(args.dim, self.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, self.norm_eps)
        self.hc_mult = hc = args.hc_mult
        self.hc_sinkhorn_iters = args.hc_sinkhorn_iters
        self.hc_eps = args.hc_eps
        mix_hc, hc_dim = (2 + hc) * hc, hc * args.dim
        f32 = torch.float32
        self.hc_attn_fn = nn.Parameter(torch.empty(mix_hc, hc_dim, dtype=f32))
        self.hc_ffn_fn = nn.Parameter(torch.empty(mix_hc, hc_dim, dtype=f32))
        self.hc_attn_base = nn.Parameter(torch.empty(mix_hc, dtype=f32))
        self.hc_ffn_base = nn.Parameter(torch.empty(mix_hc, dtype=f32))
        self.hc_attn_scale = nn.Parameter(torch.empty(3, dtype=f32))
        self.hc_ffn_scale = nn.Parameter(torch.empty(3, dtype=f32))

    def hc_mixes(
        self, x: torch.Tensor, hc_fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [b, s, hc, d] bfloat16 -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc], float32.

        One projection of the flattened stream, RMS-normalised per token over all hc*d values."""
        flat = x.flatten(2).float()
        rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixes = F.linear(flat, hc_fn) * rsqrt
        return ops_for(x.device).hc_split_sinkhorn(
            mixes, hc_scale, hc_base, self.hc_mult, self.hc_sinkhorn_iters, self.hc_eps
        )

    def hc_pre(self, x: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the copies. x: [b, s, hc, d], pre_mix: [b, s, hc] f32 -> [b, s, d] x's dtype"""
        return torch.sum(pre_mix.unsqueeze(-1) * x.float(), dim=2).to(x.dtype)

    def hc_post(self, x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New copy j = post[j] * x + sum_i comb[i, j] * residual[i].

        x: [b, s, d], residual: [b, s, hc, d], post: [b, s, hc], comb: [b, s, hc, hc] -> [b, s, hc, d] x's dtype
        """
        y = post.unsqueeze(-1) * x.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * residual.unsqueeze(-2), dim=2)
        return y.type_as(x)

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        pre_mix: torch.Tensor,
        image_mask: torch.Tensor | None,
        *attn_args,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [b, s, hc, d] bfloat16; pre_mix: [b, s, hc] float32 (from the previous block);
        image_mask: [b, s] bool, True inside image spans (selects the VL routing bias).
        -> (x [b, s, hc, d] bfloat16, pre_mix for the next block [b, s, hc] float32)"""
        residual = x
        attn_pre, attn_post, attn_comb = self.hc_mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        h = self.attn_norm(self.hc_pre(x, pre_mix))
        h = self.attn(h, start_pos, *attn_args)
        x = self.hc_post(h, residual, attn_post, attn_comb)

        residual = x
        ffn_pre, ffn_post, ffn_comb = self.hc_mixes(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        h = self.ffn_norm(self.hc_pre(x, attn_pre))
        h = self.ffn(h, image_mask)
        x = self.hc_post(h, residual, ffn_post, ffn_comb)
        return x, ffn_pre
