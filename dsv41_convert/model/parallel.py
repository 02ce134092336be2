"""Tensor-parallel context: one model per process, one process per rank.

world_size and rank come from torch.distributed when a process group is initialised, else 1 and 0.
Modules read them at construction, as upstream's Transformer sets its globals before building layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over ranks in place (no-op on one rank); returns x."""
    if world_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim, rank order (no-op on one rank).

    x: [..., n] -> [..., world_size * n], same dtype
    """
    world = world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
