"""Engram: an n-gram table lookup written into the hyper-connection stream, gated per copy.

The table is the largest tensor of the checkpoint (~384M rows of 256 fp8 values per layer), so it
stays fp8 and only the looked-up rows are dequantized. Its rows are split across ranks the way the
converter writes them: ceil(rows / world_size) per rank, the last rank's slice padded.

Legend: B batch, L positions, H hc copies, D model dim, C hash columns, E engram head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsv41_convert.model import parallel
from dsv41_convert.model.layers import FP8_BLOCK, SCALE_DTYPE, Linear

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs
    from dsv41_convert.model.engram_hash import EngramLayout


class ParallelEngramEmbedding(nn.Module):
    """One rank's slice of an Engram table; rows outside it read as zero, then ranks sum.

    weight: [ceil(rows / world_size), E]         float8_e4m3fn
    scale:  [ceil(rows / world_size), E / 32]    float8_e8m0fnu, one per 32 values of a row
    """

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        world, rank = parallel.world_size(), parallel.rank()
        self.num_embeddings = num_embeddings
        self.dim = dim
        self.block_size = FP8_BLOCK
        self.part_num_embeddings = -(-num_embeddings // world)
        self.vocab_start_idx = rank * self.part_num_embeddings
        self.vocab_end_idx = self.vocab_start_idx + self.part_num_embeddings
        self.weight = nn.Parameter(torch.empty(self.part_num_embeddings, dim, dtype=torch.float8_e4m3fn))
        self.scale = nn.Parameter(torch.empty(self.part_num_embeddings, dim // FP8_BLOCK, dtype=SCALE_DTYPE))

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """indices: [...] int64 global row ids -> [..., E] bfloat16 (dequantized, summed over ranks)."""
        local = indices - self.vocab_start_idx
        elsewhere = (local < 0) | (local >= self.part_num_embeddings)
        local = local.masked_fill(elsewhere, 0)
        rows = F.embedding(local, self.weight).float()
        scales = F.embedding(local, self.scale).float()
        # value * 2**exponent is exact in fp32; one bf16 rounding after it, as upstream
        rows = (rows.unflatten(-1, (-1, self.block_size)) * scales.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)
        rows = rows.masked_fill(elsewhere.unsqueeze(-1), 0)
        # exactly one rank holds each row, so the sum over ranks only adds zeros
        return parallel.all_reduce(rows)


class Engram(nn.Module):
    """The n-gram rows of one position turned into a gated update of every hc copy.

    `wkv` maps the C looked-up rows to one key per hc copy plus one value shared by the copies;
    each copy's gate is a sigmoid of the signed square root of its RMS-normalized dot product with
    its key (weighted by q_weight * k_weight).
    """

    def __init__(self, args: ModelArgs, layer_id: int, layout: EngramLayout):
        super().__init__()
        self.layer_id = layer_id
        self.layer_hash_index = layout.layer_ids.index(layer_id)
        self.dim = args.dim
        self.hc_mult = args.hc_mult
        self.clamp_value = 1e-6
        self.embed = ParallelEngramEmbedding(layout.num_embeddings[self.layer_hash_index], layout.head_dim)
        n_hash_cols = (layout.max_ngram_size - 1) * layout.n_heads
        self.wkv = Linear(n_hash_cols * layout.head_dim, args.dim * (args.hc_mult + 1))
        self.eps = args.norm_eps
        self.q_weight = nn.Parameter(torch.ones(args.hc_mult, args.dim, dtype=torch.bfloat16))
        self.k_weight = nn.Parameter(torch.ones(args.hc_mult, args.dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor, hash_ids: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Add the gated value into each copy; masked positions pass through unchanged.

        x:          [B, L, H, D]   bfloat16
        hash_ids:   [B, L, C]      int64 (this layer's columns of NgramHashState's output)
        token_mask: [B, L] bool    False closes the gate (image positions); None = all open
        -> [B, L, H, D]            bfloat16
        """
        kv_BLX = self.wkv(self.embed(hash_ids).flatten(-2))
        key_BLHD = kv_BLX[..., : self.hc_mult * self.dim].float().unflatten(-1, (self.hc_mult, self.dim))
        value_BLD = kv_BLX[..., self.hc_mult * self.dim :].float()
        h = x.float()
        # each (position, copy) is normalized on its own over D, for both the stream and its key
        inv_rms = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key_BLHD.square().mean(-1) + self.eps)
        w_HD = self.q_weight.float() * self.k_weight.float()
        score_BLH = (h * w_HD * key_BLHD).sum(-1) * inv_rms * self.dim**-0.5
        # signed square root before the sigmoid; tiny magnitudes are floored, keeping their sign
        root = score_BLH.abs().clamp_min(self.clamp_value).sqrt()
        gate_BLH = torch.sigmoid(torch.copysign(root, score_BLH))
        if token_mask is not None:
            gate_BLH = gate_BLH.masked_fill(~token_mask.unsqueeze(-1), 0)
        return (h + gate_BLH.unsqueeze(-1) * value_BLD.unsqueeze(-2)).to(x.dtype)
