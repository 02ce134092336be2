"""verify.verdict: PASS needs a decisive check; statistical bounds alone give INCONCLUSIVE; every blocker of
bit equality is named."""

import torch

from dsv41_convert.verify.arithmetic import arithmetic
from dsv41_convert.verify.verdict import (
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    PASS,
    Check,
    advice,
    decide,
    drafts_uncovered,
    exact_blockers,
)

SAME = dict(ref_tp=2, ref_device="cpu", ref_threads=1, ref_torch=torch.__version__, ref_weights="converted")


def _blockers(**kw):
    args = {**SAME, "tp": 2, "device": "cpu", "threads": 1} | kw
    return exact_blockers(**args)


def test_exact_only_when_everything_that_decides_bits_agrees():
    assert _blockers() == []
    assert _blockers(ref_threads=0, ref_torch="") == []  # not recorded: blocks nothing
    assert "tp 1, this run at tp 2" in _blockers(ref_tp=1)[0]
    assert "on cuda, this run on cpu" in _blockers(ref_device="cuda")[0]
    assert "2 CPU threads per rank, this run 1" in _blockers(ref_threads=2)[0]
    assert _blockers(ref_threads=2, device="cuda", ref_device="cuda") == []  # threads only matter on the CPU
    assert "torch 1.0" in _blockers(ref_torch="1.0")[0]
    assert "--as-converted" in _blockers(ref_weights="bf16")[0]
    assert "does not record which weights" in _blockers(ref_weights="")[0]
    assert _blockers(ref_arithmetic=arithmetic("cpu")) == []
    avx2 = "x86_64 AVX2; avx avx2 fma"
    assert f"kernels were picked by {avx2!r}" in _blockers(ref_arithmetic=avx2)[0]
    assert _blockers(ref_arithmetic="x86_64 AVX2", ref_device="cuda") == ["the reference ran on cuda, this run on cpu"]


def test_decide():
    exact = Check("replay", True, True)
    inexact = Check("reference", False, False)
    failed = Check("reference", False, True, ["last: max_abs 0.1 > 0"])
    assert decide([exact, inexact], [], False) == PASS
    assert decide([inexact], [], False) == INCONCLUSIVE
    assert decide([inexact], [], True) == PASS  # --statistical
    assert decide([exact, failed], ["last: max_abs 0.1 > 0"], False) == FAIL
    assert decide([exact], ["all: kl_mean 2 > 1"], True) == FAIL  # a broken statistical bound always fails
    assert not failed.decisive and exact.decisive
    assert EXIT_CODES == {PASS: 0, FAIL: 1, INCONCLUSIVE: 3}


def test_advice_names_the_ways_to_a_decisive_run():
    text = advice(4, from_source=False)
    assert "--tp 4" in text and "tp-1 reference" in text and "--reference SRC" in text
    assert "--statistical" in text and "--as-converted" not in text
    assert "`reference-logits SRC OUT --tp 4 --as-converted`" in advice(4, False, bf16_source=True)


def test_threads_differing_either_way_block_bit_equality():
    assert "1 CPU threads per rank, this run 2" in _blockers(ref_threads=1, threads=2)[0]
    assert "2 CPU threads per rank, this run 1" in _blockers(ref_threads=2, threads=1)[0]


def test_one_failed_check_fails_the_run_beside_a_decisive_one():
    """A check's failure decides whatever else held, without any statistical failure beside it (the replicas,
    the weights record, the teacher's bound)."""
    exact = Check("replay", True, True)
    weights = Check("weights", False, True, ["weights: embed.weight on rank 1: sha256 ..."])
    assert decide([exact, weights], [], False) == FAIL
    assert decide([weights, exact], [], True, drafts=True) == FAIL


def test_a_model_with_dspark_stages_needs_a_decisive_check_of_the_drafts():
    """The teacher, or a reference without decode steps, never ran the DSpark stages: bit for bit equal, it
    decides the backbone only, so the run is INCONCLUSIVE unless another decisive check covered the drafts."""
    backbone = Check("teacher", True, False, covers_drafts=False)
    no_decode = Check("reference", True, True, covers_drafts=False)
    drafts = Check("weights", True, True)
    assert decide([backbone], [], False, drafts=True) == INCONCLUSIVE
    assert decide([backbone, no_decode], [], False, drafts=True) == INCONCLUSIVE
    assert drafts_uncovered([backbone, no_decode])
    assert decide([backbone], [], False, drafts=False) == PASS  # no stages to cover
    # one decisive check of the drafts is enough, beside checks that do not cover them
    assert decide([backbone, drafts], [], False, drafts=True) == PASS
    assert decide([drafts, backbone], [], False, drafts=True) == PASS
    assert not drafts_uncovered([backbone, drafts]) and not drafts_uncovered([drafts, no_decode])
    # a check that covers the drafts but differs, not expected bit for bit, decides nothing
    assert decide([backbone, Check("reference", False, False)], [], False, drafts=True) == INCONCLUSIVE
    assert not drafts_uncovered([Check("reference", False, False)])  # nothing decisive held at all
