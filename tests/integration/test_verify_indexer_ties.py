"""A correct conversion FAILs the teacher check's indexer bound on a 28-token prompt (a helper's third hunt,
2026-12-07; not fixed yet, hence xfail): make-tiny seed 11, tp 8, verify --no-replay against the tp-1
reference (2 threads). The weights check holds; the teacher says `layers.5.attn.indexer: top-k differs at 4
of 28 positions` (allowed: 10 % of 28, at least 2).

Cause, measured by dumping the indexer scores of the teacher run at tp 1 (= the reference) and tp 8: the scores
are bf16 (einsum of bf16 q and k, the head sum and the all-reduce in bf16), so exact ties are common, and one
bf16 ulp of reduction noise at tp 8 breaks them the other way:
- layers.3 (the candidate source), position 24: blocks 1 and 3 tie at 0.0231934 at tp 1; at tp 8 block 1 is
  one ulp up (0.0233154), so another candidate block is kept. Layer 3's own top-k is unchanged (no flip
  counted there); the candidate blocks are not forced to the reference's, so layer 5 at position 24 picks from
  other positions (a flip charged to layers.5);
- layers.5, positions 16 and 25: the 8th and 9th scores tie exactly at tp 1 (-0.0011138916 / -0.0083007812),
  one ulp apart at tp 8; position 20: one ulp apart at tp 1, tied at tp 8.
On 14-29-token prompts, seed 11, tp 8: 1 of 60 prompts so; seeds 10-12 at 20-60 tokens had 2-3 flips in one
layer on several prompts (within the bound at their lengths)."""

from __future__ import annotations

import json

import pytest
from cli_run import run_cli

pytestmark = pytest.mark.slow

PROMPT = [111, 143, 434, 285, 82, 35, 116, 503, 484, 259, 410, 365, 297, 48, 21, 83, 241, 336, 392, 478, 4, 224, 357,
          104, 281, 397, 178, 399]  # fmt: skip


@pytest.mark.xfail(strict=True, reason="indexer ties broken by tp-8 reduction noise exceed the teacher's flip bound")
def test_a_correct_tp8_conversion_passes_the_teacher_on_a_prompt_with_indexer_ties(tmp_path, monkeypatch, capsys):
    src, conv, ref, prompts = tmp_path / "src", tmp_path / "mp8", tmp_path / "ref.safetensors", tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": PROMPT}) + "\n")
    for args in (
        ("make-tiny", str(src), "--seed", "11"),
        ("shard", str(src), str(conv), "--tp", "8"),
        ("reference-logits", str(src), str(ref), "--prompts", str(prompts), "--decode-steps", "1", "--threads", "2"),
    ):
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, err
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref), "--no-replay",
                             "--json")  # fmt: skip
    result = json.loads(out)
    assert result["weights"] == "held", result
    assert code == 0 and result["verdict"] == "PASS", (result["failures"], err)
