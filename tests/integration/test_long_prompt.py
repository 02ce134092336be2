"""A prompt too long for the machine: its prefill, not the caches, is what cannot fit.

The indexer scores every query of a prompt against every compressed position it can see, [1, S, heads, S/ratio]
in bf16 (as upstream model.py): quadratic in the prompt's length. `require_caches_fit` sizes only the caches
(linear in max_seq_len), so a prompt of 100,000 tokens on make-tiny passed it and ran 1 min 50 s on a 2-core
box before the allocator's traceback (`DefaultCPUAllocator: can't allocate memory: you tried to allocate
80000000000 bytes`, exit 1, no --json document; found by a helper's bug hunt, 2026-12-06). Now refused before
the model is built (fits.require_prompts_fit), by every command that runs prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import run_cli
from tiny_ckpt import make_tiny

import dsv41_convert.verify.fits as fits
import dsv41_convert.verify.reference as reference
import dsv41_convert.verify.run as verify_run
import dsv41_convert.verify.streamed as streamed


def _fails(*_args, **_kwargs):
    raise AssertionError("the model ran: the prompt's prefill was not sized first")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("long") / "src")


def _scores_bytes(src: Path, seq: int, tp: int = 1) -> int:
    """The least-ratio index layer's scores of a `seq`-token prefill on one of `tp` ranks, from config.json."""
    config = json.loads((src / "config.json").read_text())["text_config"]
    ratio = min(max(1, config["compress_ratios"][i]) for i in config["index_source_layer_ids"])
    return seq * (config["index_n_heads"] // tp) * (seq // ratio) * 2


@pytest.mark.parametrize("how", [[], ["--stream-layers"], ["--tp", "2"]], ids=["whole", "streamed", "tp2"])
def test_a_prompt_whose_prefill_cannot_fit_is_refused_before_the_model_is_built(src, tmp_path, monkeypatch, capsys,
                                                                               how):  # fmt: skip
    """A host of 8 MiB (fits.machine_bytes): the caches of a 2,000-token prompt fit (under 0.5 MiB at its
    2,112 positions), one index source layer's scores alone do not: 2,000 x 2,000 x 8 heads x 2 bytes (ratio 1)
    = 64,000,000 bytes (at tp 2 half on each rank, both in this host's memory). Exit 2 naming the prompt's line
    and its length, no model run (each way of running it is stubbed to fail at once), nothing written."""
    seq = 2000
    assert _scores_bytes(src, seq) > 8 << 20 and _scores_bytes(src, seq, 2) * 2 == _scores_bytes(src, seq)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [i % 200 for i in range(seq)]}) + "\n")
    monkeypatch.setattr(fits, "machine_bytes", lambda device: 8 << 20)
    monkeypatch.setattr(reference, "build_model", _fails)
    monkeypatch.setattr(reference, "launch", _fails)
    monkeypatch.setattr(streamed, "run_streamed", _fails)
    out = tmp_path / "ref.safetensors"
    code, doc, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--prompts", str(prompts),
                             "--json", *how)  # fmt: skip
    assert code == 2 and f"error: {prompts}:1: a prompt of 2,000 positions" in err, err
    assert f"need {_scores_bytes(src, seq) / (1 << 30):,.1f} GiB" in err and ("on each of 2 ranks" in err) == (
        "--tp" in how
    )
    assert json.loads(doc)["exit_code"] == 2
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_verify_refuses_a_reference_files_prompt_its_machine_cannot_prefill(src, tmp_path, monkeypatch, capsys,
                                                                           stream):  # fmt: skip
    """A reference file made on a larger machine: verify on this one (stubbed: 1 MiB, where the caches of the
    file's 300-token prompt fit and its indexer scores, 1.44 MB, do not) is refused before any rank starts,
    naming the file and the prompt, where it ran into the allocator."""
    seq = 300
    assert _scores_bytes(src, seq) > 1 << 20
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [i % 200 for i in range(seq)]}) + "\n")
    ref = tmp_path / "ref.safetensors"
    assert run_cli(monkeypatch, capsys, "reference-logits", str(src), str(ref), "--prompts", str(prompts))[0] == 0
    conv = tmp_path / "conv"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "1")[0] == 0
    monkeypatch.setattr(fits, "machine_bytes", lambda device: 1 << 20)
    monkeypatch.setattr(verify_run.launcher, "launch", _fails)
    monkeypatch.setattr(streamed, "run_streamed", _fails)
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref),
                           *(["--stream-layers"] if stream else []))  # fmt: skip
    assert code == 2 and f"error: {ref}: prompt " in err and "a prompt of 300 positions" in err, err
