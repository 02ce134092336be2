"""How verify assembles its comparison: every decode step is compared and each section is judged against its own
bounds; and what the reference records of its run (the thread count decides CPU kernels only, the weights it ran),
with the prompts and the runtime length it runs them with."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import tiny_config

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.verify import reference
from dsv41_convert.verify.prompts import Prompt
from dsv41_convert.verify.ranks import RankResult
from dsv41_convert.verify.run import VerifyResult, _compare_all
from dsv41_convert.verify.runner import ModelInput, PromptRun
from dsv41_convert.verify.thresholds import EXACT, Thresholds, default_thresholds

V = 8


def _run(decode: torch.Tensor) -> PromptRun:
    logits = torch.arange(3 * V, dtype=torch.float32).reshape(3, V) / 10
    return PromptRun(logits, torch.tensor([1, 2]), decode, None)


def test_one_decode_step_is_compared_and_judged_by_the_decode_bounds():
    """A converted run whose only decode step is a little off: the loose bounds of the other sections would let
    it pass, the decode section's exact bound must not (neither per prompt nor overall)."""
    ref_decode = torch.linspace(-1, 1, V)[None]
    got_decode = ref_decode.clone()
    got_decode[0, 0] += 1e-3
    ref = SimpleNamespace(
        labels=["p"], inputs=[ModelInput(torch.tensor([5, 6, 7]))], runs=[_run(ref_decode)], has_logits_all=True
    )
    loose = default_thresholds("reduction")
    th = Thresholds("test", {**loose.bounds, "decode": EXACT}, 0.0)
    result = VerifyResult("c", "r", 1, "cpu", th, [], {}, [])
    _compare_all(result, ref, RankResult([_run(got_decode)], None), th)
    assert result.overall["decode"].max_abs > 0
    assert result.overall["last"].max_abs == 0
    assert any(f.startswith("decode: ") for f in result.prompts[0].failures)
    assert any(f.startswith("decode: ") for f in result.failures)
    assert not any(f.startswith(("last", "all")) for f in result.failures)


def test_threads_are_recorded_for_a_cpu_reference_only(monkeypatch):
    monkeypatch.setattr(reference, "arithmetic", lambda device: f"kernels of {device}")
    cpu, gpu = reference._recorded("cpu"), reference._recorded("cuda:0")
    assert cpu["threads"] == torch.get_num_threads() and cpu["arithmetic"] == "kernels of cpu"
    assert gpu["threads"] == 0 and gpu["arithmetic"] == "kernels of cuda:0"
    assert cpu["torch_version"] == gpu["torch_version"] == torch.__version__


def test_short_prompts_run_with_at_least_128_positions():
    """Reference and converted runs are built with one max_seq_len (it sizes caches and decides YaRN): short prompts
    get 128, the floor every reference file of them was computed with, and longer ones the need rounded up to 64."""
    assert reference.pick_max_seq_len([10], 3, None) == 128
    assert reference.pick_max_seq_len([100], 3, None) == 128
    assert reference.pick_max_seq_len([130], 3, None) == 192  # 133 positions, rounded up to 3 * 64


def test_decode_ids_go_only_with_a_run_that_feeds_them(tmp_path):
    """A prompt's decode_ids are the tokens a streamed reference feeds its decode steps: read where the run feeds
    them, refused elsewhere (the decode steps would feed the model's own choices and ignore them)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7], "decode_ids": [8, 9]}\n')
    args = SimpleNamespace(vocab_size=64, engram_layer_ids=(), image_token_id=62)
    (fed,) = reference.read_prompts(prompts, None, args, feeds_decode_ids=True)
    assert fed.input_ids == (5, 6, 7) and fed.decode_ids == (8, 9)
    with pytest.raises(VerifyInputError, match=r"decode_ids go with `reference-logits --stream-layers`"):
        reference.read_prompts(prompts, None, args)


def test_a_prompt_holding_the_image_placeholder_is_refused_naming_its_line(tmp_path):
    """config.json's image_token_id in a prompt's text (the placeholder upstream puts in a chat prompt) or ids: without
    "image" it ran as a text token, which no inference runs (upstream refuses a placeholder without its image), and
    beside "image" it was "prompt has 2 image placeholders (id 510), got 1 images" for one placeholder and one image
    (the image goes after the text)."""
    from dsv41_convert.synth.tokenizer import build_tokenizer

    build_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    args = SimpleNamespace(vocab_size=512, engram_layer_ids=(), image_token_id=510)
    lines = ['{"input_ids": [5, 6, 7]}', '{"text": "see <\uff5cdeepseek_image\uff5c> here"}', '{"input_ids": [5, 510]}']
    for line in lines[1:]:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text(f"{lines[0]}\n{line}\n")
        with pytest.raises(VerifyInputError, match=r"prompts.jsonl:2: .*token id 510, config.json's image_token_id"):
            reference.read_prompts(prompts, tmp_path / "tokenizer.json", args)
    prompts.write_text(lines[0] + "\n")
    assert reference.read_prompts(prompts, tmp_path / "tokenizer.json", args)[0].input_ids == (5, 6, 7)


def test_a_reference_of_a_bf16_sources_converted_weights_records_them_as_converted(tmp_path, monkeypatch):
    """`reference-logits SRC OUT --as-converted` of a bf16 source runs the converter's quantized weights: the file says
    "converted" (so verify can expect bit equality), and "bf16" only for the unquantized model."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny_config(quantized=False, vision=False)))
    ran = PromptRun(torch.zeros(3, V), torch.tensor([1]), torch.zeros(1, V), None)
    monkeypatch.setattr(reference, "launch", lambda *a, **k: ([ran], "bf16", {"threads": 2}, None))
    # a source of config.json only: no plan of its weights, no check of their size
    monkeypatch.setattr(reference, "build_plan", lambda *a, **k: None)
    monkeypatch.setattr(reference, "require_source_weights_fit", lambda *a, **k: None)
    prompts = [Prompt((5, 6, 7), "p")]
    for as_converted, weights in ((True, "converted"), (False, "bf16")):
        ref = reference.compute_reference_ranks(src, prompts, n_decode=1, as_converted=as_converted)
        assert (ref.weights, ref.source_format, ref.threads) == (weights, "bf16", 2)
