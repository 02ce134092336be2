"""The teacher check runs its ranks at the reference's CPU threads: at another count the hyper-connection
projection (an fp32 matmul of K = hc x dim, which the BLAS splits over threads) sums in another order, and on
these prompts a correct conversion's layers.3.ffn came 3.12 bf16 ulps from the reference (bound 2): verify
--no-replay said FAIL (a helper's hunt, 2026-12-07; make-tiny seed 8, the reference at 2 threads, each of 2
ranks at 1). With --threads 1 given it ran its ranks at 1 thread all the same, and FAILed the same way (a
helper's second hunt, 2026-12-07): the teacher's bound holds only at the reference's threads, which it now always
takes where the file records them."""

from __future__ import annotations

import json

import pytest
from cli_run import convert_and_reference, run_cli

pytestmark = pytest.mark.slow

PROMPTS = [
    {"text": "The quick brown fox jumps over the lazy dog. Then it ran far away into the forest of"},
    {"input_ids": [168, 488, 80, 205, 336, 27, 40, 423, 277, 51, 190, 301, 32, 468, 262, 112, 22, 47, 225, 217, 38,
                   126, 49, 285]},
    {"input_ids": [220, 33, 426, 292, 66, 488, 117, 325, 324, 301, 488, 34, 298, 302, 206, 28, 116, 26, 288, 442,
                   71, 151, 217, 76, 279, 63, 295, 160, 289, 420, 352, 95, 55, 300, 295, 330, 99, 193, 52, 283, 367,
                   35, 291, 33, 319, 108, 257, 351, 275, 221, 400, 163, 241, 302, 475, 235, 188]},
]  # fmt: skip


def test_a_correct_conversion_passes_the_teacher_against_a_reference_at_other_threads(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    options = ("--prompts", str(prompts), "--decode-steps", "0", "--threads", "2")
    conv, ref = convert_and_reference(monkeypatch, capsys, tmp_path, 8, 2, *options)
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref), "--no-replay",
                             "--json")  # fmt: skip
    result = json.loads(out)
    teacher = next(c for c in result["checks"] if c["name"] == "teacher")
    assert code == 0 and result["verdict"] == "PASS", (result["failures"], err)
    assert "worst: layers.0.attn 1 ulps" in teacher["note"], teacher
    # --threads (here what the ranks would take anyway, 1 each) orders the converted run, not the teacher's
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref), "--no-replay",
                             "--threads", "1", "--json")  # fmt: skip
    result = json.loads(out)
    teacher = next(c for c in result["checks"] if c["name"] == "teacher")
    assert code == 0 and result["verdict"] == "PASS", (result["failures"], err)
    assert "worst: layers.0.attn 1 ulps" in teacher["note"], teacher
