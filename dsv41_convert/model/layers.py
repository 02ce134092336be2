"""Linear layers that pick their GEMM from the weight dtype, their tensor-parallel variants,
the vocab-parallel embedding and RMSNorm.

Parameter dtypes follow upstream, which builds the model under a bf16 default dtype: anything
without an explicit dtype there is bf16 here. `Linear(dtype=None)` takes the checkpoint's dense
dtype (fp8 e4m3 with an e8m0 scale per 32x32 tile, or bf16), set by `dense_dtype(args)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsv41_convert.kernels.dispatch import ops_for
from dsv41_convert.model import parallel

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs

FP8_BLOCK = 32  # one e8m0 scale per 32x32 fp8 weight tile, and per 32 activations
FP4_BLOCK = 32  # one e8m0 scale per 32 fp4 weights along K
SCALE_FMT = "ue8m0"
SCALE_DTYPE = torch.float8_e8m0fnu

_dense = [torch.float8_e4m3fn]  # stack: the innermost dense_dtype() wins


@contextmanager
def dense_dtype(args: ModelArgs) -> Iterator[None]:
    """While building a model: `Linear(dtype=None)` means e4m3 for dtype "fp8", bf16 for "bf16"."""
    _dense.append(torch.float8_e4m3fn if args.dtype == "fp8" else torch.bfloat16)
    try:
        yield
    finally:
        _dense.pop()


def default_dtype() -> torch.dtype:
    return _dense[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T, with the GEMM chosen by weight.dtype.

    x:      [..., in]   bfloat16 (float32 only for float32 weights)
    weight: [out, in]   float8_e4m3fn + weight.scale [ceil(out/32), in/32] e8m0  -> fp8 act x fp8 weight
            [out, in/2] float4_e2m1fn_x2 + weight.scale [out, in/32] e8m0       -> fp8 act x fp4 weight
            [out, in]   bfloat16 / float32                                     -> F.linear
    -> [..., out]       bfloat16 for quantized weights, else x's dtype
    """
    if bias is not None:
        raise ValueError("linear: the V4.1 text model has no biases")
    if weight.dtype == torch.float4_e2m1fn_x2:
        ops = ops_for(x.device)
        xq, xs = ops.act_quant(x, FP8_BLOCK, SCALE_FMT, SCALE_DTYPE)
        return ops.fp4_gemm(xq, xs, weight, weight.scale, SCALE_DTYPE, act_block_size=FP8_BLOCK)
    if weight.dtype == torch.float8_e4m3fn:
        ops = ops_for(x.device)
        xq, xs = ops.act_quant(x, FP8_BLOCK, SCALE_FMT, SCALE_DTYPE)
        return ops.fp8_gemm(xq, xs, weight, weight.scale, SCALE_DTYPE, block_size=FP8_BLOCK)
    return F.linear(x, weight)


class Linear(nn.Module):
    """A weight in bf16, fp32, fp8 or fp4. Quantized weights carry `scale`, also reachable as
    `weight.scale` so that `linear()` needs only the weight.

    weight: [out, in]    dtype (bf16 / fp32 / float8_e4m3fn)
            [out, in/2]  float4_e2m1fn_x2 (logical [out, in])
    scale:  [ceil(out/32), ceil(in/32)]  float8_e8m0fnu for fp8
            [out, in/32]                 float8_e8m0fnu for fp4
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        dtype = dtype or default_dtype()
        if dtype == torch.float4_e2m1fn_x2:
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=dtype))
            scale = torch.empty(out_features, in_features // FP4_BLOCK, dtype=SCALE_DTYPE)
            self.weight.scale = self.scale = nn.Parameter(scale)
        elif dtype == torch.float8_e4m3fn:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            tiles = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
            self.weight.scale = self.scale = nn.Parameter(torch.empty(tiles, dtype=SCALE_DTYPE))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=torch.bfloat16))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Output features split over ranks: each rank computes its own complete slice of the output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        world = parallel.world_size()
        if out_features % world:
            raise ValueError(f"ColumnParallelLinear: out_features {out_features} not divisible by world size {world}")
        self.part_out_features = out_features // world
        super().__init__(in_features, self.part_out_features, bias, dtype)


class RowParallelLinear(Linear):
    """Input features split over ranks: each rank holds a partial sum, summed across ranks in fp32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        world = parallel.world_size()
        if in_features % world:
            raise ValueError(f"RowParallelLinear: in_features {in_features} not divisible by world size {world}")
        self.part_in_features = in_features // world
        super().__init__(self.part_in_features, out_features, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in/world] bf16 -> [..., out] x's dtype (the fp32 rank sum, rounded once)."""
        y = linear(x, self.weight, None)
        if parallel.world_size() > 1:
            y = parallel.all_reduce(y.float())
        if self.bias is not None:
            y = y + self.bias
        return y.type_as(x)


class ParallelEmbedding(nn.Module):
    """Vocab rows split over ranks. A rank looks up the ids it owns, zeroes the rest, and the
    ranks sum, so exactly one real row survives per id.

    weight: [vocab / world, dim]  bfloat16
    """

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        world = parallel.world_size()
        if vocab_size % world:
            raise ValueError(f"ParallelEmbedding: vocab_size {vocab_size} not divisible by world size {world}")
        self.vocab_size = vocab_size
        self.dim = dim
        self.part_vocab_size = vocab_size // world
        self.vocab_start_idx = parallel.rank() * self.part_vocab_size
        self.vocab_end_idx = self.vocab_start_idx + self.part_vocab_size
        self.weight = nn.Parameter(torch.empty(self.part_vocab_size, dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [...] int64 token ids -> [..., dim] bfloat16."""
        if parallel.world_size() == 1:
            return F.embedding(x, self.weight)
        elsewhere = (x < self.vocab_start_idx) | (x >= self.vocab_end_idx)
        local = (x - self.vocab_start_idx).masked_fill(elsewhere, 0)
        y = F.embedding(local, self.weight).masked_fill(elsewhere.unsqueeze(-1), 0)
        return parallel.all_reduce(y)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32, returned in x's dtype.

    weight: [dim]  bfloat16
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)
