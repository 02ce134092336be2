"""verify end to end on make-tiny checkpoints: correct conversions pass at tp 1, 2, 4, 8 from fp8 and
bf16 sources; planted faults fail and are named. One short prompt (24 tokens, longer than the tiny
preset's 16-token window) and one decode step keep each run to seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.errors import VerifyInputError
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify.prompts import default_prompts
from dsv41_convert.verify.run import VerifyOptions, verify

PROMPT_LEN = 24
pytestmark = pytest.mark.slow  # each test runs the model (seconds to a minute on 2 cores)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    ids = default_prompts(TINY.vocab_size, count=1, length=PROMPT_LEN)[0].input_ids
    (root / "prompts.jsonl").write_text(json.dumps({"input_ids": list(ids)}) + "\n")
    return root


def _source(work: Path, dtype: str) -> Path:
    src = work / f"src-{dtype}"
    if not src.exists():
        write_checkpoint(src, TINY, seed=0, quantized=dtype == "fp8", vision=False)
    return src


def _shard(work: Path, dtype: str, tp: int) -> Path:
    out = work / f"{dtype}-mp{tp}"
    if not out.exists():
        execute(build_plan(_source(work, dtype), tp), out)
    return out


def _verify(work: Path, conv: Path, dtype: str = "fp8", **kw):
    opts = VerifyOptions(conv, reference=_source(work, dtype), prompts=work / "prompts.jsonl", n_decode=1, threads=1)
    for k, v in kw.items():
        setattr(opts, k, v)
    return verify(opts)


def _faulty(work: Path, name: str, tp: int = 2, dtype: str = "fp8") -> Path:
    """A writable copy of a correct conversion, to plant one fault in."""
    dst = work / f"fault-{name}"
    shutil.copytree(_shard(work, dtype, tp), dst)
    return dst


def _edit(folder: Path, rank: int, tp: int, fn) -> None:
    path = folder / f"model{rank}-mp{tp}.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _named(result, prefix: str) -> bool:
    return any(t.name.startswith(prefix) for t in result.localization.tensors)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.dist), pytest.param(4, marks=pytest.mark.dist),
                                pytest.param(8, marks=[pytest.mark.dist, pytest.mark.slow])])  # fmt: skip
def test_passes_from_fp8_source(work, tp):
    result = _verify(work, _shard(work, "fp8", tp))
    assert result.ok, result.failures
    assert result.thresholds.mode == ("exact" if tp == 1 else "reduction")
    # like with like: the twin agrees bit for bit on every section
    assert set(result.twin) == {"last", "all", "decode", "draft", "confidence"}
    assert all(s.max_abs == 0 and s.kl_max == 0 for s in result.twin.values())
    if tp == 1:
        assert all(s.max_abs == 0 for s in result.overall.values())


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.dist), pytest.param(4, marks=pytest.mark.dist),
                                pytest.param(8, marks=pytest.mark.dist)])  # fmt: skip
def test_passes_from_bf16_source(work, tp):
    result = _verify(work, _shard(work, "bf16", tp), dtype="bf16")
    assert result.ok, result.failures
    assert result.thresholds.mode == "quantized"
    assert all(s.max_abs == 0 for s in result.twin.values())
    assert result.overall["last"].max_abs > 0  # the bf16 reference really differs from its quantization


def test_reference_logits_file_round_trip(work, tmp_path):
    from dsv41_convert.verify import reffile
    from dsv41_convert.verify.prompts import load_prompts
    from dsv41_convert.verify.reference import compute_reference

    src = _source(work, "fp8")
    prompts = load_prompts(work / "prompts.jsonl", None, TINY.vocab_size)
    reffile.save(compute_reference(src, prompts, n_decode=1).reference, tmp_path / "ref.safetensors")
    opts = VerifyOptions(_shard(work, "fp8", 1), reference_logits=tmp_path / "ref.safetensors", threads=1)
    result = verify(opts)
    assert result.ok and result.thresholds.mode == "exact"
    assert all(s.max_abs == 0 for s in result.overall.values())


@pytest.mark.dist
def test_fault_experts_swapped_between_ranks(work):
    conv = _faulty(work, "swap")
    r0 = load_file(str(conv / "model0-mp2.safetensors"))
    r1 = load_file(str(conv / "model1-mp2.safetensors"))
    layer, a, b = 0, 1, 9  # expert 1 lives on rank 0, expert 9 on rank 1 (16 experts, tp 2)
    for part in ("w1", "w2", "w3"):
        for kind in ("weight", "scale"):
            ka, kb = f"layers.{layer}.ffn.experts.{a}.{part}.{kind}", f"layers.{layer}.ffn.experts.{b}.{part}.{kind}"
            r0[ka], r1[kb] = r1[kb].clone(), r0[ka].clone()
    save_file(r0, str(conv / "model0-mp2.safetensors"))
    save_file(r1, str(conv / "model1-mp2.safetensors"))
    result = _verify(work, conv)
    assert not result.ok
    assert result.localization.module == f"layers.{layer}.ffn"
    assert _named(result, f"layers.{layer}.ffn.experts.{a}.") and _named(result, f"layers.{layer}.ffn.experts.{b}.")
    assert {t.ranks for t in result.localization.tensors} <= {(0,), (1,)}


@pytest.mark.dist
def test_fault_column_parallel_split_on_wrong_dim(work):
    conv = _faulty(work, "wrongdim")
    full = _shard_full(work, "layers.3.attn.wq_b.weight")  # [512, 64] e4m3 at tp 1

    def wrong(rank):
        def fn(t):
            piece = full[:, rank * 32 : (rank + 1) * 32].contiguous()  # columns, not rows ...
            t["layers.3.attn.wq_b.weight"] = piece.reshape(t["layers.3.attn.wq_b.weight"].shape)  # ... made to fit

        return fn

    _edit(conv, 0, 2, wrong(0))
    _edit(conv, 1, 2, wrong(1))
    result = _verify(work, conv)
    assert not result.ok
    assert result.localization.module == "layers.3.attn"
    assert result.localization.tensors[0].name == "layers.3.attn.wq_b.weight"


@pytest.mark.dist
def test_fault_split_on_wrong_dim_changes_shape(work):
    conv = _faulty(work, "wrongdim-shape")
    full = _shard_full(work, "layers.3.attn.wq_b.weight")
    _edit(conv, 1, 2, lambda t: t.__setitem__("layers.3.attn.wq_b.weight", full[:, 32:].contiguous()))
    result = _verify(work, conv)
    assert not result.ok and result.load_error is not None
    assert "layers.3.attn.wq_b.weight" in result.load_error and "rank 1" in result.load_error
    assert _named(result, "layers.3.attn.wq_b.weight")


@pytest.mark.dist
def test_fault_scale_byte_changed(work):
    conv = _faulty(work, "scale")
    name = "layers.1.attn.wkv.scale"

    def bump(t):
        raw = t[name].view(torch.uint8).clone()
        raw[0, 0] += 2  # x4 on one 32x32 block
        t[name] = raw.view(torch.float8_e8m0fnu)

    _edit(conv, 1, 2, bump)
    result = _verify(work, conv)
    assert not result.ok
    assert result.localization.module == "layers.1.attn"
    diff = result.localization.tensors[0]
    assert diff.name == name and diff.ranks == (1,)


@pytest.mark.dist
def test_fault_expert_nibble_flipped(work):
    conv = _faulty(work, "nibble")
    expert = _routed_expert(work, layer=2)
    rank = expert // (TINY.n_routed_experts // 2)
    name = f"layers.2.ffn.experts.{expert}.w1.weight"

    def flip(t):
        raw = t[name].view(torch.uint8).clone()
        flat = raw.flatten()
        at = int((flat & 0x07).argmax())  # a low nibble of the largest magnitude (6.0)
        flat[at] ^= 0x08  # its sign bit: one e2m1 value changes sign
        t[name] = flat.reshape(raw.shape).view(torch.float4_e2m1fn_x2)

    _edit(conv, rank, 2, flip)
    result = _verify(work, conv)
    assert not result.ok
    assert result.localization.module == "layers.2.ffn"
    assert [t.name for t in result.localization.tensors] == [name]


@pytest.mark.dist
def test_fault_missing_engram_padding_row(work):
    tp = 4  # 12458 rows of layer 0's table: 3115 per rank, the last one padded
    conv = _faulty(work, "engram-pad", tp=tp)
    last = tp - 1

    def drop(t):
        for k in ("layers.0.engram.embed.weight", "layers.0.engram.embed.scale"):
            t[k] = t[k][:-1].contiguous()

    _edit(conv, last, tp, drop)
    result = _verify(work, conv, tp=tp)
    assert not result.ok
    assert "layers.0.engram.embed.weight" in result.load_error and f"rank {last}" in result.load_error
    assert _named(result, "layers.0.engram.embed.")


@pytest.mark.dist
def test_fault_wo_a_left_fp8(work):
    conv = _faulty(work, "wo_a")
    src = _source(work, "fp8")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    name = "layers.2.attn.wo_a"
    w = load_file(str(src / index[f"{name}.weight"]))[f"{name}.weight"]
    s = load_file(str(src / index[f"{name}.scale"]))[f"{name}.scale"]
    for rank in range(2):
        rows, srows = w.shape[0] // 2, s.shape[0] // 2

        def fp8(t, rank=rank, rows=rows, srows=srows):
            t[f"{name}.weight"] = w[rank * rows : (rank + 1) * rows].contiguous()
            t[f"{name}.scale"] = s[rank * srows : (rank + 1) * srows].contiguous()

        _edit(conv, rank, 2, fp8)
    result = _verify(work, conv)
    assert not result.ok
    assert f"{name}.weight: found F8_E4M3" in result.load_error
    assert _named(result, f"{name}.weight")


def _shard_full(work: Path, name: str) -> torch.Tensor:
    return load_file(str(_shard(work, "fp8", 1) / "model0-mp1.safetensors"))[name]


def _routed_expert(work: Path, layer: int) -> int:
    """The expert of `layer` that most of the test prompt's tokens are routed to (tp 1 run, gate hook)."""
    from dsv41_convert.config import load_model_args
    from dsv41_convert.model.load import load_shards
    from dsv41_convert.verify.prompts import load_prompts
    from dsv41_convert.verify.runner import build_model

    folder = _shard(work, "fp8", 1)
    args = load_model_args(folder / "config.json").with_runtime(max_batch_size=1, max_seq_len=128)
    model = build_model(args, folder, "cpu")
    load_shards(model, folder)
    seen = {}
    model.layers[layer].ffn.gate.register_forward_hook(lambda m, i, o: seen.update(idx=o[1]) or None)
    ids = load_prompts(work / "prompts.jsonl", None, TINY.vocab_size)[0].input_ids
    model(torch.tensor([ids]), 0)
    return int(torch.bincount(seen["idx"].flatten()).argmax())


@pytest.mark.dist
def test_fault_tokenizer_not_the_sources(work):
    """The twin runs with CONVERTED's tokenizer.json, so a changed one (Engram hashes its ids) was
    reproduced bit for bit: an audit's tokenizer with reversed vocab ids passed `--reference SRC` at tp 2.
    (A missing one is an input error: the model cannot load without it.)"""
    conv = _faulty(work, "tokenizer")
    tok = conv / "tokenizer.json"
    vocab = json.loads(tok.read_text())
    model = vocab["model"]["vocab"]
    a, b = sorted(model, key=model.get)[20:22]
    model[a], model[b] = model[b], model[a]  # two ordinary tokens' ids exchanged
    tok.write_text(json.dumps(vocab))
    result = _verify(work, conv)
    assert result.verdict == "FAIL", (result.failures, result.checks)
    assert any(f.startswith("tokenizer: ") and "tokenizer.json" in f for f in result.failures), result.failures
    assert result.localization.module is None and "the tokenizer, not a weight" in result.localization.note
    doc = result.to_json()
    assert doc["verdict"] == "FAIL" and doc["decisive"] == [] and "twin" in doc["held"]  # was decisive: [twin]


def test_a_file_only_the_manifest_misses_is_not_localized_in_the_model(work):
    """hf_config.json removed: every output agrees and only the manifest check fails; the report named the
    model's head as the first diverging module, "the head or a decode-only path differs" (an audit)."""
    conv = _faulty(work, "no-hf-config", tp=1)
    (conv / "hf_config.json").unlink()
    result = _verify(work, conv)
    size = (_shard(work, "fp8", 1) / "hf_config.json").stat().st_size
    assert result.verdict == "FAIL"
    assert result.failures == [f"manifest: hf_config.json: missing (manifest lists {size} bytes)"]
    assert result.localization.module is None and "the manifest check" in result.localization.note


def test_a_hugging_face_config_in_place_of_the_inference_config_is_refused(work):
    """The nested HF config.json put where shard writes the flat inference config: verify read it as well and
    passed, while upstream's inference, which reads the flat one, cannot load the folder (an audit)."""
    conv = _faulty(work, "nested-config")
    shutil.copy(conv / "hf_config.json", conv / "config.json")
    with pytest.raises(VerifyInputError, match=r"config.json: a Hugging Face config \(text_config\), not the"):
        _verify(work, conv)


@pytest.mark.dist
def test_fault_hf_config_not_the_sources(work):
    """hf_config.json (SRC's config.json, which shard copies unchanged and the bundled model never reads): an
    audit's routed_scaling_factor changed in it passed `--reference SRC` bit for bit."""
    conv = _faulty(work, "hf-config")
    cfg = json.loads((conv / "hf_config.json").read_text())
    cfg["text_config"]["routed_scaling_factor"] = 1.0
    (conv / "hf_config.json").write_text(json.dumps(cfg))
    result = _verify(work, conv)
    assert result.verdict == "FAIL", (result.failures, result.checks)
    assert f"hf config: {conv / 'hf_config.json'} differs from" in "\n".join(result.failures)
    assert all(s.max_abs == 0 for s in result.twin.values())  # the logits could not tell
    assert "a side file, not a weight" in result.localization.note


def test_a_vocabulary_padded_past_the_tokenizer_verifies_on_the_tokenizers_ids(tmp_path):
    """A fine-tune's resize_token_embeddings(..., pad_to_multiple_of=64): vocab_size and the embedding and head
    rows grow past the tokenizer's ids. It converts; the built-in prompts drew ids past the tokenizer, and the
    Engram hash (its token map covers the tokenizer's ids) ended verify in an IndexError (an audit). The
    prompts now stay within the tokenizer, and an id past it is refused naming it."""
    from dsv41_convert.config import load_model_args
    from dsv41_convert.errors import ConfigError
    from dsv41_convert.model.engram_hash import EngramLayout, NgramHashState

    src, padded, grown = tmp_path / "src", TINY.vocab_size + 64, []
    write_checkpoint(src, TINY, seed=0, quantized=False, vision=False)
    for shard in src.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name, t in tensors.items():
            if t.shape[0] == TINY.vocab_size and (name.endswith(("embed.weight", "head.weight"))):
                tensors[name] = torch.cat([t, t[:64]])  # copies: a greedy tie goes to the lower id
                grown.append(name)
        save_file(tensors, str(shard))
    assert len(grown) >= 2, grown
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["vocab_size"] = padded
    (src / "config.json").write_text(json.dumps(config))
    conv = tmp_path / "mp2"
    execute(build_plan(src, 2), conv)
    result = verify(VerifyOptions(conv, reference=src, n_decode=1, threads=1))
    assert result.ok, result.failures
    args = load_model_args(conv / "config.json").with_runtime(max_batch_size=1, max_seq_len=64)
    assert args.vocab_size == padded
    hashes = NgramHashState(args, EngramLayout.from_args(args), conv / "tokenizer.json")
    with pytest.raises(ConfigError, match=rf"token id {TINY.vocab_size} reached the Engram hash"):
        hashes(torch.tensor([[5, TINY.vocab_size]]), 0)
    # a reference file whose ids lie past the tokenizer: refused naming the file before a rank starts (the
    # ranks ended on it, naming neither the file nor the prompt: an audit)
    from safetensors import safe_open

    from dsv41_convert.verify import reffile
    from dsv41_convert.verify.reference import compute_reference

    path = tmp_path / "ref.safetensors"
    reffile.save(compute_reference(src, default_prompts(TINY.vocab_size, 1, 24), 1).reference, path)
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["input_ids"][0, 2] = TINY.vocab_size + 5
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(VerifyInputError, match=rf"{path}: .*token ids \[{TINY.vocab_size + 5}\] outside \[0, 512\)"):
        verify(VerifyOptions(conv, reference_logits=path, threads=1))
