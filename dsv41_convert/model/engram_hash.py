"""Engram n-gram hashing: which table rows each position looks up.

Three fixed ingredients decide the hash, and each must match training bit for bit, because a
wrong hash fails silently (it just reads other rows):
- the compressed token map: token ids folded together when their decoded text normalizes alike,
  numbered in first-seen order over the tokenizer's ids (built from the checkpoint's tokenizer.json);
- one odd multiplier per (engram layer, look-back), drawn from `numpy.random.default_rng(10007 * layer)`;
- one prime bucket count per (engram layer, n-gram size, head): the successive primes above
  `engram_vocab_size - 1`, handed out layer by layer, n-gram size by n-gram size, head by head.

At a position the n-gram of size n is the current compressed id and the n-1 before it; look-back
stops at the start of the sequence and at image positions (both read as the pad id from then on).
The hash of the n-gram is the XOR of `id_k * multiplier_k` over its look-backs k, reduced modulo its
prime and shifted by the cumulative row offset of its (n, head) bucket range: 24 columns per layer
for the released model (n = 2..4, 8 heads).

Legend: B batch, L positions, G engram layers, N = max_ngram_size look-backs (current included),
C = (N - 1) * n_heads hash columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from dsv41_convert.engram_buckets import bucket_primes
from dsv41_convert.engram_tokens import pad_compressed_id, resolve_token_map
from dsv41_convert.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dsv41_convert.config import ModelArgs

# id written into the hash history for a position that takes no part in any n-gram (image spans)
DEAD = -1


@dataclass(frozen=True)
class EngramLayout:
    """Bucket layout of the Engram tables, shared by the hashing and the `Engram` modules.

    primes[g][n - 2][head] is the bucket count of n-gram size n and `head` in engram layer g.
    Each layer's table is these ranges laid end to end, so `num_embeddings[g]` (from the config) is
    their sum for the released model.
    """

    max_ngram_size: int
    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    n_heads: int
    head_dim: int

    @classmethod
    def from_args(cls, args: ModelArgs) -> EngramLayout | None:
        """The layout of `args`, or None when the model has no Engram layers."""
        layer_ids = tuple(args.engram_layer_ids)
        if not layer_ids:
            return None
        primes = bucket_primes(len(layer_ids), args.engram_max_ngram_size, args.engram_n_heads, args.engram_vocab_size)
        return cls(
            max_ngram_size=args.engram_max_ngram_size,
            layer_ids=layer_ids,
            num_embeddings=tuple(args.engram_num_embeddings),
            primes=primes,
            n_heads=args.engram_n_heads,
            head_dim=args.engram_head_dim,
        )

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    def table_rows(self) -> tuple[int, ...]:
        """Rows each layer's buckets need: the sum of its primes."""
        return tuple(sum(p for row in layer for p in row) for layer in self.primes)

    def row_offsets(self) -> list[list[int]]:
        """[G][C]: first table row of each hash column's bucket range (n-gram major, head minor)."""
        out = []
        for layer in self.primes:
            flat = [p for row in layer for p in row]
            out.append([sum(flat[:i]) for i in range(len(flat))])
        return out


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """Odd per-layer multipliers, one per look-back, small enough that id * multiplier fits int64.

    -> [G, N]  int64
    """
    bound = max(1, np.iinfo(np.int64).max // compressed_vocab_size // 2)
    rows = []
    for layer_id in layer_ids:
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(torch.from_numpy(draws * 2 + 1))
    return torch.stack(rows)


class NgramHashState(nn.Module):
    """Per-position Engram hash ids, with the compressed-id history kept across prefill and decode.

    Buffers (none persistent): token_map [vocab] int64, multipliers [G, N] int64, primes
    [G, N-1, heads] int64, offsets [G, C] int64, cache [max_batch_size, max_seq_len] int64.
    """

    def __init__(self, args: ModelArgs, layout: EngramLayout, tokenizer: Tokenizer | str | Path | list[int] | None):
        """`tokenizer`: the checkpoint's tokenizer (a `tokenizers.Tokenizer` or the path of its
        tokenizer.json), or an already built compressed token map."""
        super().__init__()
        token_map = resolve_token_map(tokenizer, args.engram_compressed_vocab_size)
        self.layout = layout
        self.max_ngram_size = layout.max_ngram_size
        self.pad_id = pad_compressed_id(token_map, args.engram_pad_id)
        multipliers = hash_multipliers(layout.layer_ids, layout.max_ngram_size, args.engram_compressed_vocab_size)
        self.token_map: torch.Tensor
        self.multipliers: torch.Tensor
        self.primes: torch.Tensor
        self.offsets: torch.Tensor
        self.cache: torch.Tensor
        self.register_buffer("token_map", torch.tensor(token_map, dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", multipliers, persistent=False)
        self.register_buffer("primes", torch.tensor(layout.primes, dtype=torch.int64), persistent=False)
        self.register_buffer("offsets", torch.tensor(layout.row_offsets(), dtype=torch.int64), persistent=False)
        self.register_buffer(
            "cache", torch.full((args.max_batch_size, args.max_seq_len), DEAD, dtype=torch.int64), persistent=False
        )

    def _require_mapped(self, input_ids: torch.Tensor) -> None:
        """ConfigError where an id lies past the token map, which covers the tokenizer's ids: a vocabulary padded
        past the tokenizer (a fine-tune's resize_token_embeddings) whose extra ids reach the model, in a prompt
        or as a greedy choice (upstream fails there with an IndexError, as this did: an audit)."""
        top = int(input_ids.max()) if input_ids.numel() else 0
        if top >= len(self.token_map):
            raise ConfigError(
                f"token id {top} reached the Engram hash, whose token map covers the tokenizer's "
                f"{len(self.token_map)} ids only (tokenizer.json has fewer ids than the config's vocab_size): "
                "give prompts of the tokenizer's ids; a greedy choice there means the head's padded rows win"
            )

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start_pos: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hash ids of the n-grams ending at each new position; positions before `start_pos` must
        have gone through an earlier call.

        input_ids:  [B, L]        int64 token ids
        token_mask: [B, L] bool   False at positions outside every n-gram (image spans); None = all True
        -> [B, L, G, C]           int64 table rows (offsets included), per engram layer
        """
        bsz, seqlen = input_ids.shape
        n = self.max_ngram_size
        self._require_mapped(input_ids)
        ids = self.token_map[input_ids]
        if token_mask is not None:
            ids = ids.masked_fill(~token_mask, DEAD)
        self.cache[:bsz, start_pos : start_pos + seqlen] = ids

        # the n-1 ids before the chunk come from the cache; before position 0 there is nothing,
        # which reads as DEAD just like an image position
        lo = max(0, start_pos - (n - 1))
        history = self.cache[:bsz, lo : start_pos + seqlen]
        missing = (n - 1) - (start_pos - lo)
        history = torch.cat([history.new_full((bsz, missing), DEAD), history], dim=1)
        windows = history.unfold(1, n, 1).flip(-1)  # [B, L, N]; index k = k positions back
        # once a look-back hits DEAD, every longer one is cut off too
        cut = (windows == DEAD).int().cummax(dim=-1).values.bool()
        tokens = windows.masked_fill(cut, self.pad_id)

        products = tokens.unsqueeze(2) * self.multipliers  # [B, L, G, N]
        acc = products[..., 0]
        cols = []
        for k in range(1, n):
            acc = acc ^ products[..., k]
            cols.append(acc.unsqueeze(-1) % self.primes[:, k - 1])  # [B, L, G, heads]
        return torch.cat(cols, dim=-1) + self.offsets


def expected_table_rows(args: ModelArgs) -> tuple[int, ...]:
    """Rows each Engram table needs for `args` (the sum of its primes); empty without Engram."""
    layout = EngramLayout.from_args(args)
    return () if layout is None else layout.table_rows()
