"""Mixture of experts: a router, routed SwiGLU experts split over ranks, one shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dsv41_convert.model import parallel
from dsv41_convert.model.layers import Linear

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs

ROUTE_NORM_EPS = 1e-20  # added to the sum of the chosen scores; a constant of training, not norm_eps


class Gate(nn.Module):
    """Chooses `topk` experts per token and their weights.

    The bias (bias_vl for tokens inside an image span) only steers which experts are chosen; the
    weights are the unbiased scores of the chosen ones, normalised to sum 1 (norm_topk_prob),
    times route_scale.

    weight:  [n_routed_experts, dim]  bfloat16 (the scores are computed in fp32)
    bias:    [n_routed_experts]       float32
    bias_vl: [n_routed_experts]       float32, only with vision
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        n_routed, n_active = args.moe_config(layer_id)
        self.dim = args.dim
        self.topk = n_active
        self.score_func = args.score_func
        self.norm_topk_prob = args.norm_topk_prob
        self.route_scale = args.route_scale
        self.weight = nn.Parameter(torch.empty(n_routed, args.dim, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.empty(n_routed, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.empty(n_routed, dtype=torch.float32)) if args.vision_enabled else None

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [n, dim] bfloat16; image_mask: [n] bool, True inside an image span
        -> weights [n, topk] float32, indices [n, topk] int64"""
        scores = F.linear(x.float(), self.weight.float())
        if self.score_func == "softmax":
            scores = scores.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        elif self.score_func == "sqrtsoftplus":
            scores = F.softplus(scores).sqrt()
        else:
            raise ValueError(f"Gate: unknown score_func {self.score_func!r}")
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, bias)
        indices = (scores + bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob and self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTE_NORM_EPS)
        return weights * self.route_scale, indices


class Expert(nn.Module):
    """A SwiGLU FFN computed in fp32 between its GEMMs. With swiglu_limit > 0 (training's clamp)
    the up branch is clamped to [-limit, limit] and the gate branch only from above. A routing
    weight, when given, scales the activation before w2.

    w1, w3: [inter_dim, dim], w2: [dim, inter_dim]   fp4 (routed experts) or fp8 (shared expert)
    """

    def __init__(self, dim: int, inter_dim: int, dtype: torch.dtype | None = None, swiglu_limit: float = 0.0):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, dtype=dtype)
        self.w2 = Linear(inter_dim, dim, dtype=dtype)
        self.w3 = Linear(dim, inter_dim, dtype=dtype)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x: [n, dim] bfloat16, weights: [n, 1] float32 or None -> [n, dim] bfloat16"""
        gate = self.w1(x).float()
        up = self.w3(x).float()
        if self.swiglu_limit > 0:
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
            gate = gate.clamp(max=self.swiglu_limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = weights * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    """Routed experts plus one shared expert. Routed expert E lives on rank E // (n_routed / world);
    `experts[E]` is None on the other ranks, and the ranks' partial outputs are summed in fp32."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        n_routed, n_active = args.moe_config(layer_id)
        world = parallel.world_size()
        if n_routed % world:
            raise ValueError(f"MoE layer {layer_id}: {n_routed} experts not divisible by world size {world}")
        if args.n_shared_experts != 1:
            raise ValueError(f"MoE: n_shared_experts must be 1, got {args.n_shared_experts}")
        self.layer_id = layer_id
        self.dim = args.dim
        self.n_routed_experts = n_routed
        self.n_local_experts = n_routed // world
        self.n_activated_experts = n_active
        self.experts_start_idx = parallel.rank() * self.n_local_experts
        self.experts_end_idx = self.experts_start_idx + self.n_local_experts
        self.gate = Gate(layer_id, args)
        expert_dtype = torch.float4_e2m1fn_x2 if args.expert_dtype == "fp4" else None
        self.experts = nn.ModuleList(
            [
                Expert(args.dim, args.moe_inter_dim, dtype=expert_dtype, swiglu_limit=args.swiglu_limit)
                if self.experts_start_idx <= i < self.experts_end_idx
                else None
                for i in range(n_routed)
            ]
        )
        self.shared_experts = Expert(args.dim, args.moe_inter_dim, swiglu_limit=args.swiglu_limit)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [b, s, dim] bfloat16; image_mask: [b, s] bool or None -> [b, s, dim] bfloat16"""
        shape = x.shape
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x, None if image_mask is None else image_mask.flatten())
        y = torch.zeros_like(x, dtype=torch.float32)
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        for i in range(self.experts_start_idx, self.experts_end_idx):
            if counts[i] == 0:
                continue
            rows, slot = torch.where(indices == i)
            y[rows] += self.experts[i](x[rows], weights[rows, slot, None])
        parallel.all_reduce(y)
        y += self.shared_experts(x)
        return y.type_as(x).view(shape)
