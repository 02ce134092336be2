"""Reference outputs from the source checkpoint: the bundled model at tp 1 on the source weights,
transformed in memory (verify.source), no files written.

`compute_reference` runs in the calling process with no process group (tp 1) and keeps the weights:
`verify --reference SRC` uses it. `compute_reference_ranks` runs on tp ranks, one process each, every
rank holding only its own slices: `reference-logits SRC OUT --tp N` saves its outputs to a file
(verify.reffile) so that a pipeline can compute them once and verify every weight set against them.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.plan import ConversionPlan, build_plan
from dsv41_convert.convert.tp import check_tp
from dsv41_convert.errors import ConvertError, PlanError, VerifyInputError
from dsv41_convert.model import parallel
from dsv41_convert.numbers import counted
from dsv41_convert.progress import Progress, counting
from dsv41_convert.verify import provenance, weight_digests
from dsv41_convert.verify.arithmetic import arithmetic
from dsv41_convert.verify.fits import NO_DRAFTS, processes_on_this_host, require_prompts_fit, require_weights_fit
from dsv41_convert.verify.launch import launch, tell, told_each
from dsv41_convert.verify.prompts import Prompt, default_prompts, load_prompts, prompt_id_bound
from dsv41_convert.verify.reffile import Reference
from dsv41_convert.verify.runner import (
    ModelInput,
    PromptRun,
    attach_images,
    build_model,
    draft_block,
    load_state,
    model_input,
    positions_needed,
    run_prompt,
)
from dsv41_convert.verify.source import plan_state, reference_plan, reference_state, source_experts

DEFAULT_DECODE_STEPS = 3
PROMPTS = counting("prompts", "prompts")  # the bar of the prompts run (launch.tell)
SEQ_ALIGN = 64
# where the model's positions limit comes from (ModelArgs.max_positions), for messages
CONTEXT = "config.json's rope_scaling factor x original_max_position_embeddings, its max_position_embeddings"


def prompt_lengths(prompts: Sequence[Prompt], inputs: Sequence[ModelInput]) -> list[tuple[str, int]]:
    """Each prompt's name for messages (its file and line where it has them) and its positions in the model."""
    return [(p.origin or p.label, len(i.input_ids)) for p, i in zip(prompts, inputs, strict=True)]


def pick_max_seq_len(
    prompt_lengths: list[int], n_decode: int, requested: int | None, drafts: int = 0, limit: int | None = None
) -> int:
    """The runtime max_seq_len both sides are built with (it sizes caches and decides whether YaRN
    is active, so reference and converted must agree): the request, or the longest prompt plus the
    decode steps and the positions of the drafts after the last (`drafts`: runner.draft_block) rounded up
    to 64, at least 128, at most `limit` (ModelArgs.max_positions: the positions the model supports; None: no
    bound). A request or a need beyond `limit` is a VerifyInputError naming it: a --decode-steps or
    --max-seq-len of 10**5 on make-tiny (256 positions) was accepted and ran until killed (an audit); a need
    that no prompt brings within `limit` names config.json's dspark_block_size (`drafts`) instead."""
    need = positions_needed(max(prompt_lengths), n_decode, drafts)
    after = " and the DSpark drafts after the last" if drafts and n_decode else ""
    if limit is not None and requested is not None and requested > limit:
        raise VerifyInputError(
            f"--max-seq-len {requested:,}: more than the {limit:,} positions the model supports ({CONTEXT})"
        )
    shortest = positions_needed(1, 1, drafts)  # a 1-token prompt and one decode step, then the drafts
    if limit is not None and need > limit and drafts and n_decode and shortest > limit:
        # no prompt fits beside the drafts: the message said "shorter prompts or fewer decode steps" (a carried item)
        raise VerifyInputError(
            f"config.json's dspark_block_size {drafts:,}: the DSpark drafts after a decode step take that many "
            f"positions, so even a 1-token prompt and one decode step need {shortest:,}, more than the {limit:,} the "
            f"model supports ({CONTEXT}): {NO_DRAFTS}"
        )
    if limit is not None and need > limit:
        raise VerifyInputError(
            f"the longest prompt ({max(prompt_lengths):,} positions) plus --decode-steps {n_decode:,}{after} needs "
            f"{need:,} positions, more than the {limit:,} the model supports ({CONTEXT}): shorter prompts or fewer "
            "decode steps"
        )
    if requested is not None:
        if requested < need:
            raise VerifyInputError(
                f"--max-seq-len {requested}: the longest prompt plus decode steps{after} needs {need}"
            )
        return requested
    auto = max(128, -(-need // SEQ_ALIGN) * SEQ_ALIGN)
    return auto if limit is None else min(auto, limit)


def read_prompts(
    prompts_file: Path | None, tokenizer_json: Path | None, args: ModelArgs, feeds_decode_ids: bool = False
) -> list[Prompt]:
    """The built-in prompts, or those of `prompts_file`. feeds_decode_ids: the run feeds a prompt's decode_ids
    to its decode steps (the streamed reference); elsewhere they are refused, since the decode steps feed the
    model's own greedy choices and they would be ignored (`verify --reference SRC` did: an audit)."""
    bound, bound_by = prompt_id_bound(args.vocab_size, bool(args.engram_layer_ids), tokenizer_json)
    if prompts_file is None:
        return default_prompts(bound)
    prompts = load_prompts(prompts_file, tokenizer_json, bound, bound_by)
    placed = [p for p in prompts if args.image_token_id in p.input_ids]
    if placed:  # it ran as a text token, and beside "image" was "2 image placeholders, got 1 images" (an audit)
        # an image goes with a text prompt only (load_prompts): input_ids told to add "image" were refused next
        advice = (
            'give the image as "image" (its span goes after the text) and take the placeholder out'
            if placed[0].text is not None
            else 'an image goes with a text prompt, not with input_ids: give the prompt as "text" without the '
            'placeholder and the image as "image" (its span goes after the text), or take the placeholder out'
        )
        raise VerifyInputError(
            f"{placed[0].origin or placed[0].label}: holds token id {args.image_token_id}, config.json's "
            f"image_token_id (the image placeholder), which only an image span holds: {advice}"
        )
    imaged = next((p for p in prompts if p.image is not None), None)
    if imaged is not None and bound <= args.image_token_id < args.vocab_size:  # past the vocabulary: prepare_vl_inputs
        # every position of its span holds the id, and the Engram hash maps each through the tokenizer's token map
        # (masked only after): "token id ... reached the Engram hash ... give prompts of the tokenizer's ids" (an audit)
        raise VerifyInputError(
            f"{imaged.origin or imaged.label}: image {imaged.image}: config.json's image_token_id "
            f"{args.image_token_id}, which every position of an image span holds, is past {bound_by}: use the "
            "checkpoint's own tokenizer.json, which has the image token"
        )
    fixed = [p.origin or p.label for p in prompts if p.decode_ids is not None]
    if fixed and not feeds_decode_ids:
        raise VerifyInputError(
            f"{fixed[0]}: decode_ids go with `reference-logits --stream-layers` (the tokens its decode steps feed); "
            "elsewhere the decode steps feed the model's own greedy choices: drop them, or compute the reference "
            "with --stream-layers"
        )
    return prompts


@dataclass
class SourceReference:
    reference: Reference
    args: ModelArgs  # the source's ModelArgs (dtype "fp8" or "bf16")
    state: dict[str, Tensor]  # the in-memory transformed source weights (kept for localization)


def compute_reference(
    src: Path,
    prompts: list[Prompt],
    n_decode: int = DEFAULT_DECODE_STEPS,
    max_seq_len: int | None = None,
    device: str = "cpu",
    capture_hidden: bool = True,
    progress: Callable[[str], None] | None = None,
    plan: ConversionPlan | None = None,
) -> SourceReference:
    """Run the source weights through the model at tp 1 over `prompts` (greedy decode, drafts).
    plan: source.reference_plan(src), where the caller has it already."""
    src = Path(src)
    if parallel.is_distributed():
        raise VerifyInputError("the tp-1 reference must be computed before joining a process group")
    say = progress or (lambda _msg: None)
    args = load_model_args(src / "config.json")
    inputs = [model_input(p, args) for p in prompts]
    seq = pick_max_seq_len(
        [len(i.input_ids) for i in inputs], n_decode, max_seq_len, draft_block(args), args.max_positions
    )
    args = args.with_runtime(max_batch_size=1, max_seq_len=seq, temperature=0.0)
    require_prompts_fit(args, device, prompt_lengths(prompts, inputs))
    stream = f"`reference-logits {src} FILE --stream-layers`, then `verify --reference-logits FILE --stream-layers`"
    copies = processes_on_this_host()  # under torchrun each process computes this whole reference before joining
    way_out = f"{stream} (each holds one unit at a time)"
    if copies > 1:
        way_out += f", or `reference-logits {src} FILE` once and the launch with --reference-logits FILE"
    plan = plan or reference_plan(src)  # one plan for the check and the weights (1-2 s on the published layout)
    require_source_weights_fit(plan, args, device, way_out, copies=copies)
    say(f"reference: transforming {src} in memory (tp 1)")
    source_format, state = reference_state(src, plan=plan)
    model = build_model(args, src, "cpu", runs_on=device)
    load_state(model, state)
    if device != "cpu":
        model = model.to(device)
    runs = []
    for i, inp in enumerate(inputs):
        say(f"reference: prompt {i + 1}/{len(inputs)} ({len(inp.input_ids)} tokens, {n_decode} decode steps)")
        runs.append(run_prompt(model, inp, n_decode, None, capture_hidden, device))
    del model
    gc.collect()
    weights = "converted" if source_format == "fp8" else "bf16"
    labels = [p.label for p in prompts]
    ref = Reference(inputs, runs, labels, seq, source_format, device, **_recorded(device), weights=weights)
    ran = [weight_digests.digests(state)] if weights == "converted" else None
    ref.provenance = provenance.record(src, args, ran and weight_digests.record(ran, source_experts(src)))
    return SourceReference(ref, args, state)


def require_source_weights_fit(
    plan: ConversionPlan, args: ModelArgs, device: str, way_out: str, as_converted: bool = False, copies: int = 1
) -> None:
    """VerifyInputError (fits.require_weights_fit) where the weights of `plan` (the source's conversion at its tp,
    experts as the source stores them) cannot be held by this host (or `device`): before a model is built. Each
    rank holds its rank file computed in memory and the model it is copied into, both whole
    (convert.memory.reference_weights); a bf16 source run unquantized (not `as_converted`) holds them bf16
    everywhere: on a bf16 source twice and more the file's fp8/fp4 figure `plan --tp N` shows, which was counted (a
    run that needed 13.4 GiB was counted 3.4 GiB).
    copies: the processes of this host that each compute this whole tp-1 reference at once (fits.processes_on_this_
            host: under torchrun every process of `verify --reference SRC` does, before the ranks join; the host was
            asked for one); each moves its own model to its own card"""
    from dsv41_convert.convert.memory import reference_weights

    held = reference_weights(plan, args, plan.source_format == "bf16" and not as_converted)
    host, card = [copies * (state + model) for state, model in held], [model for _, model in held]
    what = f"{plan.src} at tp {plan.tp}" + (
        f", computed whole by each of the {copies} processes on this host" if copies > 1 else ""
    )
    require_weights_fit(host, device, what, way_out, card)


def _recorded(device: str) -> dict:
    """What decides bit equality besides tp and device (reffile's docstring): this process's threads, torch,
    and what picks its kernels."""
    return {
        "threads": torch.get_num_threads() if device == "cpu" else 0,
        "torch_version": torch.__version__,
        "arithmetic": arithmetic(device),
    }


def records_weight_digests(src: Path, args: ModelArgs, as_converted: bool, stream_layers: bool) -> bool:
    """Whether `reference-logits SRC` (with --weight-digests) records the sha256 of the weights it runs, so
    that verify compares every weight byte for byte, also those no prompt reaches: converted weights only (an
    fp8 source, args.dtype "fp8" as ConversionPlan.source_format, or --as-converted), and with --stream-layers
    not of a folder of rank files (their own tp-1 replay: streamed.compute_streamed_reference records none).
    Known before the compute, from SRC's config.json (`args`) and file names."""
    if stream_layers:
        from dsv41_convert.verify.rank_weights import rank_file_tp

        return args.dtype == "fp8" and rank_file_tp(src) is None
    return args.dtype == "fp8" or as_converted


@dataclass
class RankReferenceJob:
    src: str
    inputs: list[ModelInput]
    n_decode: int
    max_seq_len: int
    device: str
    as_converted: bool  # a bf16 source: run the converter's quantized output, not the bf16 model
    record_weights: bool = True  # converted weights: their sha256 into the file (weight_digests.py)


def compute_reference_ranks(
    src: Path,
    prompts: list[Prompt],
    tp: int = 1,
    n_decode: int = DEFAULT_DECODE_STEPS,
    max_seq_len: int | None = None,
    device: str = "cpu",
    as_converted: bool = False,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    record_weights: bool = True,
    bars: Progress | None = None,
    record_experts_as: bool = True,
    timeout_s: int | None = None,
) -> Reference | None:
    """The reference on `tp` ranks, one process each, launched as verify launches the converted files:
    each rank computes its own rank file of `shard SRC --tp tp` in memory, reading only its slices of the
    source, and runs every prompt (greedy decode, drafts, hidden states). At the same tp and device a
    correct conversion then gives these logits bit for bit. None on a torchrun rank other than 0.

    as_converted: for a bf16 source, run the converter's quantized output (the values every conversion
                  holds, so verify can be exact) instead of the unquantized bf16 model
    record_weights: record the sha256 of every converted weight of every rank (weight_digests.py), and
                    (record_experts_as) of the routed experts in the other expert dtype (computed here once the
                    ranks have ended)
    bars: rank 0's progress: the source tensors its file computes, then the prompts run; then the experts
    timeout_s: the ranks' group timeout (launch's: how long a rank waits for a hung peer; default 10 minutes)
    """
    say = progress or (lambda _msg: None)
    src = Path(src)
    args = load_model_args(src / "config.json")
    check_tp(args, tp, str(src / "config.json"))  # here, not in each rank after the launch
    inputs = [model_input(p, args) for p in prompts]
    seq = pick_max_seq_len(
        [len(i.input_ids) for i in inputs], n_decode, max_seq_len, draft_block(args), args.max_positions
    )
    require_prompts_fit(args, device, prompt_lengths(prompts, inputs), tp)
    stream = "`reference-logits --stream-layers` (tp 1: it holds one unit at a time)"
    require_source_weights_fit(build_plan(src, tp, source_experts(src)), args, device, stream, as_converted)
    say(f"reference: {src} on {counted(tp, 'rank')} ({device}), each transforming its own slices in memory")
    job = RankReferenceJob(str(src), inputs, n_decode, seq, device, as_converted, record_weights)
    out = launch(reference_rank, job, tp, device, threads, bars, timeout_s)
    if out is None:
        return None
    runs, source_format, recorded, every = out
    weights = "converted" if source_format == "fp8" or as_converted else "bf16"
    labels = [p.label for p in prompts]
    ref = Reference(inputs, runs, labels, seq, source_format, device, tp=tp, weights=weights, **recorded)
    digests = None
    if every is not None:
        experts = source_experts(src)
        as_other = _experts_as(src, experts, say, bars) if record_experts_as else None
        digests = weight_digests.record(every, experts, as_other)
    ref.provenance = provenance.record(src, args, digests)
    return ref


def _experts_as(src: Path, experts: str, say: Callable[[str], None], bars: Progress | None) -> dict[str, str] | None:
    """weight_digests.of_experts_as of the routed experts in the other expert dtype, None where there is none."""
    weights_as = weight_digests.weights_as_other(src, experts)
    if weights_as is None:
        return None
    say(f"weights: the sha256 of the routed experts of {src} as {weights_as.plan.expert_dtype}")
    try:
        return weight_digests.of_experts_as(weights_as, bars)
    finally:
        weights_as.close()


def reference_rank(job: RankReferenceJob) -> tuple[list[PromptRun], str, dict, list[dict[str, str]] | None]:
    """The body of one reference rank: this rank's file of the tp-N plan, in memory, then every prompt.
    -> (runs, source format, what decides bit equality, the weights' digests of every rank (converted
    weights only: weight_digests.digests))"""
    from dsv41_convert.config import ModelArgs

    src = Path(job.src)
    plan = build_plan(src, parallel.world_size(), source_experts(src))  # experts as the source stores them
    unquantized = plan.source_format == "bf16" and not job.as_converted
    # the unquantized model takes the source's args (dtype bf16); otherwise the converted folder's
    args = load_model_args(src / "config.json") if unquantized else ModelArgs.from_inference_dict(plan.inference_config)
    args = args.with_runtime(max_batch_size=1, max_seq_len=job.max_seq_len, temperature=0.0)
    model = build_model(args, src, "cpu", runs_on=job.device)
    error, mine = "", None
    try:
        state = plan_state(plan, parallel.rank(), skip_quant=unquantized, progress=tell)
        load_state(model, state)
        mine = None if unquantized or not job.record_weights else weight_digests.digests(state)
        del state
    except ConvertError as exc:
        error = str(exc)
    # every rank stops together before the first collective of a forward pass (verify.launch)
    errors = [error]
    if parallel.is_distributed():
        errors = [""] * parallel.world_size()
        torch.distributed.all_gather_object(errors, error)
    if any(errors):  # ranks named where there are several, as launch names an ungathered error
        raise PlanError("\n".join(f"rank {r}: {e}" if len(errors) > 1 else e for r, e in enumerate(errors) if e))
    every = [mine]
    if parallel.is_distributed():
        every = [None] * parallel.world_size()
        torch.distributed.all_gather_object(every, mine)
    if job.device != "cpu":
        from dsv41_convert.model.warm import warm_up_kernels

        model = model.to(job.device)
        warm_up_kernels(model, job.device)  # every rank compiles before the first collective, as verify's ranks
    runs = []
    for inp in told_each(PROMPTS, job.inputs):
        inp = attach_images(inp, args)
        runs.append(run_prompt(model, inp, job.n_decode, None, True, job.device))
    return runs, plan.source_format, _recorded(job.device), None if mine is None else every
