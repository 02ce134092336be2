"""The positions the model supports bound a run's length: its YaRN context, rope_scaling factor x
original_max_position_embeddings (the published config's max_position_embeddings).

On make-tiny (4 x 64 = 256 positions) `reference-logits --decode-steps 100000` and `--max-seq-len 100000` were
accepted: the caches of 100,000 positions fit, so the run went on until it was killed (a helper's bug hunt,
2026-12-07). Now refused before the model is built, naming the option and the limit (exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import run_cli
from tiny_ckpt import REAL_CONFIG, make_tiny

import dsv41_convert.verify.reference as reference
import dsv41_convert.verify.streamed as streamed
from dsv41_convert.config import load_model_args
from dsv41_convert.errors import VerifyInputError
from dsv41_convert.verify.reference import pick_max_seq_len


def _fails(*_args, **_kwargs):
    raise AssertionError("the model ran: the positions were not bounded first")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """tests' tiny checkpoint with a context of 256 positions (make-tiny's: factor 4 x 64)."""
    folder = make_tiny(tmp_path_factory.mktemp("positions") / "src")
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["rope_scaling"].update(factor=4, original_max_position_embeddings=64)
    config["text_config"]["max_position_embeddings"] = 256
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_the_published_context_is_its_max_position_embeddings():
    config = json.loads(REAL_CONFIG.read_text())
    assert load_model_args(REAL_CONFIG).max_positions == config["text_config"]["max_position_embeddings"] == 1 << 20


def test_pick_max_seq_len_stays_within_the_context():
    """The automatic length rounds up to 64 and at least 128, but never past the context; a need past it, or a
    request, is refused naming the option."""
    assert pick_max_seq_len([40], 3, None, 5, limit=100) == 100
    assert pick_max_seq_len([40], 3, None, 5, limit=None) == 128
    assert pick_max_seq_len([40], 3, 256, 5, limit=256) == 256
    with pytest.raises(VerifyInputError, match=r"^--max-seq-len 257: more than the 256 positions the model"):
        pick_max_seq_len([40], 3, 257, 5, limit=256)
    with pytest.raises(VerifyInputError, match=r"--decode-steps 300 .* needs 345 positions, more than the 256"):
        pick_max_seq_len([40], 300, None, 5, limit=256)


@pytest.mark.parametrize(
    "how",
    [
        ["--decode-steps", "100000"],
        ["--max-seq-len", "100000"],
        ["--decode-steps", "100000", "--stream-layers"],
        ["--max-seq-len", "100000", "--tp", "2"],
    ],
    ids=["decode", "max-seq-len", "decode-streamed", "max-seq-len-tp2"],
)
def test_reference_logits_refuses_more_positions_than_the_model_supports(src, tmp_path, monkeypatch, capsys, how):
    monkeypatch.setattr(reference, "build_model", _fails)
    monkeypatch.setattr(reference, "launch", _fails)
    monkeypatch.setattr(streamed, "run_streamed", _fails)
    out = tmp_path / "ref.safetensors"
    code, doc, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--json", *how)
    assert code == 2 and f"{how[0]} 100,000" in err and "more than the 256" in err, err
    assert "max_position_embeddings" in err and json.loads(doc)["exit_code"] == 2
    assert not out.exists()


def test_verify_refuses_more_positions_than_the_model_supports(src, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "mp1"), "--tp", "1")
    assert code == 0, err
    monkeypatch.setattr(reference, "build_model", _fails)
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(tmp_path / "mp1"), "--reference", str(src),
                           "--max-seq-len", "300")  # fmt: skip
    assert code == 2 and "--max-seq-len 300: more than the 256 positions the model supports" in err, err


def test_a_draft_block_past_the_context_is_blamed_on_the_config():
    """A config.json whose dspark_block_size alone leaves no room for a 1-token prompt and one decode step: the
    refusal said "shorter prompts or fewer decode steps", which no prompt fixes (a carried item, 2026-12-07).
    Now it names the key and the run that still works (--decode-steps 0)."""
    for requested in (None, 200):
        blamed = r"^config.json's dspark_block_size 100,000: .*--decode-steps 0"
        with pytest.raises(VerifyInputError, match=blamed) as e:
            pick_max_seq_len([40], 3, requested, 100_000, limit=256)
        assert "shorter prompts" not in str(e.value) and "--max-seq-len" not in str(e.value)
    # one that fits beside a short prompt is the prompt's or the decode steps' to fix, as before
    with pytest.raises(VerifyInputError, match=r"shorter prompts or fewer decode steps"):
        pick_max_seq_len([40], 3, None, 250, limit=256)
    assert pick_max_seq_len([40], 0, None, 100_000, limit=256) == 128  # no decode step, no drafts


def test_reference_logits_names_a_draft_block_past_the_context(src, tmp_path, monkeypatch, capsys):
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["dspark_block_size"] = 100_000
    big = tmp_path / "src"
    big.mkdir()
    for f in src.iterdir():
        (big / f.name).symlink_to(f)
    (big / "config.json").unlink()
    (big / "config.json").write_text(json.dumps(config, indent=2))
    monkeypatch.setattr(reference, "build_model", _fails)
    monkeypatch.setattr(reference, "launch", _fails)
    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(big), str(out))
    assert code == 2 and "dspark_block_size 100,000" in err and "shorter prompts" not in err, err
    assert not out.exists()
