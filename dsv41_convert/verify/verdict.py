"""The verdict of verify: PASS only when a decisive check ran and held.

A check compares the converted weights' outputs with something they must reproduce. It is decisive
when it compares bit for bit something a correct conversion reproduces bit for bit:

    reference   the converted ranks against the reference, when the reference ran the same numbers
                the same way: same tp, device, CPU threads, torch, and weights every correct conversion
                holds (reffile's `weights` "converted")
    replay      the rank files merged back to tp 1 (convert.unshard) and run in one process, against a
                tp-1 reference run the same way
    twin        the converted ranks against the converter's expected output cut into the same ranks
                (verify --reference SRC)
    weights     every tensor of the rank files byte for byte against the sha256 the reference file
                records of the weights it ran (verify.weight_digests), at the record's tp or cut to it: the
                converted model then computes what the reference computed, reached by a prompt or not,
                the DSpark stages included; not decisive where it skips the routed experts (stored in
                another dtype than the reference's)

A teacher check (verify.teacher: each module on the reference's input, within measured reduction noise)
is not decisive unless every module came out bit for bit equal: its bound is measured, not proven, and
an audit (2026-12-04) found a doubled fp4 scale of a routed expert that a 12-token prompt reached held at
1.6 ulps against the bound of 2, while the replay failed it. Breaking its bound is a FAIL.

Bit equality certifies itself: a comparison that comes out equal is decisive even where it was not
expected. One that differs where equality was expected (`exact_blockers` is empty) is a FAIL. The
statistical bounds (thresholds.py) judge the rest: breaking them is a FAIL, keeping them is not
evidence on a model whose reduction noise is as large as a wrong tensor's effect, so a run with no
decisive check is INCONCLUSIVE (exit 3) unless the user accepted statistical bounds (--statistical).

    verdict   exit  meaning
    PASS      0     a decisive check held (or --statistical and every bound held)
    FAIL      1     the converted weights do not reproduce the reference
    INCONCLUSIVE 3  only statistical bounds applied, and they held
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41_convert.errors import CHECK_FAILED
from dsv41_convert.verify.arithmetic import arithmetic

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS: 0, FAIL: CHECK_FAILED, INCONCLUSIVE: 3}


@dataclass
class Check:
    """One comparison and what it found."""

    name: str  # reference | replay | twin | weights | teacher
    exact: bool  # every compared value equal bit for bit
    expected_exact: bool  # bit equality was expected (see exact_blockers)
    failures: list[str] = field(default_factory=list)
    note: str = ""  # what was compared, or why it was not exact
    covers_drafts: bool = True  # it compared the DSpark drafts (mtp.*) or their weights; the teacher does not

    @property
    def decisive(self) -> bool:
        """A check whose holding proves the conversion reproduces the reference: bit for bit equal."""
        return self.exact and not self.failures

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "exact": self.exact,
            "expected_exact": self.expected_exact,
            "decisive": self.decisive,
            "covers_drafts": self.covers_drafts,
            "failures": self.failures,
            "note": self.note,
        }


def exact_blockers(
    ref_tp: int,
    ref_device: str,
    ref_threads: int,
    ref_torch: str,
    ref_weights: str,
    tp: int,
    device: str,
    threads: int,
    ref_arithmetic: str = "",
) -> list[str]:
    """Why a run at (tp, device, threads) of a correct conversion need not give the reference's logits bit
    for bit; [] when it must. A field the reference does not record (0 / "") blocks nothing."""
    out = []
    if ref_weights == "bf16":
        out.append("the reference ran the unquantized bf16 model (recompute it with `reference-logits --as-converted`)")
    elif ref_weights != "converted":
        out.append("the reference does not record which weights it ran (metadata `weights`)")
    if ref_tp != tp:
        out.append(f"the reference ran at tp {ref_tp}, this run at tp {tp}")
    if ref_device != device:
        out.append(f"the reference ran on {ref_device}, this run on {device}")
    if device == "cpu" and ref_threads and ref_threads != threads:
        out.append(f"the reference ran {ref_threads} CPU threads per rank, this run {threads} (--threads)")
    if ref_torch and ref_torch != torch.__version__:
        out.append(f"the reference ran torch {ref_torch}, this is torch {torch.__version__}")
    if ref_arithmetic and ref_device == device and ref_arithmetic != (here := arithmetic(device)):
        out.append(f"the reference's kernels were picked by {ref_arithmetic!r}, this run's by {here!r}")
    return out


def decide(checks: list[Check], statistical_failures: list[str], statistical: bool, drafts: bool = False) -> str:
    """PASS | FAIL | INCONCLUSIVE from the checks and the statistical bounds (module docstring). `drafts`:
    the model has DSpark stages (mtp.*): a decisive check must have compared their drafts too, so a held
    teacher check alone (the backbone's modules on the prompt), or a reference without decode steps (the
    stages never ran), leaves the run INCONCLUSIVE."""
    if statistical_failures or any(c.failures for c in checks):
        return FAIL
    decisive = [c for c in checks if c.decisive]
    if statistical or (decisive and (not drafts or any(c.covers_drafts for c in decisive))):
        return PASS
    return INCONCLUSIVE


def drafts_uncovered(checks: list[Check]) -> bool:
    """A decisive check held, but none covers the DSpark drafts (a reference without decode steps, or a
    teacher check whose modules all came out bit for bit)."""
    decisive = [c for c in checks if c.decisive]
    return bool(decisive) and not any(c.covers_drafts for c in decisive)


def advice(
    tp: int, from_source: bool, drafts_only: bool = False, experts_skipped: str = "", bf16_source: bool = False
) -> str:
    """What would make an inconclusive run decisive. drafts_only: a decisive check held, the DSpark drafts
    are what none covered. experts_skipped: the reference's digests were compared but for the routed experts,
    stored in another dtype here (that dtype, e.g. "fp8"). bf16_source: the reference ran the unquantized
    model of a bf16 source, so a reference of the converted weights needs --as-converted."""
    quantized = " --as-converted" if bf16_source else ""
    ways = [
        f"a reference computed at this tp and device (`reference-logits SRC OUT --tp {tp}{quantized}`)",
        f"a tp-1 reference computed on this device (`reference-logits SRC OUT{quantized}`: the rank files are then "
        "replayed at tp 1, without --no-replay)",
    ]
    if experts_skipped:
        ways.append(
            f"a `reference-logits` file of a conversion with {experts_skipped} experts (this file's digests were "
            f"compared for every tensor but the routed experts, stored as {experts_skipped} here)"
        )
    elif not drafts_only:
        ways.append(
            "a `reference-logits` file of the converted weights, at any tp, that records their digests (every file "
            "it writes since 2026-12-04, unless --no-weight-digests: each tensor is then compared byte for byte)"
        )
    if not from_source:
        ways.append("the source checkpoint (`--reference SRC`: the twin)")
    why = (
        "a decisive check held for the backbone, but none compared the DSpark draft stages (mtp.*): a reference "
        "without decode steps never ran them (compute it with --decode-steps 1 or more, the default is 3; or with "
        "its weight digests, which compare their bytes); "
        if drafts_only
        else ""
    )
    return why + "for a decisive check use " + "; or ".join(ways) + "; or accept statistical bounds with --statistical"
