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
