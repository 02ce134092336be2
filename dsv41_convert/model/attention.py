"""Attention: sliding-window raw KV plus (on compressed layers) indexer-chosen compressed KV.

Legend: b batch, s queries, h heads (local to the rank), d head dim, w window, g output groups
(local), r o_lora_rank, t compressed positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv41_convert.kernels.dispatch import ops_for
from dsv41_convert.model import parallel
from dsv41_convert.model.compressor import Compressor
from dsv41_convert.model.indexer import Indexer
from dsv41_convert.model.layers import (
    FP8_BLOCK,
    SCALE_DTYPE,
    SCALE_FMT,
    ColumnParallelLinear,
    Linear,
    RMSNorm,
    RowParallelLinear,
)
from dsv41_convert.model.rope import apply_rotary_emb, precompute_freqs_cis
from dsv41_convert.model.runtime import SharedAttentionRuntime

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs

COMPRESSED_KV_FP4_BLOCK = 16  # compressed KV: fp4 with one e4m3 scale per 16 (the indexer uses 32 / e8m0)


def get_window_topk_idxs(window_size: int, bsz: int, seqlen: int, start_pos: int, device=None) -> torch.Tensor:
    """Window KV rows each query attends to; -1 = an empty slot.

    Prefill (start_pos 0): rows of this chunk's own KV, the causal window ending at each query.
    Decode: slots of the ring buffer (position p lives in slot p % window), oldest first.
    -> [bsz, seqlen, min(seqlen, window)] (prefill) or [bsz, 1, window] (decode), int32
    """
    if start_pos == 0:
        last = torch.arange(seqlen, device=device).unsqueeze(1)
        idxs = (last - window_size + 1).clamp(0) + torch.arange(min(seqlen, window_size), device=device)
        idxs = torch.where(idxs > last, -1, idxs)
    else:
        oldest = start_pos % window_size + 1
        idxs = torch.cat([torch.arange(oldest, window_size, device=device), torch.arange(oldest, device=device)])
        idxs = torch.where(idxs > start_pos, -1, idxs)
        idxs = idxs.unsqueeze(0)
    return idxs.int().unsqueeze(0).expand(bsz, -1, -1).contiguous()


class Attention(nn.Module):
    """One shared KV head (K = V) with a low-rank query and a grouped low-rank output projection.

    Every query sees a sliding window of `window_size` raw KV rows; on layers with
    compress_ratio > 0 also up to `index_topk` compressed KV rows chosen by an indexer. Only
    kv-source layers compress (and own the compressed cache); other compressed layers read the
    source's cache. Only index-source layers run an indexer; others reuse the last choice.

    attn_sink: [n_heads/world]                                  float32
    wq_a:      [q_lora_rank, dim]                               fp8
    q_norm:    [q_lora_rank]                                    bfloat16
    wq_b:      [n_heads*head_dim/world, q_lora_rank]            fp8 (column parallel)
    wkv:       [head_dim, dim]                                  fp8
    kv_norm:   [head_dim]                                       bfloat16
    wo_a:      [o_groups*o_lora_rank/world, n_heads*head_dim/o_groups]  bfloat16 (column parallel)
    wo_b:      [dim, o_groups*o_lora_rank/world]                fp8 (row parallel)
    window_kv_cache:   [max_batch, window, head_dim]            bfloat16 ring buffer (not in the state dict)
    compress_kv_cache: [max_batch, max_seq_len/ratio, head_dim] bfloat16 (kv sources; not in the state dict)
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        world = parallel.world_size()
        self.layer_id = layer_id
        self.dim = args.dim
        self.n_heads = args.n_heads
        self.n_local_heads = args.n_heads // world
        self.q_lora_rank = args.q_lora_rank
        self.o_lora_rank = args.o_lora_rank
        self.head_dim = args.head_dim
        self.rope_head_dim = args.rope_head_dim
        self.nope_head_dim = args.head_dim - args.rope_head_dim
        self.n_groups = args.o_groups
        self.n_local_groups = self.n_groups // world
        self.window_size = args.window_size
        self.compress_ratio = args.compress_ratios[layer_id]
        self.eps = args.norm_eps

        self.attn_sink = nn.Parameter(torch.empty(self.n_local_heads, dtype=torch.float32))
        self.wq_a = Linear(self.dim, self.q_lora_rank)
        self.q_norm = RMSNorm(self.q_lora_rank, self.eps)
        self.wq_b = ColumnParallelLinear(self.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = Linear(self.dim, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        # block-diagonal over the groups; the checkpoint's fp8 wo_a is dequantized by the converter
        self.wo_a = ColumnParallelLinear(
            self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, dtype=torch.bfloat16
        )
        self.wo_b = RowParallelLinear(self.n_groups * self.o_lora_rank, self.dim)
        self.softmax_scale = self.head_dim**-0.5

        backbone = layer_id < args.n_layers
        self.is_kv_source = backbone and layer_id in args.kv_source_layers
        self.is_index_source = backbone and layer_id in args.index_source_layers
        self.compressor: Compressor | None = Compressor(args, layer_id) if self.is_kv_source else None
        self.indexer: Indexer | None = Indexer(args, layer_id) if self.is_index_source else None
        # replaced by the Transformer's runtime, shared by all its layers; a lone layer has its own
        self.shared = SharedAttentionRuntime()

        self.window_kv_cache: torch.Tensor
        window = torch.zeros(args.max_batch_size, args.window_size, self.head_dim, dtype=torch.bfloat16)
        self.register_buffer("window_kv_cache", window, persistent=False)
        if self.is_kv_source:
            self.compress_kv_cache: torch.Tensor
            cache = torch.zeros(
                args.max_batch_size, args.max_seq_len // self.compress_ratio, self.head_dim, dtype=torch.bfloat16
            )
            self.register_buffer("compress_kv_cache", cache, persistent=False)
        if self.compress_ratio:
            original_seq_len, theta = args.original_seq_len, args.compress_rope_theta
        else:  # window-only layers: plain RoPE at the base theta, no YaRN
            original_seq_len, theta = 0, args.rope_theta
        freqs = precompute_freqs_cis(
            self.rope_head_dim,
            args.max_seq_len,
            original_seq_len,
            theta,
            args.rope_factor,
            args.beta_fast,
            args.beta_slow,
        )
        self.freqs_cis: torch.Tensor
        self.register_buffer("freqs_cis", freqs, persistent=False)

    def _window_kv(self, x: torch.Tensor, freqs_cis: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's raw KV rows and the window indices into them.

        The KV is fp8-rounded over the whole post-RoPE vector (act_quant, block 32).
        -> kv [b, s, d] (prefill) or the ring [b, w, d] (decode), bfloat16; idxs as get_window_topk_idxs
        """
        bsz, seqlen, _ = x.shape
        win = self.window_size
        kv = self.kv_norm(self.wkv(x))
        apply_rotary_emb(kv[..., -self.rope_head_dim :], freqs_cis)
        ops_for(x.device).act_quant(kv, FP8_BLOCK, SCALE_FMT, SCALE_DTYPE, True)
        if start_pos == 0:  # attend over the chunk itself; keep the last `win` rows for decode
            tail = kv[:, -win:]
            slots = torch.arange(seqlen - tail.size(1), seqlen, device=x.device) % win
            self.window_kv_cache[:bsz, slots] = tail
            window_kv = kv
        else:
            self.window_kv_cache[:bsz, start_pos % win] = kv.squeeze(1)
            window_kv = self.window_kv_cache[:bsz]
        return window_kv, get_window_topk_idxs(win, bsz, seqlen, start_pos, x.device)

    def _compress_topk_idxs(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        latent: torch.Tensor | None,
        start_pos: int,
        offset: int,
        compress_len: int,
    ) -> torch.Tensor:
        """Compressed rows each query attends to: an index source runs its indexer and publishes
        the result; other layers reuse what the last source published."""
        if not self.is_index_source:
            return self.shared.topk_idxs
        bsz, seqlen, _ = x.shape
        if compress_len == 0:
            idxs = torch.empty(bsz, seqlen, 0, dtype=torch.int32, device=x.device)
        else:
            idxs = self.indexer(x, qr, latent, start_pos, offset, self.freqs_cis, self.shared)
        self.shared.topk_idxs = idxs
        return idxs

    def _compress_kv(
        self, x: torch.Tensor, qr: torch.Tensor, start_pos: int, offset: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared compressed KV [b, t, d] bfloat16 and the chosen rows [b, s, k] int32."""
        bsz, seqlen, _ = x.shape
        ratio = self.compress_ratio
        compress_len = (start_pos + seqlen) // ratio
        latent = None
        if self.is_kv_source:
            latent = self.compressor(x, start_pos)
            self.shared.compress_kv = self.compress_kv_cache
        # the indexer derives its keys from the unrotated latent, so it runs before the RoPE below
        idxs = self._compress_topk_idxs(x, qr, latent, start_pos, offset, compress_len)
        if latent is not None:
            if start_pos == 0:  # latent j stands for its group's first token, position j * ratio
                freqs = self.freqs_cis[: seqlen - seqlen % ratio : ratio]
            else:
                freqs = self.freqs_cis[start_pos + 1 - ratio].unsqueeze(0)
            apply_rotary_emb(latent[..., -self.rope_head_dim :], freqs)
            ops_for(x.device).fp4_act_quant(latent, COMPRESSED_KV_FP4_BLOCK, True, scale_dtype=torch.float8_e4m3fn)
            first = start_pos // ratio
            self.compress_kv_cache[:bsz, first : first + latent.size(1)] = latent
        return self.shared.compress_kv[:bsz, :compress_len], idxs

    def forward(self, x: torch.Tensor, start_pos: int) -> torch.Tensor:
        """x: [b, s, dim] bfloat16 at positions start_pos.. (prefill: start_pos 0; decode: s = 1)
        -> [b, s, dim] bfloat16, summed over ranks"""
        bsz, seqlen, _ = x.shape
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]
        rd = self.rope_head_dim

        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).unflatten(-1, (self.n_local_heads, self.head_dim))  # [b, s, h, d]
        apply_rotary_emb(q[..., -rd:], freqs_cis)

        kv, topk_idxs = self._window_kv(x, freqs_cis, start_pos)
        if self.compress_ratio:
            compress_kv, compress_idxs = self._compress_kv(x, qr, start_pos, kv.size(1))
            kv = torch.cat([kv, compress_kv], dim=1)
            topk_idxs = torch.cat([topk_idxs, compress_idxs], dim=-1)

        o = ops_for(x.device).sparse_attn(q, kv, self.attn_sink, topk_idxs, self.softmax_scale)
        apply_rotary_emb(o[..., -rd:], freqs_cis, True)  # undo the query's rotation on the RoPE dims

        o = o.view(bsz, seqlen, self.n_local_groups, -1)  # [b, s, g, h*d/g]
        wo_a = self.wo_a.weight.view(self.n_local_groups, self.o_lora_rank, -1)  # [g, r, h*d/g]
        o = torch.einsum("bsgd,grd->bsgr", o, wo_a)
        return self.wo_b(o.flatten(2))
