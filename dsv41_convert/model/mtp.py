"""DSpark: the speculative draft stages stored under `mtp.*` (layers n_layers .. n_layers + 2).

After a backbone step at position t has produced token y (for position t + 1), the stages draft a
block of `dspark_block_size` tokens at positions t + 1 .. t + block_size in one pass:

- input: y followed by block_size - 1 copies of the noise token, embedded with the backbone's
  embedding and copied to hc_mult streams;
- context: `main_x = main_norm(main_proj(main_hidden))` (stage 0's weights, shared by all stages),
  where main_hidden is the backbone's attention inputs at the target layers (hc-mean, concatenated);
  each stage keeps a sliding window of K/V computed from main_x with its own wkv, and the draft
  block attends to that window plus the whole block (no causal mask inside the block);
- output (last stage): logits of the backbone head on `norm`, plus a Markov bias from the previous
  draft token (markov_head: embed to rank 256, project to the vocab), sampled left to right, and a
  confidence per draft position from `confidence_head.proj` over [hidden, markov embedding].

A prefill call (start_pos 0) only seeds the windows and returns None.

Legend: B batch, S main positions of this step, K draft block size, D model dim, H hc copies.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv41_convert.kernels.dispatch import ops_for
from dsv41_convert.model.attention import Attention
from dsv41_convert.model.block import Block, make_identity_pre_mix
from dsv41_convert.model.head import ParallelHead, sample
from dsv41_convert.model.layers import FP8_BLOCK, SCALE_DTYPE, SCALE_FMT, Linear, ParallelEmbedding, RMSNorm
from dsv41_convert.model.rope import apply_rotary_emb

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs


@lru_cache(1)
def get_dspark_topk_idxs(window_size: int, bsz: int, block_size: int, start_pos: int) -> torch.Tensor:
    """KV slots every draft query reads: the filled window slots, then all block_size draft slots
    (which sit after the window_size ring slots in the concatenated KV).

    -> [B, K, min(window_size, start_pos + 1) + K]  int32
    """
    assert start_pos > 0, "the draft block only runs after a prefill"
    window = torch.arange(min(window_size, start_pos + 1))
    draft = window_size + torch.arange(block_size)
    return torch.cat([window, draft]).int().view(1, 1, -1).expand(bsz, block_size, -1).contiguous()


class DSparkAttention(Attention):
    """Window-only attention (compress_ratio 0) whose window holds the main model's positions."""

    def _main_kv(self, main_x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """This stage's K/V of the main positions: [B, S, head_dim] bfloat16 (fp8-rounded)."""
        ops = ops_for(main_x.device)
        kv = self.kv_norm(self.wkv(main_x))
        apply_rotary_emb(kv[..., -self.rope_head_dim :], self.freqs_cis[start_pos : start_pos + main_x.size(1)])
        ops.act_quant(kv, FP8_BLOCK, SCALE_FMT, SCALE_DTYPE, True)
        return kv

    def forward(self, x: torch.Tensor, start_pos: int, main_x: torch.Tensor) -> torch.Tensor:
        """Prefill (start_pos 0): write main_x's K/V into the window and return x unchanged.
        Decode: main_x is the one new main position; x is the draft block.

        x:      [B, K, D]  bfloat16 draft block
        main_x: [B, S, D]  bfloat16 (S = 1 when start_pos > 0)
        -> [B, K, D]       bfloat16
        """
        assert self.compress_ratio == 0
        bsz, seqlen, _ = main_x.size()
        win, rd = self.window_size, self.rope_head_dim
        main_kv = self._main_kv(main_x, start_pos)
        if start_pos == 0:
            # the ring slot of position p is p % win; keep the last win positions
            keep = main_kv[:, -win:]
            slots = torch.arange(seqlen - keep.size(1), seqlen, device=keep.device) % win
            self.window_kv_cache[:bsz, slots] = keep.to(self.window_kv_cache.dtype)
            return x
        if seqlen != 1:
            raise ValueError(f"DSpark decode takes one main position per step, got {seqlen}")

        ops = ops_for(x.device)
        block = x.size(1)
        # draft positions follow the main position: start_pos + 1 .. start_pos + block
        freqs = self.freqs_cis[start_pos + seqlen : start_pos + seqlen + block]
        q = self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (self.n_local_heads, self.head_dim))
        apply_rotary_emb(q[..., -rd:], freqs)
        kv = self.kv_norm(self.wkv(x))
        apply_rotary_emb(kv[..., -rd:], freqs)
        ops.act_quant(kv, FP8_BLOCK, SCALE_FMT, SCALE_DTYPE, True)

        self.window_kv_cache[:bsz, start_pos % win] = main_kv.squeeze(1)
        kv_all = torch.cat([self.window_kv_cache[:bsz].to(kv.dtype), kv], dim=1)
        idxs = get_dspark_topk_idxs(win, bsz, block, start_pos).to(x.device)
        o = ops.sparse_attn(q, kv_all, self.attn_sink, idxs, self.softmax_scale)
        apply_rotary_emb(o[..., -rd:], freqs, True)

        # grouped low-rank output projection, as the backbone's attention
        o_BKGX = o.view(bsz, block, self.n_local_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_local_groups, self.o_lora_rank, -1)
        o_BKGR = torch.einsum("bsgd,grd->bsgr", o_BKGX, wo_a)
        return self.wo_b(o_BKGR.flatten(2))


class DSparkMarkovHead(nn.Module):
    """A rank-`dspark_markov_rank` bigram bias: previous token -> embed -> vocab logits."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = ParallelEmbedding(vocab_size, rank)
        self.head = ParallelHead(vocab_size, rank)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids: [B] int64 -> (logits [B, vocab] float32, embedding [B, rank] bfloat16)"""
        embed = self.embed(token_ids)
        return self.head(embed, full_logits=True), embed


class DSparkConfidenceHead(nn.Module):
    """One fp32 score per draft position (the bf16 checkpoint weight is held in fp32)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = Linear(input_dim, 1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hidden: [B, K, D], markov_embed: [B, K, rank] -> [B, K] float32"""
        return self.proj(torch.cat([hidden, markov_embed], dim=-1).float()).squeeze(-1)


class DSparkBlock(Block):
    """One DSpark stage: a Block with window-only DSparkAttention, 128 experts / 3 active (from
    ModelArgs.moe_config), plus main_proj / main_norm on stage 0 and the output heads on the last.
    `embed` and `head` are the backbone's, set by the Transformer after construction."""

    attention_cls = DSparkAttention

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__(layer_id, args)
        stage = layer_id - args.n_layers
        self.block_size = args.dspark_block_size
        self.noise_token_id = args.dspark_noise_token_id
        self.temperature = args.temperature
        if stage == 0:
            if not args.dspark_target_layer_ids:
                raise ValueError("DSpark stage 0 needs dspark_target_layer_ids")
            self.main_proj = Linear(args.dim * len(args.dspark_target_layer_ids), args.dim)
            self.main_norm = RMSNorm(args.dim, args.norm_eps)
        if stage == args.n_mtp_layers - 1:
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.markov_head = DSparkMarkovHead(args.vocab_size, args.dspark_markov_rank)
            self.confidence_head = DSparkConfidenceHead(args.dim + args.dspark_markov_rank)
        self.embed: nn.Module | None = None
        self.head: nn.Module | None = None

    def forward(
        self, x: torch.Tensor, start_pos: int, pre_mix: torch.Tensor, main_x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, K, H, D] bfloat16, pre_mix: [B, K, H] float32, main_x: [B, S, D] bfloat16."""
        if start_pos == 0:
            self.attn(x, start_pos, main_x)  # prefill only fills this stage's window
            return x, pre_mix
        # draft tokens are text: no VL routing bias
        return super().forward(x, start_pos, pre_mix, None, main_x)

    def forward_embed(self, main_hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0 only.

        main_hidden: [B, S, D * n_targets]  bfloat16
        input_ids:   [B]                    int64, the token the backbone just produced
        -> (draft block [B, K, H, D] bfloat16, main_x [B, S, D] bfloat16)
        """
        assert self.embed is not None, "Transformer sets DSparkBlock.embed"
        x = embed_draft_block(self.embed, input_ids, self.block_size, self.noise_token_id, self.hc_mult)
        return x, self.main_context(main_hidden)

    def main_context(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """Stage 0 only. main_hidden: [B, S, D * n_targets] bfloat16 -> main_x [B, S, D] bfloat16"""
        return self.main_norm(self.main_proj(main_hidden))

    def forward_head(
        self, x: torch.Tensor, pre_mix: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Last stage only.

        x: [B, K, H, D] bfloat16, pre_mix: [B, K, H] float32, input_ids: [B] int64
        -> (output_ids [B, K + 1] int64: input_ids then the K drafts,
            logits [B, K, vocab] float32 (Markov bias included),
            confidence [B, K] float32)
        """
        assert self.head is not None, "Transformer sets DSparkBlock.head"
        return draft_outputs(self, self.hc_pre(x, pre_mix), input_ids)


def embed_draft_block(
    embed: nn.Module, input_ids: torch.Tensor, block_size: int, noise_token_id: int, hc_mult: int
) -> torch.Tensor:
    """The draft block's input: the backbone's token then block_size - 1 noise tokens, embedded.

    input_ids: [B] int64 -> [B, K, H, D] bfloat16
    """
    draft_ids = input_ids.new_full((input_ids.size(0), block_size), noise_token_id)
    draft_ids[:, 0] = input_ids
    x = embed(draft_ids)
    return x.unsqueeze(2).repeat(1, 1, hc_mult, 1)


def draft_outputs(
    heads: nn.Module, x: torch.Tensor, input_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The last stage's outputs from its collapsed stream. `heads` carries norm, head, markov_head,
    confidence_head, block_size and temperature (the last DSparkBlock, or the streamed head unit).

    x: [B, K, D] bfloat16, input_ids: [B] int64
    -> (output_ids [B, K + 1] int64, logits [B, K, vocab] float32, confidence [B, K] float32), as forward_head
    """
    logits = heads.head(heads.norm(x), full_logits=True)
    output_ids = input_ids.new_empty(input_ids.size(0), heads.block_size + 1)
    output_ids[:, 0] = input_ids
    embeds = []
    # each draft's Markov bias depends on the token sampled just before it
    for i in range(heads.block_size):
        bias, embed = heads.markov_head(output_ids[:, i])
        logits[:, i] += bias
        embeds.append(embed)
        output_ids[:, i + 1] = sample(logits[:, i], heads.temperature)
    confidence = heads.confidence_head(x, torch.stack(embeds, dim=1))
    return output_ids, logits, confidence


@torch.inference_mode()
def forward_spec(
    model: nn.Module, input_ids: torch.Tensor, main_hidden: torch.Tensor, start_pos: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Run the DSpark stages after a backbone step (`model` is the Transformer).

    input_ids:   [B]                   int64, the backbone's sampled token (Transformer.forward output_ids)
    main_hidden: [B, S, D * n_targets] bfloat16, Transformer.forward's third output
    start_pos:   the backbone step's start_pos (0 = prefill: seeds the windows, returns None)
    -> None, or (output_ids [B, K + 1] int64, logits [B, K, vocab] float32, confidence [B, K] float32)
    """
    stages = model.mtp
    h, main_x = stages[0].forward_embed(main_hidden, input_ids)
    pre_mix = make_identity_pre_mix(h, h.size(2))
    for stage in stages:
        h, pre_mix = stage(h, start_pos, pre_mix, main_x)
    if start_pos == 0:
        return None
    return stages[-1].forward_head(h, pre_mix, input_ids)
