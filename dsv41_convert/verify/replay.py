"""The tp-1 replay: the converted rank files merged back to tp 1 in memory and run against a tp-1 reference.

A tp-1 reference (ours, or another implementation's tp-1 run: upstream's model at tp 1 gives our
tp-1 logits bit for bit) cannot be matched bit for bit by a run at tp N: the row-parallel sums
are added in another order. Merging the rank files back (convert.unshard: the inverse of every
split, nothing re-derived from the source) and running them in this process at tp 1 removes that
difference, so a correct conversion reproduces every compared logit exactly.

Catches: any wrong value in any tensor that the prompts touch (a swapped expert, a changed scale
byte, split halves exchanged between ranks, an fp4 nibble of a routed expert, an Engram row, a
tensor of another layer), and every disagreement between rank files (a replicated tensor differing
between ranks, an expert on the wrong rank, a missing padding row) even where no prompt touches it.
Cannot catch: a wrong value no prompt reaches (an expert no prompt routes to, an Engram row no
n-gram hashes to; verify's weights check compares those bytes where the reference file records their
sha256, weight_digests.py), or a fault in the tp-N distributed run itself that the merge undoes (the
tp-N run is still compared with the reference's statistical bounds).
Memory: the whole merged model in this process; `verify --stream-layers` holds one unit instead
(verify.streamed.replay_streamed, the same outputs bit for bit).
"""

from __future__ import annotations

import torch

from dsv41_convert.convert.unshard import RankFiles, unshard_tensors
from dsv41_convert.errors import PlanError, ShardConsistencyError
from dsv41_convert.verify.launch import default_threads
from dsv41_convert.verify.metrics import compare, merge
from dsv41_convert.verify.reffile import Reference
from dsv41_convert.verify.runner import PromptRun, attach_images, build_model, load_state, run_prompt
from dsv41_convert.verify.thresholds import SECTIONS, Bound, judge
from dsv41_convert.verify.verdict import Check, exact_blockers


class NotLoaded(PlanError):
    """The rank files merged, but the merged tensors do not fit the model (a dtype or shape relabelled)."""


def replay_runs(ranks: RankFiles, ref: Reference, device: str) -> list[PromptRun]:
    """Every prompt of `ref` through the merged rank files at tp 1 (decode fed the reference's tokens).

    Raises ShardConsistencyError (rank files disagree) or NotLoaded (the merged tensors do not fit the model).
    """
    args = ranks.args.with_runtime(max_batch_size=1, max_seq_len=ref.max_seq_len, temperature=0.0)
    model = build_model(args, ranks.folder, "cpu", runs_on=device)
    merged = unshard_tensors(ranks)
    try:
        load_state(model, merged, "the rank files merged to tp 1")
    except PlanError as exc:
        raise NotLoaded(str(exc)) from exc
    if device != "cpu":
        model = model.to(device)
    capture = any(r.hidden for r in ref.runs)
    runs = []
    for inp, r in zip(ref.inputs, ref.runs, strict=True):
        teacher = r.decode_ids if r.decode_ids.numel() else None
        runs.append(run_prompt(model, attach_images(inp, args), ref.n_decode, teacher, capture, device))
    return runs


def replay_threads(ref: Reference, threads: int | None) -> int:
    """CPU threads of a tp-1 replay: the reference's own where it records them (its sums in its order),
    else `threads`, else every core (as a tp-1 run uses by default)."""
    return ref.threads or threads or default_threads(1)


def replay_check(
    ranks: RankFiles, ref: Reference, device: str, threads: int | None = None, bounds: dict[str, Bound] | None = None
) -> tuple[Check, list[PromptRun] | None]:
    """Run the replay and compare every section bit for bit.

    threads: CPU threads when the reference does not record its own (default: all cores, as a tp-1 run
             uses by default: reference-logits, upstream)
    bounds:  {section: Bound}, the run's statistical bounds (verify's thresholds): where bit equality is not
             expected (another torch, a bf16 reference) the replay is held to them, as the tp-N run is; a
             broken one is a failure (a NaN replay said `held, not bit for bit`). None: such a replay decides
             nothing either way
    -> (the "replay" Check, the replay's runs or None when the rank files could not be merged)
    """
    before = torch.get_num_threads()
    threads = replay_threads(ref, threads)
    if device == "cpu":
        torch.set_num_threads(threads)
    try:
        runs = replay_runs(ranks, ref, device)
    except (ShardConsistencyError, PlanError) as exc:
        why = (
            "the merged rank files do not load into the model"
            if isinstance(exc, NotLoaded)
            else "the rank files do not merge back to tp 1"
        )
        return Check("replay", False, True, [f"replay: {exc}"], why), None
    finally:
        torch.set_num_threads(before)
    blockers = exact_blockers(
        1, ref.device, ref.threads, ref.torch_version, ref.weights, 1, device, threads, ref.arithmetic
    )
    worst = {}
    for key in SECTIONS:
        parts = [_section(r, g, key) for r, g in zip(ref.runs, runs, strict=True)]
        parts = [p for p in parts if p is not None]
        if parts:
            worst[key] = merge(parts)
    exact = all(s.max_abs == 0 for s in worst.values())
    fails = []
    if not exact and not blockers:
        fails = [f"replay {k}: max_abs {s.max_abs:.3g} > 0 (bit equality expected)" for k, s in worst.items()]
        fails = [f for f, s in zip(fails, worst.values(), strict=True) if s.max_abs != 0]
    elif not exact and bounds is not None:
        fails = [f"replay {k}: {msg}" for k, s in worst.items() for msg in judge(s, bounds[k])]
    note = "rank files merged to tp 1, run here: " + (
        "bit equality expected" if not blockers else "not bit-exact: " + "; ".join(blockers)
    )
    return Check("replay", exact, not blockers, fails, note), runs


def _section(ref: PromptRun, got: PromptRun, key: str):
    if key == "last":
        return compare(ref.logits, got.logits)
    if key == "all":
        return compare(ref.logits_all, got.logits_all) if ref.logits_all.shape == got.logits_all.shape else None
    if key == "decode":
        return compare(ref.decode_logits, got.decode_logits) if ref.decode_logits.shape[0] else None
    if key == "confidence":
        if ref.draft_confidence is None or got.draft_confidence is None:
            return None
        return compare(ref.draft_confidence, got.draft_confidence)
    if ref.draft_logits is None or got.draft_logits is None:
        return None
    return compare(ref.draft_logits, got.draft_logits)
