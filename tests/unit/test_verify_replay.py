"""verify.replay.replay_check's judgement of the replayed runs: every prompt and every section, bit for bit
(the replay itself, convert.unshard and the model, is run by the integration tests)."""

from __future__ import annotations

import torch

from dsv41_convert.verify import replay
from dsv41_convert.verify.reffile import Reference
from dsv41_convert.verify.runner import ModelInput, PromptRun
from dsv41_convert.verify.thresholds import default_thresholds

V, T, K = 6, 2, 3


def _run(seed: int) -> PromptRun:
    g = torch.Generator().manual_seed(seed)
    return PromptRun(
        logits_all=torch.randn(4, V, generator=g),
        decode_ids=torch.zeros(T + 1, dtype=torch.int64),
        decode_logits=torch.randn(T, V, generator=g),
        draft_logits=torch.randn(T, K, V, generator=g),
        draft_confidence=torch.rand(T, K, generator=g),
    )


def _reference(threads: int = 1) -> Reference:
    runs = [_run(seed) for seed in range(3)]
    inputs = [ModelInput(torch.zeros(4, dtype=torch.int64)) for _ in runs]
    return Reference(inputs, runs, ["a", "b", "c"], 16, "fp8", "cpu", threads=threads, weights="converted")


def _replayed(monkeypatch, ref: Reference, runs: list[PromptRun], threads: int | None = None):
    monkeypatch.setattr(replay, "replay_runs", lambda _ranks, _ref, _device: runs)
    check, got = replay.replay_check(None, ref, "cpu", threads)
    assert got is runs
    return check


def _copy(run: PromptRun) -> PromptRun:
    return PromptRun(
        run.logits_all.clone(),
        run.decode_ids.clone(),
        run.decode_logits.clone(),
        run.draft_logits.clone(),
        draft_confidence=run.draft_confidence.clone(),
    )


def test_equal_runs_are_exact_and_decisive(monkeypatch):
    ref = _reference()
    check = _replayed(monkeypatch, ref, [_copy(r) for r in ref.runs])
    assert check.exact and check.expected_exact and check.decisive and not check.failures


def _one_ulp(t: torch.Tensor) -> None:
    flat = t.view(-1)
    flat[-1] = torch.nextafter(flat[-1], torch.tensor(float("inf")))


def test_one_ulp_in_any_section_of_the_last_prompt_fails(monkeypatch):
    """Bit equality is expected (the same threads, device, torch): one float32 ulp anywhere is a failure, named
    by its section; the last prompt, the decode steps, the drafts and the confidence head count like the rest."""
    ref = _reference()
    for section, part in (
        ("all", lambda r: r.logits_all[1]),
        ("last", lambda r: r.logits_all[-1]),
        ("decode", lambda r: r.decode_logits),
        ("draft", lambda r: r.draft_logits),
        ("confidence", lambda r: r.draft_confidence),
    ):
        runs = [_copy(r) for r in ref.runs]
        _one_ulp(part(runs[-1]))
        check = _replayed(monkeypatch, ref, runs)
        assert not check.exact and not check.decisive, section
        assert [f.split(":")[0] for f in check.failures if f.startswith(f"replay {section}:")], (section, check)


def test_a_difference_not_expected_bit_for_bit_is_inexact_but_no_failure(monkeypatch):
    """A reference of another torch cannot be matched bit for bit: the replay then decides nothing either way."""
    ref = _reference()
    ref.torch_version = "0.0.1"
    runs = [_copy(r) for r in ref.runs]
    _one_ulp(runs[0].logits_all[-1])
    check = _replayed(monkeypatch, ref, runs)
    assert not check.exact and not check.expected_exact and not check.failures and not check.decisive


def test_a_replay_not_expected_bit_for_bit_is_held_to_the_runs_bounds(monkeypatch):
    """Against a reference no replay matches bit for bit (the unquantized bf16 model, another torch) the replay is
    held to the run's statistical bounds, as the tp-N run is: NaN logits (a NaN norm weight in the rank files)
    are a failure of the replay (it said `held, not bit for bit`); a last-bit difference is none."""
    bounds = default_thresholds("quantized").bounds
    ref = _reference()
    ref.weights = "bf16"
    runs = [_copy(r) for r in ref.runs]
    _one_ulp(runs[0].logits_all[-1])
    monkeypatch.setattr(replay, "replay_runs", lambda _ranks, _ref, _device: runs)
    check, _ = replay.replay_check(None, ref, "cpu", None, bounds)
    assert not check.exact and not check.expected_exact and not check.failures
    runs[1].logits_all[-1] = float("nan")
    check, _ = replay.replay_check(None, ref, "cpu", None, bounds)
    assert not check.expected_exact and not check.decisive
    assert any(f.startswith("replay last: ") for f in check.failures), check.failures


def test_the_replay_runs_with_the_references_threads():
    """Its sums in the reference's order: the reference's recorded threads beat --threads (given for the ranks)."""
    assert replay.replay_threads(_reference(threads=3), 2) == 3
    assert replay.replay_threads(_reference(threads=0), 2) == 2
