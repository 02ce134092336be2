"""The vocab-parallel output head and token sampling (shared by the backbone and the DSpark stages)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41_convert.model import parallel


class ParallelHead(nn.Module):
    """The output projection, vocab rows split over ranks; fp32 so the logits come out fp32.

    weight: [vocab / world, dim]  float32 (the shards hold it in bf16; loading widens it exactly)
    """

    def __init__(self, vocab_size: int, dim: int, norm_eps: float = 1e-6, hc_eps: float = 1e-6):
        super().__init__()
        self.vocab_size = vocab_size
        self.dim = dim
        self.norm_eps = norm_eps
        self.hc_eps = hc_eps
        self.part_vocab_size = vocab_size // parallel.world_size()
        self.weight = nn.Parameter(torch.empty(self.part_vocab_size, dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, full_logits: bool = False) -> torch.Tensor:
        """x: [b, s, dim] -> [b, vocab] (last position) or [b, s, vocab] (full_logits), float32,
        gathered over ranks"""
        if not full_logits:
            x = x[:, -1]
        return parallel.all_gather_last(F.linear(x.float(), self.weight))


def sample(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Next token: argmax at temperature 0, else a Gumbel-max draw (the same distribution as
    multinomial sampling of softmax(logits / temperature)).

    logits: [..., vocab] float32 -> [...] int64
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / max(temperature, 1e-5), dim=-1, dtype=torch.float32)
    return probs.div_(torch.empty_like(probs).exponential_(1)).argmax(dim=-1)
