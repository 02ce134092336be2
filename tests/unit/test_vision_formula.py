"""The vision path against written-out expectations: patches cut from the image in row-major order
(patch k = row k // n_w, column k % n_w), and the ViT attention with its 2D rotary embedding
(element i of a head's first half turns with element i of its second half; the first rope_dim/2
angles follow the patch row, the last rope_dim/2 the column) on both queries and keys.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv41_convert.config import ModelArgs
from dsv41_convert.model import image_processor as ip
from dsv41_convert.model.vision import Attention, vision_rope
from dsv41_convert.synth.presets import TINY, hf_config

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

ARGS = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405))


def test_patches_are_cut_row_major():
    p = ARGS.vision_patch_size
    w, h = 12 * p, 9 * p  # already a patch multiple, inside the token budget, above min_pixels: no resize
    xs, ys = np.meshgrid(np.arange(w), np.arange(h))
    rgb = np.stack([xs % 256, ys % 256, (3 * xs + 7 * ys) % 256], axis=-1).astype(np.uint8)
    patches, n_vit_h, n_vit_w, _, _ = ip.load_image(Image.fromarray(rgb), ARGS)
    assert (n_vit_h, n_vit_w) == (9, 12)
    pixels = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255 * 2 - 1  # [3, h, w] in [-1, 1]
    for k in (0, 1, 11, 12, 50, 107):
        r, c = divmod(k, n_vit_w)
        want = pixels[:, r * p : (r + 1) * p, c * p : (c + 1) * p]
        torch.testing.assert_close(patches[k].float(), want.bfloat16().float(), atol=0, rtol=0)


def test_vit_attention_rotates_queries_and_keys_by_row_and_column():
    attn = Attention(ARGS)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    n_h, n_w, heads, hd = 3, 4, attn.n_heads, attn.head_dim
    rope_dim = hd // 2
    x = torch.randn(n_h * n_w, ARGS.vision_dim, generator=gen).bfloat16()
    cos, sin = vision_rope(n_h, n_w, rope_dim, ARGS.vision_rope_theta)
    got = attn(x, cos, sin)

    q, k, v = (
        t.double().view(-1, heads, hd)
        for t in torch.nn.functional.linear(x, attn.wqkv.weight, attn.wqkv.bias).chunk(3, -1)
    )
    half = rope_dim // 2
    inv = ARGS.vision_rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rope_dim)
    rows = torch.arange(n_h).repeat_interleave(n_w).double()
    cols = torch.arange(n_w).repeat(n_h).double()
    ang = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)[:, None]  # [N, 1, rope_dim]

    def turn(t):
        a, b = t[..., :rope_dim], t[..., rope_dim:]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)

    q, k = turn(q), turn(k)
    probs = torch.softmax(torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(hd), dim=-1)
    o = torch.einsum("hnm,mhd->nhd", probs, v).reshape(n_h * n_w, -1).bfloat16()
    want = torch.nn.functional.linear(o, attn.wo.weight, attn.wo.bias)
    err = (got.double() - want.double()).abs().max().item()
    assert err <= 2e-2 * want.double().abs().max().item()  # bf16 q/k/v rounding in the model


def _vision_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The vision RMSNorm in float64: x / sqrt(mean(x^2) + 1e-6) * w."""
    x = x.double()
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6) * w.double()


def test_vision_rmsnorm_uses_eps_1e_6():
    """The vision tower's RMSNorm divides by sqrt(mean(x^2) + 1e-6) (upstream's eps), visible on rows whose mean
    square is near eps. Planted fault it catches: another eps (1e-5, the usual default), which moves such rows
    by ~2x while leaving rows of unit scale unchanged within bf16."""
    from dsv41_convert.model.vision import RMSNorm

    norm = RMSNorm(ARGS.vision_dim)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(ARGS.vision_dim, generator=gen))
    x = (1e-3 * torch.randn(4, ARGS.vision_dim, generator=gen)).bfloat16()  # mean square ~1e-6
    got = norm(x)
    want = _vision_rms(x, norm.weight)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0, rtol=2**-7)  # one bf16 rounding of the output


def test_vit_block_is_prenorm_attention_then_swiglu_with_residuals():
    """One ViT block against a float64 restatement: x + attn(norm1(x)), then + w2(silu(gate) * up) of norm2 of
    that, where w1's first half of rows is the gate and its second half the up projection. The two norms get
    very different weights so that mixing them up shows. Planted faults it catches: gate and up swapped, the
    MLP reading norm1, the attention's residual dropped."""
    from dsv41_convert.model.vision import Block

    block = Block(ARGS)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name == "norm1.weight":
                p.copy_(0.5 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name == "norm2.weight":
                p.copy_(2.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    n_h, n_w = 2, 3
    heads, hd = block.attn.n_heads, block.attn.head_dim
    rope_dim = hd // 2
    x = torch.randn(n_h * n_w, ARGS.vision_dim, generator=gen).bfloat16()
    got = block(x, *vision_rope(n_h, n_w, rope_dim, ARGS.vision_rope_theta))

    def lin(t: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        out = t @ layer.weight.double().T
        return out if layer.bias is None else out + layer.bias.double()

    inv = ARGS.vision_rope_theta ** (-torch.arange(rope_dim // 2, dtype=torch.float64) * 2 / rope_dim)
    rows = torch.arange(n_h).repeat_interleave(n_w).double()
    cols = torch.arange(n_w).repeat(n_h).double()
    ang = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)[:, None]

    def turn(t: torch.Tensor) -> torch.Tensor:
        a, b = t[..., :rope_dim], t[..., rope_dim:]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)

    xd = x.double()
    q, k, v = (t.view(-1, heads, hd) for t in lin(_vision_rms(xd, block.norm1.weight), block.attn.wqkv).chunk(3, -1))
    probs = torch.softmax(torch.einsum("nhd,mhd->hnm", turn(q), turn(k)) / math.sqrt(hd), dim=-1)
    h = xd + lin(torch.einsum("hnm,mhd->nhd", probs, v).reshape(n_h * n_w, -1), block.attn.wo)
    gate, up = lin(_vision_rms(h, block.norm2.weight), block.mlp.w1).chunk(2, dim=-1)
    want = h + lin(torch.nn.functional.silu(gate) * up, block.mlp.w2)
    err = (got.double() - want).abs().max().item()
    assert err <= 5e-2 * want.abs().max().item(), err  # bf16 rounding of every linear (0.9e-2 seen; a fault: > 0.8)


def test_vit_runs_its_blocks_on_the_row_major_grid_then_the_final_norm():
    """ViT.forward is patch_embed, every block with the rotary angles of the n_h x n_w grid (row-major), then
    the final norm: bit for bit the same as those steps done by hand (vision_rope is checked against its
    formula in test_vision.py). Planted faults it catches: the grid passed transposed to the rotary table, the
    final norm skipped."""
    from dsv41_convert.model.vision import ViT

    vit = ViT(ARGS)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in vit.named_parameters():
            if name.endswith("norm.weight") or "norm1" in name or "norm2" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    n_h, n_w, p = 2, 3, ARGS.vision_patch_size
    patches = torch.randn(n_h * n_w, 3, p, p, generator=gen).bfloat16()
    got = vit(patches, n_h, n_w)
    cos, sin = vision_rope(n_h, n_w, vit.rope_dim, ARGS.vision_rope_theta)
    x = vit.patch_embed(patches)
    for block in vit.blocks:
        x = block(x, cos, sin)
    want = vit.norm(x)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
