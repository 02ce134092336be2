"""verify.metrics and verify.thresholds: the numbers and the verdicts."""

import math

import pytest
import torch

from dsv41_convert.verify.metrics import Stats, compare, merge, relative_error
from dsv41_convert.verify.thresholds import EXACT, choose_mode, default_thresholds, judge


def test_identical_logits_agree_exactly():
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    s = compare(x, x.clone())
    assert (s.rows, s.top1, s.kl_mean, s.kl_max, s.max_abs) == (5, 1.0, 0.0, 0.0, 0.0)
    assert judge(s, EXACT) == []


def test_kl_matches_a_hand_computed_value():
    ref = torch.tensor([[0.0, 0.0]], dtype=torch.float64)  # p = (1/2, 1/2)
    conv = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)  # q = (3/4, 1/4)
    s = compare(ref, conv)
    want = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert s.kl_max == pytest.approx(want, rel=1e-12, abs=0)
    assert s.top1 == 1.0  # both pick index 0 (ref ties break to the first)
    assert s.max_abs == pytest.approx(math.log(3.0))


def test_top1_counts_rows_and_nan_is_infinitely_far():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    conv = torch.tensor([[1.0, 0.0], [float("nan"), 0.0]])
    s = compare(ref, conv)
    assert s.rows == 2 and s.top1 == 0.5
    assert s.kl_max == math.inf and s.max_abs == math.inf
    assert judge(s, default_thresholds("quantized").bounds["last"])  # a NaN never passes


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        compare(torch.zeros(2, 3), torch.zeros(3, 3))


def test_merge_weights_means_by_rows_and_keeps_extremes():
    a = Stats(1, 1.0, 0.1, 0.1, 0.9, 1.0)
    b = Stats(3, 0.0, 0.5, 0.7, 0.5, 2.0)
    m = merge([a, b])
    assert m.rows == 4 and m.top1 == 0.25
    assert m.kl_mean == pytest.approx((0.1 + 1.5) / 4) and m.kl_max == 0.7
    assert m.cos_min == 0.5 and m.max_abs == 2.0


def test_relative_error():
    a = torch.tensor([3.0, 4.0])
    assert relative_error(a, a) == 0.0
    assert relative_error(a, torch.tensor([3.0, 4.5])) == pytest.approx(0.1)
    assert relative_error(a, torch.zeros(3)) == math.inf


def test_exact_bound_rejects_one_ulp():
    x = torch.tensor([[1.0, 2.0, 3.0]])
    y = x.clone()
    y[0, 1] = torch.nextafter(y[0, 1], torch.tensor(10.0))
    assert any("max_abs" in m for m in judge(compare(x, y), EXACT))


def test_modes():
    assert choose_mode("converted", True) == "exact"
    assert choose_mode("converted", False) == "reduction"
    assert choose_mode("", False) == "reduction"
    assert choose_mode("bf16", False) == "quantized"
    with pytest.raises(ValueError):
        default_thresholds("loose")


def test_overrides_apply_to_every_section():
    th = default_thresholds("exact").override(max_kl=0.5, min_top1=0.9)
    assert th.mode == "exact+overrides"
    assert all(b.max_kl == 0.5 and b.min_top1 == 0.9 and b.atol == 0.0 for b in th.bounds.values())
    s = Stats(10, 0.8, 0.0, 0.1, 1.0, 0.0)
    assert judge(s, th.bounds["last"]) == ["top1 0.800 < 0.9"]


def test_a_nan_row_has_the_worst_cosine():
    """A non-finite converted row is as far as a row can be on every metric, the cosine included (-1, not 1)."""
    ref = torch.tensor([[1.0, 0.0, 2.0]])
    s = compare(ref, torch.tensor([[float("nan"), 0.0, 2.0]]))
    assert s.cos_min == -1.0 and s.kl_max == math.inf and s.max_abs == math.inf


def test_merge_keeps_the_largest_difference_of_any_prompt():
    worst_first = [Stats(2, 1.0, 0.0, 0.0, 1.0, d) for d in (3.0, 0.5, 0.0)]
    assert merge(worst_first).max_abs == 3.0
    assert merge(worst_first[::-1]).max_abs == 3.0


def test_relative_error_of_non_finite_or_zero_reference_is_infinite():
    """NaN would compare False with every tolerance, so localization would never call such a module diverged."""
    a = torch.tensor([3.0, 4.0])
    assert relative_error(a, torch.tensor([3.0, float("nan")])) == math.inf
    assert relative_error(a, torch.tensor([3.0, float("inf")])) == math.inf
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.zeros(2), torch.tensor([0.0, 1e-3])) == math.inf


def test_loose_bounds_still_fail_one_row_far_off_among_many_agreeing():
    """Against another tp the bounds admit noise (KL mean 1, KL max 3: thresholds.py), but one row whose KL is far
    past the max fails even where the mean over the other, equal rows stays inside its bound."""
    ref = torch.zeros(10, 4)
    ref[:, 0] = 8.0
    conv = ref.clone()
    conv[3] = torch.tensor([0.0, 8.0, 0.0, 0.0])  # KL ~ 8 nats in one row, 0 in nine: mean ~ 0.8
    s = compare(ref, conv)
    assert s.kl_max > 5.0 and s.kl_mean < 1.0
    for mode in ("reduction", "quantized"):
        bounds = default_thresholds(mode).bounds
        for section in ("last", "all", "decode", "draft"):
            found = judge(s, bounds[section])
            assert [m for m in found if m.startswith("kl_max")] and not [m for m in found if "kl_mean" in m], found


def test_a_bound_holds_at_its_limit_and_breaks_just_past_it():
    th = default_thresholds("reduction").override(min_cos=0.99, min_top1=0.5, max_kl=0.25, max_kl_mean=0.125)
    at = Stats(4, 0.5, 0.125, 0.25, 0.99, 0.0)
    assert judge(at, th.bounds["all"]) == []
    past = Stats(4, 0.5 - 1e-9, 0.125 + 1e-9, 0.25 + 1e-9, 0.99 - 1e-9, 0.0)
    assert [m.split()[0] for m in judge(past, th.bounds["all"])] == ["top1", "kl_mean", "kl_max", "cos_min"]
