"""The twin: the converter's expected tp-1 output, cut into ranks here, run beside the converted files.

A correct conversion at tp N runs exactly the numbers the converter's tp-1 output would, split the
way the model's parallel layers split them. So verify computes the tp-1 output in memory
(verify.source.expected_shards), cuts each rank's piece out of it, and runs it in the same rank
processes, with the same kernels, the same batch and the same reduction order as the converted files.
The two runs must agree bit for bit: like is compared with like, so no reduction noise and no top-k
flip can hide a fault, however chaotic a small random model is.

The cut is derived from the model itself, not from rules.py or plan.py (the code under test): each
rank's parameter shape says which dim the tensor is split on.

    local shape == full shape                    replicated (or a routed expert this rank owns)
    local [k, ...], full [k * N, ...]            rows r*k .. (r+1)*k       (column / vocab parallel)
    local [k, ...], full [n, ...], k = ceil(n/N) rows, last rank padded    (Engram: weight 0, scale 1.0)
    local [m, k],   full [m, k * N]              columns r*k .. (r+1)*k    (row parallel)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv41_convert.convert.plan import pad_byte
from dsv41_convert.errors import PlanError
from dsv41_convert.quant.file_dtypes import TORCH_TO_SAFETENSORS


def cut(full: Tensor, local: torch.Size, rank: int, world: int, name: str) -> Tensor:
    """This rank's piece of a tp-1 tensor, for a model parameter of shape `local` (see module doc)."""
    shape = tuple(full.shape)
    local = tuple(local)
    if shape == local:
        return full
    if len(shape) >= 1 and local[1:] == shape[1:] and local[0] * world >= shape[0]:
        k = local[0]
        if k * world == shape[0]:
            return full[rank * k : (rank + 1) * k]
        if k == -(-shape[0] // world):  # padded rows
            piece = full[min(rank * k, shape[0]) : min((rank + 1) * k, shape[0])]
            pad = k - piece.shape[0]
            if pad == 0:
                return piece
            fill = pad_byte(TORCH_TO_SAFETENSORS[full.dtype])
            tail = torch.full((pad, *shape[1:]), fill, dtype=torch.uint8).view(full.dtype)
            return torch.cat([piece.view(torch.uint8), tail.view(torch.uint8)]).view(full.dtype)
    if len(shape) == 2 and local[0] == shape[0] and local[1] * world == shape[1]:
        k = local[1]
        return full[:, rank * k : (rank + 1) * k].contiguous()
    raise PlanError(f"{name}: cannot cut a {list(shape)} tensor into this rank's {list(local)} (tp {world})")


def rank_state(model: nn.Module, full: dict[str, Tensor], rank: int, world: int) -> dict[str, Tensor]:
    """The state dict this rank's `model` takes, cut from the tp-1 tensors `full`."""
    from dsv41_convert.model.load import expected_tensors

    out = {}
    for name, (p, _owner) in expected_tensors(model).items():
        if name not in full:
            raise PlanError(f"{name}: the model has it, the converter's tp-1 output does not")
        # both hold fp4 as [.., last / 2] pairs, so torch shapes compare directly
        out[name] = cut(full[name], p.shape, rank, world, name)
    return out
