"""The layer-streamed model (model/streamed.py, verify/streamed.py) against the whole model at tp 1:
bit-identical prefill, decode and draft logits and hidden states, for fp8 and bf16 sources and an
image prompt; and the streamed path reads only what it needs (routed experts, touched Engram rows)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from stream_testing import assert_bit_identical, expected_param_bytes, whole_model_runs, write_sources

from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify.prompts import default_prompts, load_prompts
from dsv41_convert.verify.reference import pick_max_seq_len
from dsv41_convert.verify.runner import draft_block, model_input
from dsv41_convert.verify.source import SourceWeights
from dsv41_convert.verify.streamed import compute_streamed_reference, fixed_decode_ids

N_DECODE = 2


class CountingWeights(SourceWeights):
    """SourceWeights that records what the streamed model asks for."""

    def __init__(self, src: Path):
        super().__init__(src)
        self.names: list[str] = []
        self.row_reads: dict[str, int] = {}

    def __call__(self, names):
        self.names += list(names)
        return super().__call__(names)

    def rows(self, names, rows):
        for n in names:
            self.row_reads[n] = self.row_reads.get(n, 0) + rows.numel()
        return super().rows(names, rows)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("streamed")
    return write_sources(root)


@pytest.mark.slow  # the whole model and the streamed one, 2 prompts x 3 steps each
@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_streamed_equals_whole_model_bit_for_bit(sources, dtype):
    src = sources[dtype]
    prompts = default_prompts(TINY.vocab_size, count=2)
    ref, timings = compute_streamed_reference(src, prompts, N_DECODE)
    assert ref.source_format == dtype
    assert [t.unit for t in timings] == ["embed", *(f"layers.{i}" for i in range(6)), "mtp.0", "mtp.1", "mtp.2", "head"]
    assert ref.runs[0].draft_logits.shape == (N_DECODE, 5, TINY.vocab_size)
    whole = whole_model_runs(src, prompts, N_DECODE, [r.decode_ids for r in ref.runs])
    assert_bit_identical(ref.runs, whole)


def test_streamed_model_without_dspark_stages_equals_whole_model(tmp_path):
    """A variant without DSpark stages (num_nextn_predict_layers 0, dspark_block_size still set) streams without
    drafts: it was refused, 'the model wants mtp.-1.norm.weight, which the source does not provide'."""
    import dataclasses

    from dsv41_convert.synth.write import write_checkpoint

    preset = dataclasses.replace(
        TINY, name="no-mtp", n_mtp_layers=0, compress_ratios=TINY.compress_ratios[:6], dspark_target_layer_ids=()
    )
    src = tmp_path / "no-mtp"
    write_checkpoint(src, preset, quantized=True, vision=False)
    prompts = default_prompts(TINY.vocab_size, count=1)
    ref, timings = compute_streamed_reference(src, prompts, 2)
    assert [t.unit for t in timings] == ["embed", *(f"layers.{i}" for i in range(6)), "head"]
    assert ref.runs[0].draft_logits is None
    whole = whole_model_runs(src, prompts, 2, [r.decode_ids for r in ref.runs])
    assert_bit_identical(ref.runs, whole)


@pytest.mark.slow
def test_streamed_image_prompt_bit_for_bit(sources, tmp_path):
    from PIL import Image

    from dsv41_convert.verify.prompts import Prompt

    img = Image.new("RGB", (100, 70))
    img.putdata([((x * 7) % 256, (y * 5) % 256, (x * y) % 256) for y in range(70) for x in range(100)])
    img.save(tmp_path / "a.png")
    prompts = [Prompt(tuple(range(5, 25)), "vl", image=str(tmp_path / "a.png"))]
    ref, timings = compute_streamed_reference(sources["fp8"], prompts, 1)
    assert timings[0].unit == "vision" and (ref.inputs[0].token_types >= 0).any()
    whole = whole_model_runs(sources["fp8"], prompts, 1, [r.decode_ids for r in ref.runs])
    assert_bit_identical(ref.runs, whole)


def test_a_wrong_tensor_from_the_provider_moves_the_logits(sources, monkeypatch):
    """The streamed model computes with what the provider hands it (a unit is not silently skipped)."""
    from dsv41_convert.model import streamed

    prompts = default_prompts(TINY.vocab_size, count=1, length=20)
    args = _args(sources["fp8"], prompts, n_decode=0)
    good = SourceWeights(sources["fp8"])

    def bad(names):
        got = good(names)
        key = "layers.4.attn.wo_b.scale"
        if key in got:
            got[key] = (got[key].view(torch.uint8) + 1).view(torch.float8_e8m0fnu)  # every block doubled
        return got

    bad.rows = good.rows
    inputs = [_stream_prompt(p, args, 0) for p in prompts]
    ok, _ = streamed.run_streamed(args, good, inputs, sources["fp8"] / "tokenizer.json")
    wrong, _ = streamed.run_streamed(args, bad, inputs, sources["fp8"] / "tokenizer.json")
    assert not torch.equal(ok[0].logits_all, wrong[0].logits_all)


def test_reads_only_routed_experts_and_touched_engram_rows(sources):
    from dsv41_convert.model import streamed

    prompts = default_prompts(TINY.vocab_size, count=1, length=20)
    args = _args(sources["fp8"], prompts, n_decode=0)
    weights = CountingWeights(sources["fp8"])
    _, timings = streamed.run_streamed(args, weights, [_stream_prompt(p, args, 0) for p in prompts],
                                       sources["fp8"] / "tokenizer.json")  # fmt: skip
    assert not any("engram.embed" in n for n in weights.names)  # never through the whole-tensor call
    table_rows = args.engram_num_embeddings
    for layer, rows in zip(args.engram_layer_ids, table_rows, strict=True):
        touched = weights.row_reads[f"layers.{layer}.engram.embed.weight"]
        assert 0 < touched <= 20 * 24 < rows  # at most one row per (position, hash column)
    for i in range(args.n_layers):
        experts = {n.split(".")[3] for n in weights.names if n.startswith(f"layers.{i}.ffn.experts.")}
        assert 0 < len(experts) <= timings[1 + i].experts_read < args.n_routed_experts
    assert not any(n.startswith("mtp.") for n in weights.names)  # no decode step, no drafts


def test_unread_experts_hold_no_memory(sources):
    """A layer unit holds its dense weights and the experts the router picked; the others are empty
    placeholders until read. Planted fault it catches: every expert allocated when the unit is built (the
    earlier behaviour, which on CUDA moved all 384 experts of a layer to the GPU)."""
    from dsv41_convert.model import streamed

    prompts = default_prompts(TINY.vocab_size, count=1, length=20)
    args = _args(sources["fp8"], prompts, n_decode=0)
    inputs = [_stream_prompt(p, args, 0) for p in prompts]
    _, timings = streamed.run_streamed(args, SourceWeights(sources["fp8"]), inputs, sources["fp8"] / "tokenizer.json")
    plain = [i for i in range(args.n_layers) if i not in args.engram_layer_ids]
    assert plain
    for i in plain:
        t = timings[1 + i]
        assert 0 < t.experts_read < args.n_routed_experts
        assert t.param_bytes == expected_param_bytes(args, i, t.experts_read), t.unit


def test_decode_ids_from_the_prompt_file_and_the_default_rule(sources):
    from dsv41_convert.errors import VerifyInputError
    from dsv41_convert.verify.prompts import Prompt

    given = Prompt((5, 6, 7), "a", decode_ids=(9, 8, 7, 6))
    assert fixed_decode_ids(given, 2).tolist() == [9, 8, 7]
    assert fixed_decode_ids(Prompt((5, 6, 7), "b"), 4).tolist() == [5, 6, 7, 5, 6]
    with pytest.raises(VerifyInputError, match=r"a: 4 decode_ids, 5 decode steps need 6"):
        fixed_decode_ids(given, 5)


def test_cli_stream_layers_writes_the_reference(sources, tmp_path, monkeypatch, capsys):
    from cli_run import run_cli

    from dsv41_convert.verify import reffile

    ids = list(default_prompts(TINY.vocab_size, count=1, length=20)[0].input_ids)
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": ids, "decode_ids": [11, 12, 13]}) + "\n")
    out = tmp_path / "ref.safetensors"
    code, stdout, err = run_cli(monkeypatch, capsys, "reference-logits", str(sources["fp8"]), str(out),
                                "--stream-layers", "--prompts", str(tmp_path / "p.jsonl"), "--decode-steps", "1",
                                "--json")  # fmt: skip
    assert code == 0, stdout
    # the third token fed nothing: said, not dropped without a word (an audit)
    assert "p.jsonl:1: 3 decode_ids, 1 decode steps feed the first 2 (--decode-steps 2 feeds them all)" in err, err
    summary = json.loads(stdout)
    assert summary["units"][0]["unit"] == "embed" and summary["bytes_read"] > 0
    ref = reffile.load(out, 128)
    # every tp-1 weight's sha256, the unread experts' too (verify compares them: test_verify_matrix.py)
    assert (
        summary["weight_digests"]
        == len(ref.provenance["weights"]["ranks"][0])
        == len(SourceWeights(sources["fp8"]).by_name)
    )
    routed = [n for n in SourceWeights(sources["fp8"]).by_name if ".ffn.experts." in n]
    assert summary["weight_digests_experts_as"] == {"fp8": len(routed)} and routed  # each as fp8, weight and scale
    assert sorted(ref.provenance["weights"]["experts_as"]["sha256"]) == sorted(routed)
    assert ref.runs[0].decode_ids.tolist() == [11, 12]
    prompts = load_prompts(tmp_path / "p.jsonl", None, TINY.vocab_size)
    whole = whole_model_runs(sources["fp8"], prompts, 1, [torch.tensor([11, 12])])
    assert torch.equal(ref.runs[0].decode_logits, whole[0].decode_logits)
    assert torch.equal(ref.runs[0].logits, whole[0].logits)
    bare = tmp_path / "bare.safetensors"
    code, stdout, _ = run_cli(monkeypatch, capsys, "reference-logits", str(sources["fp8"]), str(bare),
                              "--stream-layers", "--prompts", str(tmp_path / "p.jsonl"), "--decode-steps", "1",
                              "--no-weight-digests", "--json")  # fmt: skip
    assert code == 0 and json.loads(stdout)["weight_digests"] == 0
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(sources["fp8"]), str(tmp_path / "none.st"),
                           "--stream-layers", "--prompts", str(tmp_path / "p.jsonl"), "--decode-steps", "0",
                           "--no-weight-digests")  # fmt: skip
    assert code == 0 and "p.jsonl:1: 3 decode_ids, but --decode-steps 0 feeds none of them" in err, err
    assert "weights" not in reffile.load(bare, 128).provenance
    fp4_only = tmp_path / "fp4-only.safetensors"
    code, stdout, _ = run_cli(monkeypatch, capsys, "reference-logits", str(sources["fp8"]), str(fp4_only),
                              "--stream-layers", "--prompts", str(tmp_path / "p.jsonl"), "--decode-steps", "1",
                              "--no-fp8-expert-digests", "--json")  # fmt: skip
    assert code == 0 and json.loads(stdout)["weight_digests_experts_as"] == {}
    recorded = reffile.load(fp4_only, 128).provenance["weights"]
    assert "experts_as" not in recorded and recorded["ranks"] == ref.provenance["weights"]["ranks"]


@pytest.mark.parametrize("command", ["reference-logits", "verify"])
def test_decode_ids_without_stream_layers_are_refused(sources, tmp_path, monkeypatch, capsys, command):
    """The whole-model reference decodes greedily: decode_ids were dropped without a word (an audit), and
    `verify --reference SRC` (which never feeds them) still dropped them, PASS (a later audit)."""
    from cli_run import run_cli

    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": [5, 6], "decode_ids": [7, 8]}) + "\n")
    out = tmp_path / "ref.safetensors"
    src = str(sources["fp8"])
    if command == "verify":
        assert run_cli(monkeypatch, capsys, "shard", src, str(tmp_path / "mp1"))[0] == 0
        args = ["verify", str(tmp_path / "mp1"), "--reference", src]
    else:
        args = ["reference-logits", src, str(out)]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--prompts", str(tmp_path / "p.jsonl"), "--decode-steps", "1")
    assert code == 2 and f"{tmp_path / 'p.jsonl'}:1: decode_ids go with `reference-logits --stream-layers`" in err, err
    assert not out.exists()


def _args(src: Path, prompts, n_decode: int = 1):
    from dsv41_convert.config import load_model_args

    args = load_model_args(src / "config.json")
    seq = pick_max_seq_len([len(p.input_ids) for p in prompts], n_decode, None, draft_block(args))
    return args.with_runtime(max_batch_size=1, max_seq_len=seq, temperature=0.0)


def _stream_prompt(prompt, args, n_decode: int = 1):
    from dsv41_convert.model.streamed import StreamPrompt

    return StreamPrompt(model_input(prompt, args).input_ids, fixed_decode_ids(prompt, n_decode))


@pytest.mark.slow
def test_rank_files_replay_equals_the_source(sources, tmp_path):
    """Converted rank files (tp 2) streamed through RankWeights give the source's streamed outputs bit for
    bit (the converter only relabels fp4 experts and dequantizes wo_a, as SourceWeights does)."""
    pytest.importorskip("dsv41_convert.convert.unshard")
    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan

    execute(build_plan(sources["fp8"], 2), tmp_path / "mp2")
    prompts = default_prompts(TINY.vocab_size, count=1, length=20)
    ref, _ = compute_streamed_reference(sources["fp8"], prompts, 1)
    replay, _ = compute_streamed_reference(tmp_path / "mp2", prompts, 1)
    assert_bit_identical(replay.runs, ref.runs)


def test_engram_rows_from_rank_files(sources, tmp_path):
    """RankWeights.rows reads a row from the rank that holds it (rows split ceil(rows / tp) per rank)."""
    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.verify.rank_weights import RankWeights

    execute(build_plan(sources["fp8"], 4), tmp_path / "mp4")
    name = "layers.1.engram.embed.weight"
    whole = SourceWeights(sources["fp8"])([name])[name]
    rows = torch.tensor([0, 1, whole.shape[0] // 2, whole.shape[0] - 1])
    got = RankWeights(tmp_path / "mp4").rows([name, name.replace("weight", "scale")], rows)
    assert torch.equal(got[name].view(torch.uint8), whole[rows].view(torch.uint8))


def test_the_streamed_reference_records_what_its_weights_are(sources):
    """reference-logits records its weights as reffile documents them: an fp8 source's are what every correct
    conversion holds ("converted", so verify expects bit equality), a bf16 source's are the unquantized model
    ("bf16", which no conversion reproduces): swapped, verify expects bit equality where none can hold, or
    gives up the decisive check where it holds."""
    prompt = default_prompts(TINY.vocab_size, count=1, length=8)
    for dtype, weights in (("fp8", "converted"), ("bf16", "bf16")):
        ref, _ = compute_streamed_reference(sources[dtype], prompt, 0, record_weights=False)
        assert (ref.source_format, ref.weights) == (dtype, weights)


def test_a_prompt_shorter_than_a_compress_group_is_refused(sources):
    from dsv41_convert.errors import VerifyInputError
    from dsv41_convert.verify.prompts import Prompt

    with pytest.raises(VerifyInputError, match=r"^short: a 1-token prompt: streaming needs 2"):
        compute_streamed_reference(sources["fp8"], [Prompt((5,), "short")], 1)
    # from a prompt file the line is named (it was not: an audit)
    line = Prompt((5,), "line-3", origin="prompts.jsonl:3")
    with pytest.raises(VerifyInputError, match=r"^prompts.jsonl:3: a 1-token prompt: streaming needs 2 tokens"):
        compute_streamed_reference(sources["fp8"], [Prompt((5, 6, 7), "ok"), line], 1)


def test_verify_stream_layers_names_the_reference_holding_a_prompt_too_short_to_stream(
    sources, tmp_path, monkeypatch, capsys
):
    """A tp-1 reference of a 1-token prompt (verify without --stream-layers runs it): `verify MP --reference-logits
    FILE --stream-layers` refused it with `line-1: a 1-token prompt: streaming needs 2 tokens ...`, naming only the
    prompt's label, not the file that holds it (an input error names the file). Now FILE is named."""
    from cli_run import run_cli

    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan

    mp2, ref = tmp_path / "mp2", tmp_path / "ref.safetensors"
    execute(build_plan(sources["fp8"], 2), mp2)
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": [5]}) + "\n")
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(sources["fp8"]), str(ref), "--prompts",
                           str(tmp_path / "p.jsonl"), "--decode-steps", "0", "--no-weight-digests")  # fmt: skip
    assert code == 0, err
    code, doc, err = run_cli(monkeypatch, capsys, "verify", str(mp2), "--reference-logits", str(ref), "--stream-layers",
                             "--json")  # fmt: skip
    error = json.loads(doc)["error"]
    assert code == 2 and "1-token prompt" in error and error.startswith(f"{ref}: "), err


def test_cli_stream_layers_refuses_tp(sources, tmp_path, monkeypatch, capsys):
    from cli_run import run_cli

    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(sources["fp8"]), str(out), "--stream-layers",
                           "--tp", "2")  # fmt: skip
    assert code == 2 and "--stream-layers computes the tp-1 reference" in err
    assert not out.exists()


class _Event:
    def __init__(self, enable_timing: bool = False):
        pass

    def record(self, stream=None) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 1.0


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event) -> None:
        pass


class _CpuTorch:
    """torch for stream_feed, with the CUDA calls it makes turned into no-ops on the CPU."""

    cuda = SimpleNamespace(
        Stream=_Stream,
        Event=_Event,
        stream=lambda s: contextlib.nullcontext(),
        current_stream=lambda device=None: _Stream(),
        synchronize=lambda device=None: None,
    )

    @staticmethod
    def empty(*args, pin_memory: bool = False, **kwargs):
        return torch.empty(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def test_read_ahead_bookkeeping_on_the_cpu(sources, monkeypatch):
    """CudaFeed's bookkeeping (reader threads, groups of tensors, the next unit read while the current one
    runs, experts read when picked, provider buffers) with its CUDA calls stubbed, so it runs on the CPU:
    the outputs equal the on-demand feed's bit for bit, and every unit after the first was read ahead.
    Planted faults it catches: a unit fed another unit's or pass's tensors, a tensor lost between groups,
    no read-ahead. Pinned memory, streams and events themselves run in tests/gpu/test_streamed_cuda.py."""
    from dsv41_convert.model import stream_feed, streamed

    takes: list[bool] = []

    class Feed(stream_feed.CudaFeed):
        def take(self, key, sizes, timing):
            takes.append(key in self.pending)
            return super().take(key, sizes, timing)

    prompts = default_prompts(TINY.vocab_size, count=2, length=20)
    args = _args(sources["fp8"], prompts, n_decode=2)
    inputs = [_stream_prompt(p, args, 2) for p in prompts]
    tokenizer = sources["fp8"] / "tokenizer.json"
    plain, _ = streamed.run_streamed(args, SourceWeights(sources["fp8"]), inputs, tokenizer)
    monkeypatch.setattr(stream_feed, "torch", _CpuTorch())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    monkeypatch.setattr(streamed, "HostFeed", lambda provider: Feed(provider, "cpu", readers=3))
    ahead, timings = streamed.run_streamed(args, SourceWeights(sources["fp8"]), inputs, tokenizer)
    assert takes[0] is False and len(takes) == 3 * len(timings) and all(takes[1:])
    for a, b in zip(ahead, plain, strict=True):
        for key in ("logits_all", "last", "decode_logits", "draft_logits"):
            assert torch.equal(getattr(a, key).view(torch.int32), getattr(b, key).view(torch.int32)), key
    assert all(t.transfer_s > 0 for t in timings)  # the stub's 1 ms per copy, settled at the end


def test_rank_files_that_disagree_on_a_replicated_tensor_are_refused(sources, tmp_path):
    """A vision weight changed on rank 1 only, streamed with text prompts (the tower never runs): its units
    were never merged, so `reference-logits MP --stream-layers` wrote a reference from rank files that are
    not one conversion (an audit); verify fails the same files on its replicas check."""
    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.errors import VerifyInputError
    from dsv41_convert.store.safetensors_header import read_header
    from dsv41_convert.verify.rank_weights import RankWeights

    mp2 = tmp_path / "mp2"
    execute(build_plan(sources["fp8"], 2), mp2)
    RankWeights(mp2).ranks.close()  # one conversion: accepted
    rank1 = mp2 / "model1-mp2.safetensors"
    name = next(n for n in sorted(read_header(rank1).tensors) if n.startswith("vision.") and n.endswith(".weight"))
    info = read_header(rank1).tensors[name]
    with open(rank1, "r+b") as f:
        f.seek(info.begin)
        byte = f.read(1)[0]
        f.seek(info.begin)
        f.write(bytes([byte ^ 0x01]))
    said = rf"not one conversion \({name}: replicated, but ranks 0 and 1 hold different copies"
    with pytest.raises(VerifyInputError, match=said):
        RankWeights(mp2)


def test_a_checkpoint_holding_rank_files_beside_its_shards_is_refused(sources, tmp_path, monkeypatch, capsys):
    """A Hugging Face checkpoint (its index, its shards) with rank files copied in beside them: `reference-logits
    SRC OUT --stream-layers` replayed the rank files and ignored the checkpoint, exit 0, a reference of whatever
    model the rank files hold (another seed's here) said to be SRC's, while the same command without
    --stream-layers refuses the folder (the rank files' tensors are also in the shards). Now refused, naming
    both, before any compute."""
    from cli_run import run_cli

    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan

    src = tmp_path / "src"
    shutil.copytree(sources["fp8"], src)
    other = write_checkpoint(tmp_path / "other", TINY, seed=1, quantized=True)["out"]
    execute(build_plan(Path(other), 2), tmp_path / "mp2")
    for rank_file in sorted((tmp_path / "mp2").glob("model*-mp2.safetensors")):
        shutil.copy(rank_file, src / rank_file.name)
    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--stream-layers",
                           "--decode-steps", "0")  # fmt: skip
    assert code == 2 and "model.safetensors.index.json" in err and "model0-mp2.safetensors" in err, err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["source", "rank files"])
def test_a_file_truncated_mid_stream_is_named_with_the_tensor(kind, sources, tmp_path):
    """A shard (or rank file) cut short after the run opened it, before a unit read from it: the error named
    the file and a byte offset only ("unexpected end of file at byte N"), not the tensor the unit was
    reading. Now both."""
    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.errors import HeaderError
    from dsv41_convert.store.safetensors_header import read_header
    from dsv41_convert.verify.rank_weights import RankWeights

    if kind == "source":
        folder = tmp_path / "src"
        shutil.copytree(sources["fp8"], folder)
        weights = SourceWeights(folder)
        victim = folder / "model-00004-of-00014.safetensors"
    else:
        folder = tmp_path / "mp2"
        execute(build_plan(sources["fp8"], 2), folder)
        weights = RankWeights(folder)
        victim = folder / "model1-mp2.safetensors"
    tensors = read_header(victim).tensors
    name = next(n for n in sorted(tensors) if re.fullmatch(r"layers\.\d+\.attn\.wq_b\.weight", n))
    os.truncate(victim, tensors[name].begin + 1)  # after the run opened the file, before the unit reads it
    try:
        with pytest.raises(HeaderError, match=rf"{victim.name}: tensor {re.escape(name)}: unexpected end of file"):
            weights([name])
    finally:
        weights.close()


def test_rank_files_changed_since_their_manifest_are_not_replayed(sources, tmp_path, monkeypatch, capsys):
    """`reference-logits MP --stream-layers` records MP's rank files by their manifest's sha256: a byte of a
    rank file changed after the manifest was written (a damaged copy) was replayed and recorded as the
    conversion it is not. Now it is refused before the run, naming the file; without a manifest nothing is
    claimed and the replay runs."""
    from cli_run import run_cli

    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.store.safetensors_header import read_header

    mp2 = tmp_path / "mp2"
    execute(build_plan(sources["fp8"], 2), mp2)
    rank1 = mp2 / "model1-mp2.safetensors"
    info = next(t for n, t in sorted(read_header(rank1).tensors.items()) if n.startswith("layers.1."))
    with open(rank1, "r+b") as f:
        f.seek(info.begin)
        byte = f.read(1)[0]
        f.seek(info.begin)
        f.write(bytes([byte ^ 0x01]))
    out = tmp_path / "ref.safetensors"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(range(1, 21))}) + "\n")
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(mp2), str(out), "--stream-layers",
                           "--prompts", str(prompts), "--decode-steps", "1")  # fmt: skip
    assert code == 2 and "not the conversion its manifest.json records (model1-mp2.safetensors:" in err
    assert not out.exists()
    (mp2 / "manifest.json").unlink()  # nothing recorded to hold the bytes to
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(mp2), str(out), "--stream-layers",
                           "--prompts", str(prompts), "--decode-steps", "1", "--json")  # fmt: skip
    assert code == 0, err
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        made = json.loads(f.metadata()["provenance"])["made_from"]
    assert made["files"]["model1-mp2.safetensors"]["sha256"] == ""


@pytest.mark.slow  # a 120-token prompt, 5 decode steps, both references
def test_a_prompt_near_the_length_limit_leaves_room_for_the_drafts(sources, tmp_path, monkeypatch, capsys):
    """120 tokens + 5 decode steps sized max_seq_len 128, and the drafts after the last step rope positions up
    to 129: both references ended in a traceback (exit 1; an audit). Now sized 192, the two runs agree."""
    from cli_run import run_cli

    from dsv41_convert.verify import reffile

    ids = list(default_prompts(TINY.vocab_size, count=1, length=120)[0].input_ids)
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": ids}) + "\n")
    whole, streamed = tmp_path / "whole.safetensors", tmp_path / "streamed.safetensors"
    code, out, err = run_cli(monkeypatch, capsys, "reference-logits", str(sources["fp8"]), str(whole),
                             "--prompts", str(tmp_path / "p.jsonl"), "--decode-steps", "5", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["max_seq_len"] == 192, err
    greedy = reffile.load(whole, TINY.vocab_size).runs[0].decode_ids.tolist()
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": ids, "decode_ids": greedy}) + "\n")
    code, out, err = run_cli(monkeypatch, capsys, "reference-logits", str(sources["fp8"]), str(streamed),
                             "--prompts", str(tmp_path / "p.jsonl"), "--decode-steps", "5", "--stream-layers",
                             "--json")  # fmt: skip
    assert code == 0, err
    a, b = (reffile.load(p, TINY.vocab_size).runs[0] for p in (whole, streamed))
    assert torch.equal(a.decode_logits, b.decode_logits) and torch.equal(a.draft_logits, b.draft_logits)


@pytest.mark.slow  # 41 passes of the streamed model and 41 steps of the whole one (~7 s)
def test_a_long_decode_from_the_shortest_prompt_is_bit_for_bit(sources):
    """A 2-token prompt (the shortest streamable: one group of the largest compress ratio, 2) decoded for 40
    steps, streamed and whole, bit for bit. At each even position from 18 on, a ratio-2 layer whose group is
    incomplete ranks more than index_topk (8) compressed rows with the index keys layer 3 published at the
    previous step, rows written during the decode (past the prompt): only a step that starts from the runtime
    its previous step left has them. Planted faults it catches: every decode step started from the prefill's
    runtime (which the 3-step tests cannot see: they read prompt rows only), a prompt exactly one group long
    refused."""
    from dsv41_convert.verify.prompts import Prompt

    prompts = [Prompt((7, 300), "two")]
    ref, _ = compute_streamed_reference(sources["bf16"], prompts, 40, record_weights=False)
    assert ref.runs[0].decode_logits.shape == (40, TINY.vocab_size)
    whole = whole_model_runs(sources["bf16"], prompts, 40, [r.decode_ids for r in ref.runs])
    assert_bit_identical(ref.runs, whole)


def test_an_image_prompt_reads_every_unit_ahead_and_the_tower_once(sources, tmp_path, monkeypatch):
    """With an image prompt the vision unit runs at the prefill pass only, so the read-ahead order skips it at
    the decode passes: every unit after the first is taken from a read ahead, and the tower's weights are read
    once. CudaFeed's CUDA calls are stubbed as in test_read_ahead_bookkeeping_on_the_cpu. Planted fault it
    catches: the read-ahead order listing the vision unit at every pass (its weights read again for nothing at
    each decode pass, and the unit after it, the next pass's embed, read on demand)."""
    from PIL import Image

    from dsv41_convert.model import stream_feed, streamed
    from dsv41_convert.verify.prompts import Prompt

    takes: list[str] = []
    vision_reads: list[str] = []

    class Feed(stream_feed.CudaFeed):
        def take(self, key, sizes, timing):
            if key not in self.pending:
                takes.append(key)
            return super().take(key, sizes, timing)

        def ahead(self, key, sizes):
            if key.endswith(":vision"):
                vision_reads.append(key)
            return super().ahead(key, sizes)

    Image.new("RGB", (60, 50), (30, 160, 90)).save(tmp_path / "a.png")
    monkeypatch.setattr(stream_feed, "torch", _CpuTorch())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    monkeypatch.setattr(streamed, "HostFeed", lambda provider: Feed(provider, "cpu", readers=2))
    prompts = [Prompt(tuple(range(5, 15)), "vl", image=str(tmp_path / "a.png"))]
    ref, timings = compute_streamed_reference(sources["fp8"], prompts, 1, record_weights=False)
    assert timings[0].unit == "vision" and ref.runs[0].decode_logits.shape == (1, TINY.vocab_size)
    assert takes == ["0:vision"]  # the first unit only was read on demand
    assert vision_reads == []  # read once, on demand, never again ahead
