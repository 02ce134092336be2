"""State that attention layers hand down the stack within one forward (shared by attention.py and
indexer.py)."""

from __future__ import annotations

import torch


class SharedAttentionRuntime:
    """What attention layers pass down the stack within one forward, one slot each: layers run in
    order and every source writes before its consumers read.

    compress_kv: [max_batch, max_seq_len/ratio, head_dim] the kv source's compressed cache
    index_k:     [max_batch, max_seq_len/ratio, index_head_dim] the kv source's index-key cache
    topk_idxs:   [b, s, k] int32, the last index source's choice
    candidates:  [b, s, t] bool, the candidate source's kept blocks
    """

    def __init__(self) -> None:
        self.compress_kv: torch.Tensor | None = None
        self.index_k: torch.Tensor | None = None
        self.topk_idxs: torch.Tensor | None = None
        self.candidates: torch.Tensor | None = None
