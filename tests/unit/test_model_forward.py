"""The whole text model at tp 1: outputs, hidden-state capture, prefill vs decode, sampling,
and that a planted weight error reaches the logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_testing import random_state_dict, tiny_args, write_shards

from dsv41_convert.model import Transformer, load_shards
from dsv41_convert.model.head import sample
from dsv41_convert.store.safetensors_header import read_header

ARGS = tiny_args()
SEQ = 40


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_mp1")
    write_shards(random_state_dict(ARGS, seed=0), ARGS, folder, 1)
    return folder


@pytest.fixture(scope="module")
def model(shards) -> Transformer:
    m = Transformer(ARGS)
    load_shards(m, shards)
    return m


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))


def test_outputs_and_hidden_states(model, ids):
    hs: dict[str, torch.Tensor] = {}
    out, logits, main_hidden = model(ids, hidden_states=hs)
    assert logits.shape == (2, ARGS.vocab_size) and logits.dtype == torch.float32
    assert torch.equal(out, logits.argmax(-1)) and main_hidden is None
    assert bool(torch.isfinite(logits).all()) and logits.std() > 0.1
    want = {"embed", "norm"} | {f"layers.{i}{s}" for i in range(6) for s in ("", ".attn", ".ffn", ".pre_mix")}
    want |= {f"layers.{i}.engram" for i in ARGS.engram_layer_ids}
    want |= {f"layers.{i}.attn.indexer" for i, layer in enumerate(model.layers) if layer.attn.indexer is not None}
    want.add(f"layers.{ARGS.candidate_source_layer}.attn.candidates")
    assert set(hs) == want
    blocks, source = hs[f"layers.{ARGS.candidate_source_layer}.attn.candidates"], ARGS.candidate_source_layer
    assert blocks.shape == (2, SEQ, SEQ // ARGS.compress_ratios[source]) and blocks.dtype == torch.int8
    assert any(k.endswith(".indexer") for k in want)  # the tiny model has index sources
    assert hs["layers.5.pre_mix"].shape == (2, SEQ, ARGS.hc_mult) and hs["layers.5.pre_mix"].dtype == torch.float32
    d = ARGS.dim
    assert hs["embed"].shape == hs["norm"].shape == hs["layers.3.attn"].shape == hs["layers.3.ffn"].shape == (2, SEQ, d)
    assert hs["layers.5"].shape == (2, SEQ, ARGS.hc_mult, d)
    # capture leaves no hooks behind, and capturing does not change the result
    assert all(not layer.attn._forward_hooks and not layer.ffn._forward_hooks for layer in model.layers)
    assert all(layer.attn.indexer is None or not layer.attn.indexer._forward_hooks for layer in model.layers)
    _, again, _ = model(ids)
    assert torch.equal(again, logits)


def test_all_logits(model, ids):
    _, last, _ = model(ids)
    out, full, _ = model(ids, all_logits=True)
    assert full.shape == (2, SEQ, ARGS.vocab_size) and out.shape == (2, SEQ)
    # the head is an fp32 GEMM of 2 rows vs 80 rows: last-bit differences only
    torch.testing.assert_close(full[:, -1], last, atol=1e-6, rtol=0)


def test_decode_matches_prefill_of_the_same_prefix(model, ids, shards):
    """Decode step t against a prefill of tokens 0..t (same batch, last-position head): bit-exact.

    Measured with these seeds: steps 4..17 are bit-exact. At position 18 the two paths first part:
    the decode GEMMs see 2 rows where the prefill GEMMs see 38, the fp32 sums round differently in
    the last bit, and after bf16 rounding that flips an fp4/fp8 activation code or an indexer top-k
    choice; from then on the caches differ and so does every later step (upstream does the same,
    bit for bit). Window ring wrap (8), ratio-2 and ratio-1 compression, and top-k selection
    (8 of up to 16 compressed positions) all happen inside the exact range.
    """
    reference = Transformer(ARGS)  # a second model, so the decode chain keeps its own caches
    load_shards(reference, shards)
    model(ids[:, :4])
    exact_until = 18
    for t in range(4, exact_until):
        _, step, _ = model(ids[:, t : t + 1], t)
        _, ref, _ = reference(ids[:, : t + 1])
        assert torch.equal(step, ref), f"decode step {t} differs from prefill of 0..{t}"


def test_greedy_generation_of_prefill_then_decode_is_consistent(model, ids):
    out, _, _ = model(ids[:, :8])
    tokens = [out]
    for t in range(8, 12):
        out, _, _ = model(tokens[-1].unsqueeze(1), t)
        tokens.append(out)
    seq = torch.cat([ids[:, :8], torch.stack(tokens[:-1], 1)], dim=1)
    out_prefill, _, _ = model(seq)
    assert torch.equal(out_prefill, tokens[-1])


def test_rejects_bad_calls(model, ids):
    with pytest.raises(ValueError, match="one token per step"):
        model(ids[:, :2], 5)
    with pytest.raises(ValueError, match="max_batch_size"):
        model(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, ARGS.max_seq_len + 1, dtype=torch.long))


def test_sample():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    assert sample(logits, 0.0).tolist() == [1]
    torch.manual_seed(0)
    two = torch.tensor([0.0, float(torch.log(torch.tensor(3.0)))]).expand(20000, 2)
    frac = sample(two, 1.0).float().mean().item()  # P(1) = 3/4
    assert abs(frac - 0.75) < 0.02


def _flip_byte(path: Path, tensor: str, index: int) -> None:
    entry = read_header(path).tensors[tensor]
    data = bytearray(path.read_bytes())
    data[entry.begin + index] ^= 0x08  # one mantissa bit of an e4m3 value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tensor", ["layers.2.attn.wq_b.weight", "layers.4.ffn.shared_experts.w2.weight"])
def test_planted_weight_error_moves_the_logits(model, ids, shards, tmp_path, tensor):
    planted = tmp_path / "model0-mp1.safetensors"
    planted.write_bytes((shards / "model0-mp1.safetensors").read_bytes())
    _flip_byte(planted, tensor, 100)
    bad = Transformer(ARGS)
    load_shards(bad, tmp_path)
    _, good_logits, _ = model(ids)
    _, bad_logits, _ = bad(ids)
    assert (good_logits - bad_logits).abs().max() > 1e-3


def test_captured_indexer_choice_is_int64(model, ids):
    """hidden_states["layers.{i}.attn.indexer"] is int64, as Transformer.forward documents it (the indexer
    itself returns int32), with the indexer's values. Planted fault it catches: the choice captured in the
    indexer's own dtype (the reference file and verify.teacher then hold int32 where int64 is promised)."""
    hs: dict[str, torch.Tensor] = {}
    model(ids, hidden_states=hs)
    keys = [k for k in hs if k.endswith(".attn.indexer")]
    assert keys
    for key in keys:
        choice = hs[key]
        assert choice.dtype == torch.int64, key
        assert choice.shape[:2] == (2, SEQ) and int(choice.min()) >= -1 and int(choice.max()) >= 0, key
