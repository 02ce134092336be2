"""How verify assembles its comparison: every decode step is compared and each section is judged against its own
bounds; and what the reference records of its run (the thread count decides CPU kernels only)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsv41_convert.verify import reference
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
