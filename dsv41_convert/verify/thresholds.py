"""Pass/fail bounds for verify, chosen from what the conversion is allowed to change.

These bounds judge one comparison; the verdict (PASS / FAIL / INCONCLUSIVE) is verify.verdict's: the
statistical modes below can fail a run but never pass one on their own (unless --statistical).

Three modes, picked from the reference and the converted folder:

- `exact`: the reference ran what every correct conversion holds (an fp8/fp4 source, or a bf16 source
  quantized as the converter does; fp4 experts cast to fp8 compute the same bits, measured), at the same
  tp, on the same device, with the same CPU threads and torch (verdict.exact_blockers). The converted
  model then runs the same numbers through the same kernels in the same order as the reference: logits
  must be equal bit for bit (atol 0, KL 0). Anything else is a conversion bug.
- `reduction`: the same conversion at another tp (or a reference from another device). Only the order
  of the fp32 sums changes: each row-parallel product (wo_b, the MoE experts split over ranks) is
  summed over ranks in fp32 and rounded to bf16 once, so a sum differs from tp 1 by at most one bf16
  ulp (2^-8 relative) where its rounding boundary is near. These last-bit differences propagate,
  and in small random models one of them can flip an indexer or expert top-k choice, which moves
  later logits much more (SPEC.md section 6). The bounds below allow the measured noise of the
  tiny preset with a margin. They are loose because that noise is large, not to hide faults: with
  --reference SRC every run is also compared with its twin (verify.twin), bit for bit.
- `quantized`: a bf16 source quantized to fp8 weights and fp4 (or fp8) experts, compared against the
  bf16 model. Bounds are the quantization error measured on make-tiny with a margin (numbers below);
  here too the twin (the converter's quantized tp-1 output, run at the same tp) must agree exactly.

Each mode has one `Bound` per section of the comparison: "last" (last prompt position), "all" (every
prompt position), "decode" (greedy decode steps), "draft" (DSpark draft logits), "confidence" (the DSpark
confidence head's output beside each draft token, [T, K]: compared as rows of K values, judged only bit for
bit).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dsv41_convert.verify.metrics import Stats

SECTIONS = ("last", "all", "decode", "draft", "confidence")
INF = math.inf


@dataclass(frozen=True)
class Bound:
    """Limits on one section's Stats; a row set passes when every limit holds."""

    min_top1: float = 1.0
    max_kl_mean: float = 0.0
    max_kl: float = 0.0
    min_cos: float = 1.0
    atol: float = 0.0  # on max |ref - conv|; inf: not checked

    def to_json(self) -> dict[str, float]:
        return {k: (v if v != INF else None) for k, v in dataclasses.asdict(self).items()}


EXACT = Bound()
# Against the tp-1 reference, make-tiny (seed 0, 3 built-in prompts, 3 decode steps) measured:
#   tp 2 pass-through:  KL mean last/all/decode/draft 0.11 / 0.12 / 0.14 / 0.58, KL max 0.18 / 0.53 / 0.41 / 0.86,
#                       top-1 0.33 / 0.46 / 0.44 / 0.09, while the twin agreed bit for bit;
#   bf16 -> fp8/fp4 tp 1: KL mean 0.30 / 0.28 / 0.26 / 0.70, KL max 0.36 / 0.95 / 0.48 / 1.09,
#                       top-1 0.0 / 0.19 / 0.44 / 0.02.
# The tiny random model is chaotic: the relative error of the hidden states grows from 3e-3 after the first
# all-reduce to 0.5 at the final norm (fp8 activation rounding amplifies each last-bit change). So against
# the tp-1 reference these bounds only catch gross damage (wrong tensors everywhere, NaN, garbage logits);
# the bit-exact twin (verify.twin) is what catches a single wrong tensor. On trained models the noise is far
# smaller; tighten with --max-kl / --min-top1 there.
_LOOSE = Bound(min_top1=0.0, max_kl_mean=1.0, max_kl=3.0, min_cos=-1.0, atol=INF)
_LOOSE_DRAFT = Bound(min_top1=0.0, max_kl_mean=1.5, max_kl=3.0, min_cos=-1.0, atol=INF)
# the DSpark confidence head's output: its noise is not measured, so only the exact mode judges it
_UNJUDGED = Bound(min_top1=0.0, max_kl_mean=INF, max_kl=INF, min_cos=-1.0, atol=INF)
REDUCTION = {"last": _LOOSE, "all": _LOOSE, "decode": _LOOSE, "draft": _LOOSE_DRAFT, "confidence": _UNJUDGED}
QUANTIZED = {"last": _LOOSE, "all": _LOOSE, "decode": _LOOSE, "draft": _LOOSE_DRAFT, "confidence": _UNJUDGED}
# relative L2 error of a module's output above which localization calls it diverged
HIDDEN_RTOL = {"exact": 0.0, "reduction": 2e-2, "quantized": 0.2}


@dataclass(frozen=True)
class Thresholds:
    mode: str  # exact | reduction | quantized
    bounds: dict[str, Bound]
    hidden_rtol: float

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "hidden_rtol": self.hidden_rtol,
            "bounds": {k: b.to_json() for k, b in self.bounds.items()},
        }

    def override(
        self,
        atol: float | None = None,
        max_kl: float | None = None,
        max_kl_mean: float | None = None,
        min_top1: float | None = None,
        min_cos: float | None = None,
    ) -> Thresholds:
        """The same thresholds with the given limits replaced in every section."""
        given = {
            "atol": atol,
            "max_kl": max_kl,
            "max_kl_mean": max_kl_mean,
            "min_top1": min_top1,
            "min_cos": min_cos,
        }
        changes = {k: v for k, v in given.items() if v is not None}
        if not changes:
            return self
        bounds = {k: dataclasses.replace(b, **changes) for k, b in self.bounds.items()}
        return Thresholds(self.mode + "+overrides", bounds, self.hidden_rtol)


def choose_mode(weights: str, expected_exact: bool) -> str:
    """exact | reduction | quantized (see the module docstring).

    weights:        the reference's weights (reffile): "converted" | "bf16" | "" (unknown)
    expected_exact: a correct conversion gives the reference's logits bit for bit (verdict.exact_blockers)
    """
    if expected_exact:
        return "exact"
    return "quantized" if weights == "bf16" else "reduction"


def default_thresholds(mode: str) -> Thresholds:
    table = {"exact": dict.fromkeys(SECTIONS, EXACT), "reduction": REDUCTION, "quantized": QUANTIZED}
    if mode not in table:
        raise ValueError(f"unknown verify mode {mode!r}")
    return Thresholds(mode, dict(table[mode]), HIDDEN_RTOL[mode])


def judge(stats: Stats, bound: Bound) -> list[str]:
    """The limits `stats` break, as short phrases ("kl_max 0.31 > 0.01"); [] when it passes."""
    if stats.rows == 0:
        return []
    out = []
    if stats.top1 < bound.min_top1:
        out.append(f"top1 {stats.top1:.3f} < {bound.min_top1:g}")
    if not stats.kl_mean <= bound.max_kl_mean:
        out.append(f"kl_mean {stats.kl_mean:.3g} > {bound.max_kl_mean:g}")
    if not stats.kl_max <= bound.max_kl:
        out.append(f"kl_max {stats.kl_max:.3g} > {bound.max_kl:g}")
    if stats.cos_min < bound.min_cos:
        out.append(f"cos_min {stats.cos_min:.6f} < {bound.min_cos:g}")
    if not stats.max_abs <= bound.atol:
        out.append(f"max_abs {stats.max_abs:.3g} > {bound.atol:g}")
    return out
