"""Vision tower, aligner and image preprocessing on tiny shapes."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch

from dsv41_convert.config import MIN_IMAGE_SPAN, ModelArgs
from dsv41_convert.model import image_processor as ip
from dsv41_convert.model.vision import Aligner, ViT, vision_rope
from dsv41_convert.synth.presets import TINY, hf_config

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405))


def _seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return module


def test_state_dict_names_and_dtypes(args):
    vit, aligner = ViT(args), Aligner(args)
    sd = vit.state_dict()
    assert sd["patch_embed.proj.weight"].shape == (args.vision_dim, 3 * 14 * 14)
    assert sd["blocks.1.attn.wqkv.weight"].shape == (3 * args.vision_dim, args.vision_dim)
    assert sd["blocks.1.attn.wqkv.bias"].shape == (3 * args.vision_dim,)
    assert sd["blocks.0.attn.wo.bias"].dtype == torch.bfloat16
    assert sd["blocks.0.mlp.w1.weight"].shape == (2 * args.vision_inter_dim, args.vision_dim)
    assert "blocks.0.mlp.w1.bias" not in sd
    assert sd["blocks.0.norm1.weight"].dtype == torch.float32 and sd["norm.weight"].dtype == torch.float32
    assert len([k for k in sd if k.startswith("blocks.")]) == args.vision_n_layers * 8
    asd = aligner.state_dict()
    assert asd["w1.weight"].shape == (args.dim, args.vision_dim * 9) and "w2.bias" in asd


def test_vision_rope_angles_follow_row_then_column():
    cos, sin = vision_rope(2, 3, 8, 10000.0)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    for i in range(2):
        for j in range(3):
            angles = torch.cat([i * inv, j * inv])
            torch.testing.assert_close(cos[i * 3 + j, 0], angles.cos(), atol=0, rtol=0)
            torch.testing.assert_close(sin[i * 3 + j, 0], angles.sin(), atol=0, rtol=0)


def test_aligner_folds_3x3_groups_with_zero_padding(args):
    aligner = _seeded(Aligner(args), 0)
    n_h, n_w, v = 4, 5, args.vision_dim
    x = torch.randn(n_h * n_w, v, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = aligner(x, n_h, n_w)
    grid = torch.zeros(6, 6, v, dtype=torch.bfloat16)
    grid[:n_h, :n_w] = x.view(n_h, n_w, v)
    groups = []
    for a in range(2):
        for b in range(2):
            block = grid[3 * a : 3 * a + 3, 3 * b : 3 * b + 3]  # [dy, dx, v]
            groups.append(block.permute(2, 0, 1).flatten())  # feature-major, then row, column
    folded = torch.stack(groups)
    want = aligner.w2(torch.nn.functional.gelu(aligner.w1(folded)))
    assert got.shape == (4, args.dim)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_vit_is_position_aware_and_weight_sensitive(args):
    vit = _seeded(ViT(args), 2)
    patches = torch.randn(6, 3, 14, 14, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = vit(patches, 2, 3)
    assert out.shape == (6, args.vision_dim) and out.dtype == torch.bfloat16 and out.isfinite().all()
    # the same patches on a transposed grid get other rotary angles
    assert not torch.equal(out, vit(patches, 3, 2))
    with torch.no_grad():
        vit.blocks[1].attn.wo.weight[0, 0] += 1.0
    assert not torch.equal(out, vit(patches, 2, 3))


def test_span_layout():
    types = ip.image_token_types(2, 3)
    s, i, n, e = ip.IMAGE_START, ip.IMAGE, ip.IMAGE_NEW_LINE, ip.IMAGE_END
    assert types.tolist() == [s, i, i, i, n, i, i, i, n, e]
    assert ip.num_image_tokens(2, 3) == types.numel() == 10
    assert ip.TEXT == -1


@pytest.mark.parametrize("size", [(50, 40), (126, 126), (300, 200), (200, 900), (2000, 60), (60, 2000)])
def test_grid_plan_fits_budget_and_minimum(args, size):
    w, h = size
    n_llm_h, n_llm_w, th, tw = ip.plan_image_grid(w, h, args)
    assert th % 14 == 0 and tw % 14 == 0
    assert (n_llm_h, n_llm_w) == (math.ceil(th // 14 / 3), math.ceil(tw // 14 / 3))
    assert ip.num_image_tokens(n_llm_h, n_llm_w) <= args.vision_max_n_token
    if w * h < args.vision_min_pixels:  # upscaled to at least min_pixels (up to rounding)
        assert th * tw >= args.vision_min_pixels * 0.98


@pytest.mark.parametrize("size", [(50, 40), (300, 200), (200, 900), (2000, 60), (60, 2000)])
def test_the_smallest_budget_the_config_allows_fits_every_image_in_one_token(args, size):
    """config.MIN_IMAGE_SPAN is the span of a 1 x 1 grid, and every image fits that budget (below it, none did)."""
    tight = dataclasses.replace(args, vision_max_n_token=MIN_IMAGE_SPAN)
    assert ip.plan_image_grid(*size, tight)[:2] == (1, 1) and ip.num_image_tokens(1, 1) == MIN_IMAGE_SPAN


def test_load_image_patches_and_gray_padding(args, tmp_path):
    img = Image.new("RGB", (140, 70), (255, 0, 0))
    path = tmp_path / "red.png"
    img.save(path)
    patches, n_vit_h, n_vit_w, _, _ = ip.load_image(path, args)
    assert patches.shape == (n_vit_h * n_vit_w, 3, 14, 14) and patches.dtype == torch.bfloat16
    grid = patches.view(n_vit_h, n_vit_w, 3, 14, 14)
    # wide image: padded top and bottom with gray 127, centre stays pure red
    gray = (127 / 255 - 0.5) / 0.5
    torch.testing.assert_close(grid[0, 0, :, 0, 0].float(), torch.full((3,), gray).bfloat16().float())
    mid = grid[n_vit_h // 2, n_vit_w // 2, :, 7, 7].float()
    assert mid.tolist() == [1.0, -1.0, -1.0]
    # the same image given as PIL, path or bytes gives the same patches
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    assert torch.equal(ip.load_image(buf.getvalue(), args)[0], patches)
    assert torch.equal(ip.load_image(img, args)[0], patches)


def test_prepare_vl_inputs_expands_each_placeholder(args):
    img = Image.new("RGB", (150, 150), (0, 128, 255))
    t = args.image_token_id
    ids, types, images = ip.prepare_vl_inputs([5, 6, t, 7, t], [img, img], args)
    first, second = images
    span = first.types.numel()
    assert first.start == 2 and second.start == 2 + span + 1
    assert ids == [5, 6] + [t] * span + [7] + [t] * span
    assert types[:2] == [-1, -1] and types[2 : 2 + span] == first.types.tolist() and types[2 + span] == -1
    with pytest.raises(ValueError, match="1 image placeholders"):
        ip.prepare_vl_inputs([5, t], [img, img], args)
    assert ip.prepare_vl_inputs([5, 6], [], args) == ([5, 6], [-1, -1], None)


def test_prepare_vl_inputs_without_vision_tower():
    no_vision = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405, vision=False))
    with pytest.raises(ValueError, match="no vision tower"):
        ip.prepare_vl_inputs([no_vision.image_token_id], [Image.new("RGB", (20, 20))], no_vision)


def test_grid_plan_values_written_out(args):
    """plan_image_grid on sizes worked by hand (tiny preset: patch 14, 3x3 patches per token, at most 64 span
    tokens, min_pixels 126 * 126 = 15876). Planted faults it catches: the target size rounded instead of
    ceiled to the patch, an image between min_pixels / 2 and min_pixels not scaled up, the budget fit choosing a
    smaller grid than the largest that fits."""
    # 300 x 200: ceil(300 / 14) = 22 and ceil(200 / 14) = 15 patches -> 308 x 210 px, 8 x 5 tokens,
    # span 5 * (8 + 1) + 2 = 47 <= 64 (rounding would give 21 x 14 patches)
    assert ip.plan_image_grid(300, 200, args) == (5, 8, 210, 308)
    # 100 x 100 = 10000 px < 15876: scaled by sqrt(15876 / 10000) = 1.26 to 126 x 126 -> 9 x 9 patches, 3 x 3 tokens
    assert ip.plan_image_grid(100, 100, args) == (3, 3, 126, 126)
    # 2000 x 1000: 143 x 72 patches want a 48 x 24 grid, span 24 * 49 + 2 = 1178 > 64. The largest 2:1 grid that
    # fits is 10 x 5 (span 5 * 11 + 2 = 57; 12 x 6 gives 6 * 13 + 2 = 80): 420 x 210 px, 30 x 15 patches
    assert ip.plan_image_grid(2000, 1000, args) == (5, 10, 210, 420)


def test_text_only_prompt_on_a_model_without_vision_passes_through():
    """A model without a vision tower refuses image placeholders only: a text-only prompt comes back as it was
    (types all TEXT, no images). Planted fault it catches: the refusal made unconditional on the model, which
    broke every text prompt of a text-only checkpoint."""
    no_vision = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405, vision=False))
    assert ip.prepare_vl_inputs([5, 6, 7], [], no_vision) == ([5, 6, 7], [-1, -1, -1], None)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_a_non_rgb_pil_image_is_cut_as_its_rgb_conversion(args, mode):
    """A PIL image in another mode (grayscale, with alpha, palette) is converted to RGB before it is cut: its
    patches equal those of img.convert("RGB"). Planted fault it catches: a PIL image passed on unconverted
    (its pixel array has no or four channels, and load_image failed on it)."""
    img = Image.new("RGB", (60, 50))
    img.putdata([((x * 9) % 256, (y * 11) % 256, (x + y) % 256) for y in range(50) for x in range(60)])
    other = img.convert(mode)
    want = ip.load_image(other.convert("RGB"), args)
    got = ip.load_image(other, args)
    assert got[1:] == want[1:] and torch.equal(got[0], want[0])


def test_merge_image_spans_writes_each_slot_its_own_vector(args):
    """merge_image_spans writes an image's span in place: IMAGE_START, IMAGE_NEW_LINE and IMAGE_END slots get
    the owner's image_start / image_newline / image_end, the IMAGE slots the encoder's rows in row-major order;
    encode gets the patch grid as (n_vit_h, n_vit_w); rows outside the span stay as they were. Planted faults it
    catches: a delimiter given another delimiter's vector, the span shifted, the grid passed transposed."""
    from types import SimpleNamespace

    from dsv41_convert.model.transformer import merge_image_spans

    dim, n_llm_h, n_llm_w, start = 4, 2, 3, 2
    owner = SimpleNamespace(
        image_start=torch.full((dim,), 100.0, dtype=torch.bfloat16),
        image_end=torch.full((dim,), 200.0, dtype=torch.bfloat16),
        image_newline=torch.full((dim,), 300.0, dtype=torch.bfloat16),
    )
    types = ip.image_token_types(n_llm_h, n_llm_w)  # S I I I N I I I N E
    seq = start + types.numel() + 2
    h = torch.arange(seq * dim, dtype=torch.float32).view(1, seq, dim).neg().bfloat16()  # distinct negative rows
    before = h.clone()
    calls = []

    def encode(patches, n_vit_h, n_vit_w):
        calls.append((n_vit_h, n_vit_w))
        return (1 + torch.arange(n_llm_h * n_llm_w)).float()[:, None].expand(-1, dim)  # row t holds t + 1

    img = ip.ImageInput(start, torch.zeros(6 * 9, 3, 14, 14), 6, 9, types)
    merge_image_spans(owner, [[img]], h, encode)
    assert calls == [(6, 9)]
    want = [100, 1, 2, 3, 300, 4, 5, 6, 300, 200]
    assert h[0, start : start + types.numel(), 0].tolist() == want
    assert (h[0, start : start + types.numel()] == h[0, start : start + types.numel(), :1]).all()
    assert torch.equal(h[0, :start], before[0, :start]) and torch.equal(h[0, start + types.numel() :], before[0, -2:])
