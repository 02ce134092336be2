"""Compile a model's GEMM kernels before its first forward pass, shared out over the ranks.

TileLang compiles one kernel per weight shape family the first time it meets it. Left to the forward
pass, every rank compiles every family one after another, in the middle of the collectives (a peer
waits in an all-reduce for minutes). Here each rank first compiles its share of the distinct families
(rank r takes every world-th), the ranks wait for each other once, and then every rank runs every
family: the families compiled by a peer come out of TileLang's disk cache.

A family is one quantized weight shape: `linear()` on it runs act_quant on a row of its input width
and the fp8 or fp4 GEMM for that weight, so one call on a one-row zero input compiles both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from dsv41_convert.model import parallel
from dsv41_convert.model.layers import linear

GEMM_DTYPES = (torch.float8_e4m3fn, torch.float4_e2m1fn_x2)


@dataclass(frozen=True, order=True)
class GemmFamily:
    """A quantized weight shape: weight [out, stored_in] of `dtype` with scale [scale_shape] e8m0."""

    dtype: str
    out_features: int
    stored_in: int  # in_features, or in_features / 2 for fp4 (two values a byte)
    scale_shape: tuple[int, ...]

    @property
    def in_features(self) -> int:
        return self.stored_in * (2 if self.dtype == str(torch.float4_e2m1fn_x2) else 1)


def gemm_families(model: nn.Module) -> list[GemmFamily]:
    """The distinct quantized weight shapes among `model`'s parameters, sorted (the same on every rank)."""
    found = set()
    for p in model.parameters():
        if p.dtype in GEMM_DTYPES and getattr(p, "scale", None) is not None:
            found.add(GemmFamily(str(p.dtype), p.shape[0], p.shape[1], tuple(p.scale.shape)))
    return sorted(found)


@torch.no_grad()
def run_family(family: GemmFamily, device: torch.device | str) -> None:
    """One `linear()` of a zero row through a zero weight of this family on `device`."""
    dtype = torch.float4_e2m1fn_x2 if family.dtype == str(torch.float4_e2m1fn_x2) else torch.float8_e4m3fn
    weight = torch.zeros(family.out_features, family.stored_in, dtype=torch.uint8, device=device).view(dtype)
    weight.scale = torch.full(family.scale_shape, 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    linear(torch.zeros(1, family.in_features, dtype=torch.bfloat16, device=device), weight)


def warm_up_gemms(model: nn.Module, device: torch.device | str) -> dict[str, float | int]:
    """Compile every GEMM family of `model` on `device` (a no-op on the CPU: no kernels to compile).

    Under torch.distributed all ranks must call it together (it holds one barrier).
    -> {"families": n, "seconds": wall time}
    """
    t0 = time.perf_counter()
    families = gemm_families(model)
    if torch.device(device).type != "cuda" or not families:
        return {"families": len(families), "seconds": 0.0}
    world, me = parallel.world_size(), parallel.rank()
    for family in families[me::world]:
        run_family(family, device)
    if parallel.is_distributed():
        torch.distributed.barrier()
    for family in families:
        run_family(family, device)
    torch.cuda.synchronize(device)
    return {"families": len(families), "seconds": round(time.perf_counter() - t0, 3)}
