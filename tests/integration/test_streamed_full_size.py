"""The layer-streamed reference on the full-size hollow layout (`make-tiny --preset full --sparse`: the
published 96,085 tensors, 510 GB apparent, zeros on disk): the bounded-memory promise at real shapes.

About 8 minutes on the 2-core CI machine (docs/BENCHMARKS.md, reference-logits --stream-layers), so slow.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

pytestmark = pytest.mark.slow

TOKENS, VOCAB, DRAFT = 8, 129280, 5
ENGRAM_TABLE_BYTES = 384006168 * 256 + 384016682 * 256  # the two fp8 tables, never to be read whole


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from dsv41_convert.cli import main; main()", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def test_streamed_reference_of_the_full_size_layout_stays_small(tmp_path):
    src = tmp_path / "hollow"
    made = _cli("make-tiny", str(src), "--preset", "full", "--sparse", "--json")
    assert made.returncode == 0, made.stderr[-2000:]
    prompts = tmp_path / "prompts.jsonl"
    input_ids = [1000 + 7919 * i for i in range(TOKENS)]
    prompts.write_text(json.dumps({"input_ids": input_ids}) + "\n")
    out = tmp_path / "ref.safetensors"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # without the weight digests: they hash all 510 GB (bench/bench_weight_digests.py measures that)
    run = _cli("reference-logits", str(src), str(out), "--stream-layers", "--prompts", str(prompts),
               "--decode-steps", "1", "--no-weight-digests", "--json")  # fmt: skip
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert run.returncode == 0, run.stderr[-3000:]
    assert peak_kib > before and peak_kib * 1024 < 12 * 2**30, f"peak RSS {peak_kib / 2**20:.2f} GiB"  # the goal

    summary = json.loads(run.stdout)
    # two passes (prefill, one decode step) over dense weights, reached experts and touched Engram rows:
    # tens of GiB, where reading either Engram table whole would be 92 GiB
    assert 0 < summary["bytes_read"] < ENGRAM_TABLE_BYTES // 4
    with safe_open(str(out), "pt") as f:
        logits, decode = f.get_tensor("logits"), f.get_tensor("decode_logits")
        ids = f.get_tensor("decode_ids")
        drafts = f.get_tensor("draft_logits") if "draft_logits" in f.keys() else None
    assert logits.shape == (1, VOCAB) and decode.shape == (1, 1, VOCAB)
    assert ids.tolist() == [input_ids[:2]]  # no decode_ids given: the prompt's own tokens (verify/streamed.py)
    assert torch.isfinite(logits).all() and torch.isfinite(decode).all()
    if drafts is not None:
        assert drafts.shape[-1] == VOCAB and torch.isfinite(drafts).all()
