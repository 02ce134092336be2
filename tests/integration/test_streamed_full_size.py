"""The layer-streamed reference and verify on the full-size hollow layout (`make-tiny --preset full --sparse`:
the published 96,085 tensors, 510 GB apparent, zeros on disk): the bounded-memory promise at real shapes.

The reference takes about 8 minutes on the 2-core CI machine, verify --stream-layers of its tp-8 conversion
(537 GB of rank files, written hollow by tests/hollow_ranks.py) about as long (docs/BENCHMARKS.md), so slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hollow_ranks import write_hollow_ranks
from safetensors import safe_open

pytestmark = pytest.mark.slow

TOKENS, VOCAB, DRAFT = 8, 129280, 5
ENGRAM_TABLE_BYTES = 384006168 * 256 + 384016682 * 256  # the two fp8 tables, never to be read whole
MEMORY_GOAL = 12 * 2**30  # peak RSS of a streamed run on the real model
# the CLI, then its own peak RSS (KiB) on stderr: the streamed runs compute in this one process
_MEASURED = (
    "import atexit, resource, sys\n"
    "atexit.register(lambda: print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr))\n"
    "from dsv41_convert.cli import main\n"
    "main()\n"
)


@dataclass
class Run:
    proc: subprocess.CompletedProcess
    peak: int  # bytes

    @property
    def doc(self) -> dict:
        return json.loads(self.proc.stdout)


def _cli(*args: str) -> Run:
    proc = subprocess.run([sys.executable, "-c", _MEASURED, *args], capture_output=True, text=True, check=False)
    peaks = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("PEAK_KIB ")]
    return Run(proc, peaks[-1] * 1024 if peaks else 0)


@dataclass
class Full:
    src: Path
    input_ids: list[int]
    ref: Path
    run: Run


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Full:
    """The hollow layout and its streamed tp-1 reference (one prompt of TOKENS ids, one decode step)."""
    root = tmp_path_factory.mktemp("full")
    src = root / "hollow"
    made = _cli("make-tiny", str(src), "--preset", "full", "--sparse", "--json")
    assert made.proc.returncode == 0, made.proc.stderr[-2000:]
    prompts = root / "prompts.jsonl"
    input_ids = [1000 + 7919 * i for i in range(TOKENS)]
    prompts.write_text(json.dumps({"input_ids": input_ids}) + "\n")
    out = root / "ref.safetensors"
    # without the weight digests: they hash all 510 GB (bench/bench_weight_digests.py measures that)
    run = _cli("reference-logits", str(src), str(out), "--stream-layers", "--prompts", str(prompts),
               "--decode-steps", "1", "--no-weight-digests", "--json")  # fmt: skip
    return Full(src, input_ids, out, run)


def test_streamed_reference_of_the_full_size_layout_stays_small(full):
    run = full.run
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    assert 0 < run.peak < MEMORY_GOAL, f"peak RSS {run.peak / 2**30:.2f} GiB"
    # two passes (prefill, one decode step) over dense weights, reached experts and touched Engram rows:
    # tens of GiB, where reading either Engram table whole would be 92 GiB
    assert 0 < run.doc["bytes_read"] < ENGRAM_TABLE_BYTES // 4
    with safe_open(str(full.ref), "pt") as f:
        logits, decode = f.get_tensor("logits"), f.get_tensor("decode_logits")
        ids = f.get_tensor("decode_ids")
        drafts = f.get_tensor("draft_logits") if "draft_logits" in f.keys() else None
    assert logits.shape == (1, VOCAB) and decode.shape == (1, 1, VOCAB)
    assert ids.tolist() == [full.input_ids[:2]]  # no decode_ids given: the prompt's own tokens (verify/streamed.py)
    assert torch.isfinite(logits).all() and torch.isfinite(decode).all()
    if drafts is not None:
        assert drafts.shape[-1] == VOCAB and torch.isfinite(drafts).all()


def test_verify_stream_layers_of_the_full_size_tp8_conversion_stays_small(full, tmp_path):
    """verify --stream-layers of the real layout's tp-8 rank files (537 GB) against the streamed tp-1 file:
    PASS by the replay, bit for bit, in one process under the memory goal; the same files with rank 0's and
    rank 1's exchanged (each holds other experts) FAIL, naming the expert found on the wrong rank."""
    assert full.run.proc.returncode == 0, full.run.proc.stderr[-3000:]
    conv = tmp_path / "mp8"
    plan = write_hollow_ranks(full.src, conv, 8)
    assert plan.total_bytes > 500e9
    run = _cli("verify", str(conv), "--reference-logits", str(full.ref), "--stream-layers", "--json")
    assert run.proc.returncode == 0, run.proc.stderr[-3000:]
    doc = run.doc
    assert doc["verdict"] == "PASS" and doc["decisive"] == ["replay"], doc["failures"]
    assert 0 < run.peak < MEMORY_GOAL, f"peak RSS {run.peak / 2**30:.2f} GiB"

    swapped = tmp_path / "swapped"
    swapped.mkdir()
    for path in conv.iterdir():  # links: the same sparse files, two of them under each other's name
        other = {"model0-mp8.safetensors": "model1-mp8.safetensors", "model1-mp8.safetensors": "model0-mp8.safetensors"}
        os.link(path, swapped / other.get(path.name, path.name))
    run = _cli("verify", str(swapped), "--reference-logits", str(full.ref), "--stream-layers", "--json")
    assert run.proc.returncode == 1 and run.doc["verdict"] == "FAIL", run.proc.stderr[-3000:]
    assert any("held by ranks [1], expected rank 0 alone" in f for f in run.doc["failures"]), run.doc["failures"]
