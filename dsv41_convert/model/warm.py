"""Compile a model's kernels before its first forward pass, shared out over the ranks.

TileLang compiles one kernel per shape family the first time it meets it. Left to the forward pass,
every rank compiles every family one after another, in the middle of the collectives (a peer waits
in an all-reduce for minutes). Here each rank first compiles its share of the distinct families
(rank r takes every world-th), the ranks wait for each other once, and then every rank runs every
family: the families compiled by a peer come out of TileLang's disk cache.

Two kinds of family, each run once on zeros through the same op a forward pass calls:
- GemmFamily, a quantized weight shape: `linear()` on a one-row input compiles act_quant for its
  input width and the fp8 or fp4 GEMM for that weight.
- OpFamily, one kernel of another op: the in-place act_quant / fp4_act_quant of KV and index rows,
  hc_split_sinkhorn, and sparse_attn for every index-count bucket up to the most a layer can attend
  to at the model's max_seq_len (the count grows with the sequence, one kernel per bucket).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from dsv41_convert.kernels.dispatch import ops_for
from dsv41_convert.kernels.topk import topk_buckets
from dsv41_convert.model import parallel
from dsv41_convert.model.attention import COMPRESSED_KV_FP4_BLOCK, Attention
from dsv41_convert.model.block import Block
from dsv41_convert.model.indexer import Indexer
from dsv41_convert.model.layers import FP4_BLOCK, FP8_BLOCK, SCALE_DTYPE, SCALE_FMT, linear

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


@dataclass(frozen=True, order=True)
class OpFamily:
    """One kernel of a non-GEMM op, by the shapes and options it is compiled for.

    act_quant:         (width,)              in-place, FP8_BLOCK, ue8m0
    fp4_act_quant:     (width, block)        in-place; block 16 has e4m3 scales, 32 e8m0
    hc_split_sinkhorn: (hc_mult, iters, eps)
    sparse_attn:       (heads, head_dim, topk)   topk a bucket size: 64 * 2**j
    """

    op: str
    key: tuple


def gemm_families(model: nn.Module) -> list[GemmFamily]:
    """The distinct quantized weight shapes among `model`'s parameters, sorted (the same on every rank)."""
    found = set()
    for p in model.parameters():
        if p.dtype in GEMM_DTYPES and getattr(p, "scale", None) is not None:
            found.add(GemmFamily(str(p.dtype), p.shape[0], p.shape[1], tuple(p.scale.shape)))
    return sorted(found)


def max_topk(args) -> int:
    """The most KV rows one query can attend to at args.max_seq_len: the window plus the compressed rows
    the indexer may choose, or plus a DSpark draft block."""
    ratios = [r for r in args.compress_ratios if r]
    compressed = min(args.index_topk, args.max_seq_len // min(ratios)) if ratios else 0
    return args.window_size + max(compressed, args.dspark_block_size)


def op_families(model: nn.Module) -> list[OpFamily]:
    """The distinct non-GEMM kernels a forward pass of `model` can run, sorted (the same on every rank)."""
    found = set()
    buckets = topk_buckets(max_topk(model.args)) if hasattr(model, "args") else []
    for module in model.modules():
        if isinstance(module, Attention):
            found.add(OpFamily("act_quant", (module.head_dim,)))
            found.update(OpFamily("sparse_attn", (module.n_local_heads, module.head_dim, b)) for b in buckets)
            if module.is_kv_source:
                found.add(OpFamily("fp4_act_quant", (module.head_dim, COMPRESSED_KV_FP4_BLOCK)))
        elif isinstance(module, Indexer):
            found.add(OpFamily("fp4_act_quant", (module.index_head_dim, FP4_BLOCK)))
        elif isinstance(module, Block):
            found.add(OpFamily("hc_split_sinkhorn", (module.hc_mult, module.hc_sinkhorn_iters, module.hc_eps)))
    return sorted(found)


@torch.no_grad()
def run_family(family: GemmFamily | OpFamily, device: torch.device | str) -> None:
    """Run the op of `family` once on zeros of its shapes on `device`."""
    if isinstance(family, OpFamily):
        _run_op_family(family, device)
        return
    dtype = torch.float4_e2m1fn_x2 if family.dtype == str(torch.float4_e2m1fn_x2) else torch.float8_e4m3fn
    weight = torch.zeros(family.out_features, family.stored_in, dtype=torch.uint8, device=device).view(dtype)
    weight.scale = torch.full(family.scale_shape, 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)
    linear(torch.zeros(1, family.in_features, dtype=torch.bfloat16, device=device), weight)


def _run_op_family(family: OpFamily, device: torch.device | str) -> None:
    ops, key = ops_for(device), family.key

    def zeros(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype, device=device)

    if family.op == "act_quant":
        ops.act_quant(zeros(1, key[0]), FP8_BLOCK, SCALE_FMT, SCALE_DTYPE, True)
    elif family.op == "fp4_act_quant":
        width, block = key
        scale_dtype = torch.float8_e4m3fn if block == COMPRESSED_KV_FP4_BLOCK else None
        ops.fp4_act_quant(zeros(1, width), block, True, scale_dtype=scale_dtype)
    elif family.op == "hc_split_sinkhorn":
        hc, iters, eps = key
        mix = (2 + hc) * hc
        f32 = torch.float32
        ops.hc_split_sinkhorn(zeros(1, 1, mix, dtype=f32), zeros(3, dtype=f32), zeros(mix, dtype=f32), hc, iters, eps)
    elif family.op == "sparse_attn":
        heads, head_dim, topk = key
        idxs = torch.full((1, 1, topk), -1, dtype=torch.int32, device=device)
        ops.sparse_attn(
            zeros(1, 1, heads, head_dim), zeros(1, 1, head_dim), zeros(heads, dtype=torch.float32), idxs, 1.0
        )
    else:
        raise ValueError(f"no warm-up for op {family.op!r}")


def warm_up_kernels(model: nn.Module, device: torch.device | str) -> dict[str, float | int]:
    """Compile every kernel family of `model` on `device` (a no-op on the CPU: no kernels to compile).

    Under torch.distributed all ranks must call it together (it holds one barrier).
    -> {"families": n, "seconds": wall time}
    """
    t0 = time.perf_counter()
    families: list[GemmFamily | OpFamily] = [*gemm_families(model), *op_families(model)]
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
