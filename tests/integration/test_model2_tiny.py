"""Engram, DSpark and vision on make-tiny checkpoints sharded at tp 1: each part is live (a
corrupted weight of it moves the outputs) and wired where upstream wires it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dsv41_convert.config import load_model_args
from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.model import image_processor as ip
from dsv41_convert.model.load import load_shards
from dsv41_convert.model.transformer import Transformer
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

pytestmark = pytest.mark.slow  # ~10 model forwards per test on CPU

PROMPT = "Hello world, the model answers the question"


def make_shards(root: Path, *, vision: bool, tp: int, seed: int = 0) -> Path:
    """make-tiny, then shard at `tp`; returns the shard folder."""
    src, out = root / "src", root / f"mp{tp}"
    if not src.exists():
        write_checkpoint(src, TINY, seed=seed, vision=vision)
    execute(build_plan(src, tp), out)
    return out


def load_model(folder: Path, **runtime) -> Transformer:
    args = load_model_args(folder / "config.json").with_runtime(
        max_batch_size=2, max_seq_len=runtime.get("max_seq_len", 128), temperature=0.0
    )
    model = Transformer(args, folder / "tokenizer.json")
    load_shards(model, folder)
    return model.eval()


def test_image(width: int = 100, height: int = 70) -> Image.Image:
    img = Image.new("RGB", (width, height))
    px = img.load()
    for x in range(width):
        for y in range(height):
            px[x, y] = ((x * 7) % 256, (y * 5) % 256, (x * y) % 256)
    return img


test_image.__test__ = False  # a helper, not a test


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("tiny_vl"), vision=True, tp=1)


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory) -> Path:
    return make_shards(tmp_path_factory.mktemp("tiny_text"), vision=False, tp=1, seed=1)


@pytest.fixture(scope="module")
def text_model(text_folder) -> Transformer:
    return load_model(text_folder)


@pytest.fixture(scope="module")
def vl_model(vl_folder) -> Transformer:
    return load_model(vl_folder)


@contextmanager
def corrupted(param: torch.Tensor, fn) -> Iterator[None]:
    """Apply `fn` to a parameter in place for the duration of the block, then restore it."""
    saved = param.detach().clone()
    with torch.no_grad():
        fn(param)
    try:
        yield
    finally:
        with torch.no_grad():
            param.copy_(saved)


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _prompt_ids(folder: Path) -> torch.Tensor:
    return torch.tensor([_tokenizer(folder).encode(PROMPT, add_special_tokens=False).ids])


def test_text_model_engram_and_dspark(text_model, text_folder):
    model = text_model
    assert model.vision is None and model.engram_hash is not None and len(model.mtp) == 3
    assert [layer.engram is not None for layer in model.layers] == [True, True, False, False, False, False]
    ids = _prompt_ids(text_folder)
    out, prefill, hidden = model(ids, 0)
    assert prefill.shape == (1, TINY.vocab_size) and prefill.isfinite().all()
    assert hidden.shape == (1, ids.size(1), 3 * model.args.dim)
    assert model.forward_spec(out, hidden, 0) is None  # prefill only seeds the DSpark windows
    t = ids.size(1)
    out, _, hidden = model(out.view(1, 1), t)
    draft_ids, draft_logits, confidence = model.forward_spec(out, hidden, t)
    k = model.args.dspark_block_size
    assert draft_logits.shape == (1, k, TINY.vocab_size) and draft_logits.dtype == torch.float32
    assert confidence.shape == (1, k) and confidence.isfinite().all()
    assert draft_ids.shape == (1, k + 1) and draft_ids[0, 0] == out[0]
    # at temperature 0 each draft is the argmax of its (Markov-biased) logits
    assert torch.equal(draft_ids[:, 1:], draft_logits.argmax(-1))

    # redoing the draft step is idempotent; a corrupted Markov head changes the drafts only
    again = model.forward_spec(out, hidden, t)
    assert torch.equal(again[1], draft_logits) and torch.equal(again[2], confidence)
    with corrupted(model.mtp[-1].markov_head.head.weight, lambda w: w.mul_(-3.0)):
        bad = model.forward_spec(out, hidden, t)
    assert not torch.equal(bad[1], draft_logits) and not torch.equal(bad[2], confidence)
    with corrupted(model.mtp[0].main_proj.weight, lambda w: w.copy_((-w.float()).to(w.dtype))):
        _, _, hidden2 = model(ids, 0)
        assert torch.equal(hidden2, model(ids, 0)[2])  # main_proj is not in the backbone
    torch.testing.assert_close(model(ids, 0)[1], prefill, atol=0, rtol=0)


def test_wrong_engram_row_changes_logits(text_model, text_folder):
    model = text_model
    ids = _prompt_ids(text_folder)
    base = model(ids, 0)[1]
    hashes = model.engram_hash(ids, 0)
    engram = model.layers[1].engram
    col = hashes[0, :, engram.layer_hash_index, :]
    row = int(col[-1, 5])  # a row the last position reads
    with corrupted(engram.embed.weight, lambda w: w[row].copy_((-w[row].float()).to(w.dtype))):
        assert not torch.equal(model(ids, 0)[1], base)
    unread = next(r for r in range(engram.embed.part_num_embeddings) if not (col == r).any())
    with corrupted(engram.embed.weight, lambda w: w[unread].copy_((-w[unread].float() + 1).to(w.dtype))):
        assert torch.equal(model(ids, 0)[1], base)
    assert torch.equal(model(ids, 0)[1], base)


def test_image_prompt(vl_model, vl_folder):
    model = vl_model
    tok = _tokenizer(vl_folder)
    ids, types, images = ip.build_vl_prompt(tok, ["Hello world, ", test_image(), " the model"], model.args)
    span = images[0][0]
    assert (ids[0, span.start : span.start + span.types.numel()] == model.args.image_token_id).all()
    assert (types[0, span.start : span.start + span.types.numel()] >= 0).all()
    assert (types[0, : span.start] == ip.TEXT).all()
    _, logits, _ = model(ids, 0, images, types)
    assert logits.isfinite().all()

    # the image's content reaches the logits, and so does the vision tower's last block
    flipped = ip.build_vl_prompt(tok, ["Hello world, ", test_image().transpose(0), " the model"], model.args)
    assert torch.equal(flipped[0], ids)
    assert not torch.equal(model(flipped[0], 0, flipped[2], flipped[1])[1], logits)
    text_ids = ids[:, : span.start]
    text_logits = model(text_ids, 0)[1]
    with corrupted(model.vision.blocks[-1].mlp.w2.weight, lambda w: w.mul_(-1.0)):
        assert not torch.equal(model(ids, 0, images, types)[1], logits)
        assert torch.equal(model(text_ids, 0)[1], text_logits)  # text never touches the tower
    with corrupted(model.aligner.w2.bias, lambda b: b.add_(0.5)):
        assert not torch.equal(model(ids, 0, images, types)[1], logits)
    assert torch.equal(model(ids, 0, images, types)[1], logits)


def test_image_tokens_route_with_bias_vl(vl_model, vl_folder):
    """Image positions choose experts with gate.bias_vl: changing it moves an image prompt only."""
    model = vl_model
    ids, types, images = ip.build_vl_prompt(_tokenizer(vl_folder), ["Hello ", test_image(), " world"], model.args)
    text_ids = _prompt_ids(vl_folder)
    base_img = model(ids, 0, images, types)[1]
    base_txt = model(text_ids, 0)[1]
    gates = [layer.ffn.gate.bias_vl for layer in model.layers]
    saved = [g.detach().clone() for g in gates]
    with torch.no_grad():
        for g in gates:
            g.copy_(-g * 50)
    try:
        assert not torch.equal(model(ids, 0, images, types)[1], base_img)
        assert torch.equal(model(text_ids, 0)[1], base_txt)
    finally:
        with torch.no_grad():
            for g, s in zip(gates, saved, strict=True):
                g.copy_(s)


def test_images_only_in_first_chunk(vl_model, vl_folder, tmp_path):
    path = tmp_path / "img.png"
    test_image().save(path)
    ids, types, images = ip.build_image_prompt(_tokenizer(vl_folder), str(path), vl_model.args, before="Hi ")
    assert images[0][0].start == ids.size(1) - images[0][0].types.numel()
    vl_model(ids[:, :1], 0)
    with pytest.raises(ValueError, match="first prefill chunk"):
        vl_model(ids[:, 1:2], 1, images, types[:, 1:2])


def test_text_only_checkpoint_rejects_images(text_folder):
    args = load_model_args(text_folder / "config.json")
    with pytest.raises(ValueError, match="no vision tower"):
        ip.prepare_vl_inputs([args.image_token_id], [test_image()], args)
