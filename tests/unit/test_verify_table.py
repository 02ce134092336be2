"""verify.table: the verdict line says what a PASS rests on, and claims no evidence a check did not give."""

from __future__ import annotations

import io

from rich.console import Console

from dsv41_convert.verify.run import VerifyResult
from dsv41_convert.verify.thresholds import default_thresholds
from dsv41_convert.verify.verdict import Check


def _printed(result: VerifyResult) -> str:
    from dsv41_convert.verify.table import render

    console = Console(file=io.StringIO(), width=400, record=True, color_system=None)
    console.print(render(result))
    return console.export_text()


def _result(verdict: str, checks: list[Check]) -> VerifyResult:
    return VerifyResult("conv", "ref.safetensors", 2, "cpu", default_thresholds("reduction"), [], {}, [],
                        checks=checks, verdict=verdict)  # fmt: skip


def test_a_pass_on_statistical_bounds_is_not_called_decisive():
    """A PASS that no bit-for-bit check carried (--statistical, the teacher within its noise bound) says so; it
    was printed as "decisive: " with nothing after, a proof that no check gave."""
    teacher = Check("teacher", exact=False, expected_exact=False, note="within bound")
    text = _printed(_result("PASS", [teacher]))
    assert "PASS  mode reduction; statistical bounds only (--statistical); the teacher check held within its " \
           "measured noise bound, which is evidence, not proof" in text  # fmt: skip
    assert "decisive" not in text
    replay = Check("replay", exact=True, expected_exact=True, note="every logit")
    assert "PASS  mode reduction; decisive: replay bit for bit" in _printed(_result("PASS", [replay, teacher]))


def test_a_teacher_check_that_failed_is_not_said_to_have_held():
    """An INCONCLUSIVE run whose teacher check failed: the line must not add that the teacher held within its
    noise bound (evidence the run did not give)."""
    teacher = Check("teacher", exact=False, expected_exact=False, failures=["teacher: top1 0.5 < 0.9"], note="x")
    text = _printed(_result("INCONCLUSIVE", [teacher]))
    assert "INCONCLUSIVE  mode reduction; no decisive check held\n" in text
    assert "noise bound" not in text
