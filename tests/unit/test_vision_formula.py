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
