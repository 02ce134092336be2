"""The KV compressor of a kv-source layer: `compress_ratio` consecutive tokens -> one latent."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv41_convert.model.layers import Linear, RMSNorm

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs


class Compressor(nn.Module):
    """Pools each group of `compress_ratio` tokens into one KV latent through a learned softmax gate.

    Returns the latent before RoPE (the indexer needs it unrotated; Attention rotates it later),
    or None when no group completed in this call. A group still filling up waits in
    `kv_state`/`score_state` across decode steps; groups are aligned to absolute positions, so
    group j always covers tokens j*ratio .. j*ratio + ratio - 1.

    ratio 1: wkv [head_dim, dim] bfloat16, no gate, no state (nothing to pool).
    ratio>1: wkv, wgate [head_dim, dim] float32 (the pooling runs in fp32);
             kv_state, score_state [max_batch, ratio, head_dim] float32 (not in the state dict).
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        ratio = args.compress_ratios[layer_id]
        self.compress_ratio = ratio
        self.head_dim = args.head_dim
        self.norm = RMSNorm(args.head_dim, args.norm_eps)
        self.wkv = Linear(args.dim, args.head_dim, dtype=torch.float32 if ratio > 1 else torch.bfloat16)
        if ratio > 1:
            self.wgate = Linear(args.dim, args.head_dim, dtype=torch.float32)
            shape = (args.max_batch_size, ratio, args.head_dim)
            self.kv_state: torch.Tensor
            self.score_state: torch.Tensor
            self.register_buffer("kv_state", torch.zeros(shape, dtype=torch.float32), persistent=False)
            self.register_buffer("score_state", torch.full(shape, -torch.inf, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor | None:
        """x: [b, s, dim] bfloat16 (prefill at start_pos 0, or one decode token)
        -> [b, s // ratio, head_dim] bfloat16 in prefill, [b, 1, head_dim] when a decode step
           completes a group, else None."""
        bsz, seqlen, _ = x.shape
        ratio, dtype = self.compress_ratio, x.dtype
        if ratio == 1:
            return self.norm(self.wkv(x))
        x = x.float()
        kv, score = self.wkv(x), self.wgate(x)
        if start_pos == 0:
            full = seqlen - seqlen % ratio
            if full < seqlen:  # the partial last group waits for decode
                self.kv_state[:bsz, : seqlen - full] = kv[:, full:]
                self.score_state[:bsz, : seqlen - full] = score[:, full:]
            if full == 0:
                return None
            kv = kv[:, :full].unflatten(1, (-1, ratio))
            score = score[:, :full].unflatten(1, (-1, ratio))
            pooled = (kv * score.softmax(dim=2)).sum(dim=2)
        else:
            slot = start_pos % ratio
            self.kv_state[:bsz, slot] = kv.squeeze(1)
            self.score_state[:bsz, slot] = score.squeeze(1)
            if slot != ratio - 1:
                return None
            state_kv, state_score = self.kv_state[:bsz], self.score_state[:bsz]
            pooled = (state_kv * state_score.softmax(dim=1)).sum(dim=1, keepdim=True)
        return self.norm(pooled.to(dtype))
