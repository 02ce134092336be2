"""The vision tower (ViT) and the aligner that turns its patch features into LLM token embeddings.

One image at a time, no batch dimension: the patch grid is n_h x n_w, every patch attends to every
other (bidirectional), positions enter through a 2D rotary embedding (half the rotary frequencies
follow the patch row, half the column). The aligner folds each 3x3 group of patches into one token.
Everything here is replicated on every rank and runs in bf16 (norm weights fp32), as upstream.

Legend: N patches (n_h * n_w), P = 3 * patch_size**2 pixels per patch, V vision dim, K heads,
Dh head dim, T LLM tokens of the image grid, D model dim.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs

VISION_NORM_EPS = 1e-6


def _bf16_linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, dtype=torch.bfloat16)


@lru_cache(8)
def vision_rope(n_h: int, n_w: int, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the 2D rotary angles, patches in row-major order.

    The first rope_dim/2 angles use the patch row, the last rope_dim/2 the patch column.
    -> ([N, 1, rope_dim], [N, 1, rope_dim])  float32
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    rows = torch.arange(n_h).repeat_interleave(n_w).float()
    cols = torch.arange(n_w).repeat(n_h).float()
    angles_NR = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
    return angles_NR.cos().unsqueeze(1), angles_NR.sin().unsqueeze(1)


def rotate_half_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate element i of the first half with element i of the second half, in fp32.

    x: [N, K, Dh] bfloat16, cos/sin: [N, 1, Dh/2] float32 -> [N, K, Dh] bfloat16
    """
    first, second = x.float().chunk(2, dim=-1)
    out = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (the vision tower's own; eps 1e-6)."""

    # bf16 in the checkpoint, held in fp32 as upstream: loading widens it exactly
    bf16_on_disk = True

    def __init__(self, dim: int, eps: float = VISION_NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = _bf16_linear(3 * args.vision_patch_size**2, args.vision_dim, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches: [N, 3, p, p] bfloat16 -> [N, V] bfloat16"""
        return self.proj(patches.flatten(1))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.vision_n_heads
        self.head_dim = args.vision_dim // args.vision_n_heads
        self.wqkv = _bf16_linear(args.vision_dim, 3 * args.vision_dim, bias=True)
        self.wo = _bf16_linear(args.vision_dim, args.vision_dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [N, V] bfloat16 -> [N, V] bfloat16"""
        n = x.size(0)
        q_NKD, k_NKD, v_NKD = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q_NKD = rotate_half_pairs(q_NKD, cos, sin)
        k_NKD = rotate_half_pairs(k_NKD, cos, sin)
        o_KND = F.scaled_dot_product_attention(q_NKD.transpose(0, 1), k_NKD.transpose(0, 1), v_NKD.transpose(0, 1))
        return self.wo(o_KND.transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    """SwiGLU; w1 holds the gate rows then the up rows."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = _bf16_linear(args.vision_dim, 2 * args.vision_inter_dim, bias=False)
        self.w2 = _bf16_linear(args.vision_inter_dim, args.vision_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm1 = RMSNorm(args.vision_dim)
        self.attn = Attention(args)
        self.norm2 = RMSNorm(args.vision_dim)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch embedding, `vision_n_layers` pre-norm blocks with 2D RoPE, final RMSNorm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.rope_dim = args.vision_dim // args.vision_n_heads // 2
        self.rope_theta = args.vision_rope_theta
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList([Block(args) for _ in range(args.vision_n_layers)])
        self.norm = RMSNorm(args.vision_dim)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches: [n_h * n_w, 3, p, p] bfloat16, row-major -> [n_h * n_w, V] bfloat16"""
        x = self.patch_embed(patches)
        cos, sin = vision_rope(n_h, n_w, self.rope_dim, self.rope_theta)
        cos, sin = cos.to(x.device), sin.to(x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """Fold each r x r group of patch features (zero-padded at the right and bottom edges) into one
    vector, then w2(gelu(w1(.))) to the model dim. Unfold order: feature-major, then row, column."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.downsample_ratio = args.vision_downsample_ratio
        self.w1 = _bf16_linear(args.vision_dim * self.downsample_ratio**2, args.dim, bias=True)
        self.w2 = _bf16_linear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """x: [n_h * n_w, V] bfloat16 -> [ceil(n_h/r) * ceil(n_w/r), D] bfloat16, row-major"""
        r = self.downsample_ratio
        grid_VHW = x.view(n_h, n_w, -1).permute(2, 0, 1)
        grid_VHW = F.pad(grid_VHW, (0, -n_w % r, 0, -n_h % r))
        groups_TX = F.unfold(grid_VHW.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)
        return self.w2(F.gelu(self.w1(groups_TX)))


def encode_image(vision: ViT, aligner: Aligner, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    """patches: [n_h * n_w, 3, p, p] bfloat16 -> [T, D] bfloat16 token embeddings, row-major"""
    return aligner(vision(patches, n_h, n_w), n_h, n_w)
