"""Decisive verify on CUDA (issue 16): references computed on the GPU at tp 1 and 2, a correct conversion
PASSes bit for bit, a planted fault FAILs. Run on the H200 by the lead (not in CI: the gpu marker)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify import reffile
from dsv41_convert.verify.prompts import default_prompts, load_prompts
from dsv41_convert.verify.reference import compute_reference_ranks
from dsv41_convert.verify.run import VerifyOptions, verify

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.dist]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = tmp_path_factory.mktemp("gpu-verify")
    ids = default_prompts(TINY.vocab_size, count=1, length=24)[0].input_ids
    (root / "prompts.jsonl").write_text(json.dumps({"input_ids": list(ids)}) + "\n")
    write_checkpoint(root / "src", TINY, seed=0, quantized=True, vision=False)
    for tp in (1, 2):
        execute(build_plan(root / "src", tp), root / f"mp{tp}")
    return root


def _reference(work: Path, tp: int) -> Path:
    path = work / f"ref-cuda-tp{tp}.safetensors"
    if not path.exists():
        prompts = load_prompts(work / "prompts.jsonl", None, TINY.vocab_size)
        reffile.save(compute_reference_ranks(work / "src", prompts, tp, 1, None, "cuda"), path)
    return path


def _needs(tp: int) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")


@pytest.mark.parametrize(("tp", "ref_tp", "decisive"), [(1, 1, "reference"), (2, 2, "reference"), (2, 1, "replay")])
def test_correct_conversion_passes_bit_for_bit(work, tp, ref_tp, decisive):
    _needs(tp)
    result = verify(VerifyOptions(work / f"mp{tp}", reference_logits=_reference(work, ref_tp), device="cuda"))
    want = [decisive, "weights"] if decisive == "reference" else ["weights", decisive]  # digests recorded
    assert result.verdict == "PASS" and result.decisive == want, (result.failures, result.checks)


@pytest.mark.parametrize(("tp", "ref_tp"), [(1, 1), (2, 2), (2, 1)])
def test_scale_block_doubled_fails(work, tmp_path, tp, ref_tp):
    _needs(tp)
    bad = tmp_path / "bad"
    shutil.copytree(work / f"mp{tp}", bad)
    path = bad / f"model{tp - 1}-mp{tp}.safetensors"
    t = load_file(str(path))
    raw = t["layers.1.attn.wq_b.scale"].view(torch.uint8).clone()
    raw[0, 0] += 1
    t["layers.1.attn.wq_b.scale"] = raw.view(torch.float8_e8m0fnu)
    save_file(t, str(path))
    result = verify(VerifyOptions(bad, reference_logits=_reference(work, ref_tp), device="cuda"))
    assert result.verdict == "FAIL", result.checks
