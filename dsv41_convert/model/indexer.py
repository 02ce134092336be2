"""The indexer: which compressed KV positions each query attends to (at most `index_topk`).

Legend: b batch, s queries, h index heads (local to the rank), d index head dim,
t compressed positions, n candidate blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsv41_convert.kernels.dispatch import ops_for
from dsv41_convert.model import parallel
from dsv41_convert.model.layers import FP4_BLOCK, ColumnParallelLinear, Linear, RMSNorm
from dsv41_convert.model.rope import apply_rotary_emb

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs
    from dsv41_convert.model.runtime import SharedAttentionRuntime


def select_candidate_blocks(
    scores: torch.Tensor, compress_lens: torch.Tensor | int, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """First level of the two-level top-k: keep the `topk_blocks` best blocks of positions.

    A block scores its best position (candidate_block_scores). Blocks that are not reachable at all
    (every position -inf) are never kept, even when fewer than topk_blocks remain.

    scores:        [b, s, t]  float/bf16, unreachable positions already -inf
    compress_lens: [s, 1] int64 visible positions per query (prefill) or an int (decode)
    -> [b, s, t] bool, True inside a kept block
    """
    block_scores = candidate_block_scores(scores, compress_lens, block_size)
    best = block_scores.topk(min(topk_blocks, block_scores.size(-1)), dim=-1)
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, best.indices, best.values > -torch.inf)
    return keep.repeat_interleave(effective_block_size(block_size, scores.size(-1)), dim=-1)[..., : scores.size(-1)]


def candidate_block_scores(scores: torch.Tensor, compress_lens: torch.Tensor | int, block_size: int) -> torch.Tensor:
    """What the candidate blocks are chosen by: each block's best position's score; the block holding the
    query's newest visible position +inf (it is still filling up and would lose to older full blocks: always kept).

    scores: [b, s, t] float/bf16, unreachable positions -inf; compress_lens as select_candidate_blocks'
    -> [b, s, n] scores' dtype, n = ceil(t / effective_block_size)
    """
    t = scores.size(-1)
    block_size = effective_block_size(block_size, t)
    padded = F.pad(scores, (0, -t % block_size), value=-torch.inf)
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)  # [b, s, n]
    newest = (compress_lens - 1) // block_size
    return block_scores.masked_fill(torch.arange(block_scores.size(-1), device=scores.device) == newest, torch.inf)


def kept_blocks(candidates: torch.Tensor, block_size: int) -> torch.Tensor:
    """The blocks a candidate mask keeps. candidates: [..., t] bool (select_candidate_blocks') -> [..., n] bool"""
    t = candidates.size(-1)
    block_size = effective_block_size(block_size, t)
    padded = F.pad(candidates, (0, -t % block_size), value=False)
    return padded.unflatten(-1, (-1, block_size)).any(dim=-1)


def visible_rows(seqlen: int, ratio: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The compressed rows a prefill query sees at each of `seqlen` positions: a row becomes visible once the query
    has passed its group's last token. -> [seqlen, 1] int64, (p + 1) // ratio at position p"""
    return (torch.arange(1, seqlen + 1, device=device) // ratio).unsqueeze(-1)


def effective_block_size(block_size: int, t: int) -> int:
    """The candidate block width over t positions: a block wider than the positions is one block of them all (the
    same blocks kept): a candidate_block_size of 10**12 padded the scores to that width, an allocator's traceback (an
    audit)."""
    return max(1, min(block_size, t))


class Indexer(nn.Module):
    """A small side attention that scores compressed positions; the top `index_topk` are kept.

    fp4-rounded query heads meet one shared fp4-rounded key per compressed position; the scores
    are rectified, weighted per head by `weights_proj`, and summed over heads (and ranks). Only a
    kv-source layer owns the key projection and key cache; other indexers read the keys their
    source published. The candidate source also publishes the candidate blocks that later
    indexers restrict themselves to.

    wq_b:         [index_n_heads * index_head_dim / world, q_lora_rank]  fp8 (column parallel)
    weights_proj: [index_n_heads / world, dim]                           bfloat16 (column parallel)
    wk:           [index_head_dim, head_dim]                             bfloat16 (kv sources only)
    k_norm:       [index_head_dim]                                       bfloat16 (kv sources only)
    k_cache:      [max_batch, max_seq_len / ratio, index_head_dim]       bfloat16, not in the state dict
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        world = parallel.world_size()
        self.owns_k = layer_id in args.kv_source_layers
        self.compress_ratio = args.compress_ratios[layer_id]
        self.is_candidate_source = layer_id == args.candidate_source_layer
        self.uses_candidates = 0 <= args.candidate_source_layer < layer_id
        self.candidate_topk_blocks = args.candidate_topk_blocks
        self.candidate_block_size = args.candidate_block_size
        self.dim = args.dim
        self.n_heads = args.index_n_heads
        self.n_local_heads = args.index_n_heads // world
        self.index_head_dim = args.index_head_dim
        self.rope_head_dim = args.rope_head_dim
        self.index_topk = args.index_topk
        self.q_lora_rank = args.q_lora_rank
        self.softmax_scale = self.index_head_dim**-0.5
        # set by verify.teacher: the scores the last call chose from ([b, s, t], candidates masked) and, in the
        # candidate source, its blocks' scores ([b, s, n]), kept to tell a near-tie broken otherwise from another
        # choice; the model never reads them
        self.keep_scores = False
        self.kept_scores: torch.Tensor | None = None
        self.kept_block_scores: torch.Tensor | None = None
        self.wq_b = ColumnParallelLinear(self.q_lora_rank, self.n_heads * self.index_head_dim)
        self.weights_proj = ColumnParallelLinear(self.dim, self.n_heads, dtype=torch.bfloat16)
        if self.owns_k:
            self.wk = Linear(args.head_dim, self.index_head_dim, dtype=torch.bfloat16)
            self.k_norm = RMSNorm(self.index_head_dim, args.norm_eps)
            self.k_cache: torch.Tensor
            cache = torch.zeros(
                args.max_batch_size, args.max_seq_len // self.compress_ratio, self.index_head_dim, dtype=torch.bfloat16
            )
            self.register_buffer("k_cache", cache, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        latent: torch.Tensor | None,
        start_pos: int,
        offset: int,
        freqs_cis: torch.Tensor,
        shared: SharedAttentionRuntime,
    ) -> torch.Tensor:
        """Chosen compressed positions of every query, as rows of the attention's concatenated KV.

        x:         [b, s, dim]            bfloat16, the attention input
        qr:        [b, s, q_lora_rank]    bfloat16, the normed low-rank query
        latent:    [b, s/ratio, head_dim] bfloat16, this layer's unrotated compressed latent
                   (kv sources, when a group completed), else None
        offset:    added to every chosen position (the window part comes first in the KV)
        freqs_cis: [max_seq_len, rope_head_dim/2] complex64, the attention's full table
        -> [b, s, min(index_topk, (start_pos+s)//ratio)] int32, ascending; -1 = not reachable yet
        """
        bsz, seqlen, _ = x.shape
        ratio, rd, end_pos = self.compress_ratio, self.rope_head_dim, start_pos + seqlen
        ops = ops_for(x.device)
        if self.owns_k and latent is not None:
            # latent j stands for its group's first token, position j * ratio
            if start_pos == 0:
                freqs = freqs_cis[: seqlen - seqlen % ratio : ratio]
            else:
                freqs = freqs_cis[start_pos + 1 - ratio].unsqueeze(0)
            k = self.k_norm(self.wk(latent))
            apply_rotary_emb(k[..., -rd:], freqs)
            ops.fp4_act_quant(k, FP4_BLOCK, True)
            first = start_pos // ratio
            self.k_cache[:bsz, first : first + k.size(1)] = k
            shared.index_k = self.k_cache

        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.index_head_dim))  # [b, s, h, d]
        apply_rotary_emb(q[..., -rd:], freqs_cis[start_pos:end_pos])
        ops.fp4_act_quant(q, FP4_BLOCK, True)

        index_k = shared.index_k[:bsz, : end_pos // ratio]  # [b, t, d]
        weights = self.weights_proj(x) * (self.softmax_scale * self.n_heads**-0.5)  # [b, s, h]
        scores = torch.einsum("bshd,btd->bsht", q, index_k)
        scores = (scores.relu_() * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, t]
        parallel.all_reduce(scores)

        # a compressed position becomes visible once the query has passed its group's last token
        if start_pos == 0:
            compress_lens = visible_rows(seqlen, ratio, x.device)
            unseen = torch.arange(seqlen // ratio, device=x.device) >= compress_lens
            scores.masked_fill_(unseen, -torch.inf)
        else:
            compress_lens = end_pos // ratio

        if self.is_candidate_source:
            shared.candidates = select_candidate_blocks(
                scores, compress_lens, self.candidate_topk_blocks, self.candidate_block_size
            )
            if self.keep_scores:
                self.kept_block_scores = candidate_block_scores(scores, compress_lens, self.candidate_block_size)
        elif self.uses_candidates:
            scores = scores.masked_fill(~shared.candidates, -torch.inf)

        if self.keep_scores:
            self.kept_scores = scores
        topk = min(self.index_topk, end_pos // ratio)
        idxs = scores.topk(topk, dim=-1, sorted=False).indices.sort(dim=-1).values
        return torch.where(idxs < compress_lens, idxs + offset, -1).int()
