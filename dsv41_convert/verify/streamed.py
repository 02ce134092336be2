"""The reference computed layer by layer (`reference-logits SRC OUT --stream-layers`): the bundled model
at tp 1 over the source weights, read one unit at a time (model/streamed.py) through SourceWeights, so
the peak memory is one unit plus the working set instead of the whole checkpoint. A folder of converted
rank files (model{r}-mp{N}.safetensors) is read through RankWeights instead: merged back to tp 1 per
request, the tp-1 replay of those bytes.

Decode tokens are fixed before the pass, not chosen greedily: a prompt's `decode_ids` from the prompt
file (at least decode_steps + 1 of them; the first decode_steps + 1 are used), or else the rule below,
recorded in the file's decode_ids like greedy ones:

    decode_ids[k] = input_ids[k % len(input_ids)]   (the prompt's own tokens, from its first; text ids
                                                      before any image span; token 0 for an empty prompt)

The result equals `verify.runner.run_prompt(model, ..., teacher=decode_ids)` on the whole model bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.unshard import RankFiles
from dsv41_convert.errors import VerifyInputError, first_few
from dsv41_convert.model import parallel
from dsv41_convert.model.streamed import StreamPrompt, StreamResult, UnitTiming, run_streamed
from dsv41_convert.progress import Progress
from dsv41_convert.store.manifest import MANIFEST
from dsv41_convert.store.manifest_check import check_folder
from dsv41_convert.verify import provenance, weight_digests
from dsv41_convert.verify.fits import require_caches_fit, require_prompts_fit
from dsv41_convert.verify.prompts import Prompt
from dsv41_convert.verify.rank_weights import RankWeights, rank_file_tp
from dsv41_convert.verify.reference import _recorded, pick_max_seq_len, prompt_lengths
from dsv41_convert.verify.reffile import Reference
from dsv41_convert.verify.runner import (
    ModelInput,
    PromptRun,
    attach_images,
    draft_block,
    model_input,
    shortest_drafted,
)
from dsv41_convert.verify.source import SourceWeights, source_experts


def fixed_decode_ids(prompt: Prompt, n_decode: int) -> torch.Tensor:
    """The n_decode + 1 tokens the decode steps feed (see the module docstring). -> [n_decode + 1] int64"""
    if prompt.decode_ids is not None:
        if len(prompt.decode_ids) < n_decode + 1:
            raise VerifyInputError(
                f"{prompt.origin or prompt.label}: {len(prompt.decode_ids)} decode_ids, {n_decode} decode steps "
                f"need {n_decode + 1} (step t feeds decode_ids[t]; the last one starts the drafts)"
            )
        ids = list(prompt.decode_ids[: n_decode + 1])
    else:
        own = list(prompt.input_ids) or [0]
        ids = [own[k % len(own)] for k in range(n_decode + 1)]
    return torch.tensor(ids, dtype=torch.int64)


def unfed_decode_ids(prompt: Prompt, n_decode: int) -> str | None:
    """A warning where `prompt` gives decode_ids that n_decode steps do not feed (fixed_decode_ids takes the
    first n_decode + 1; none without a step), else None."""
    given = 0 if prompt.decode_ids is None else len(prompt.decode_ids)
    where = prompt.origin or prompt.label
    if given and not n_decode:  # no step runs, no draft starts
        return f"{where}: {given} decode_ids, but --decode-steps 0 feeds none of them"
    if given > n_decode + 1:
        return (
            f"{where}: {given} decode_ids, {n_decode} decode steps feed the first {n_decode + 1} "
            f"(--decode-steps {given - 1} feeds them all)"
        )
    return None


def compute_streamed_reference(
    src: Path,
    prompts: list[Prompt],
    n_decode: int,
    max_seq_len: int | None = None,
    device: str = "cpu",
    capture_hidden: bool = True,
    progress: Progress | None = None,
    say: Callable[[str], None] | None = None,
    record_weights: bool = True,
    record_experts_as: bool = True,
) -> tuple[Reference, list[UnitTiming]]:
    """Run the source weights unit by unit over `prompts` at tp 1 (fixed decode tokens, drafts).

    record_weights: for a published (fp8) source, also record the sha256 of every tp-1 weight in the file's
                    provenance (weight_digests.of_source: one more read of the whole source), and of the
                    routed experts converted to fp8 (record_experts_as), so that verify compares the weights no
                    prompt reaches
    -> (the reference, as compute_reference's; per unit the seconds spent reading, transferring, computing)
    """
    src = Path(src)
    if parallel.is_distributed():
        raise VerifyInputError("the streamed reference runs at tp 1, before joining a process group")
    say = say or (lambda _msg: None)
    args = load_model_args(src / "config.json")
    inputs: list[ModelInput] = [model_input(p, args) for p in prompts]
    _long_enough([p.origin or p.label for p in prompts], inputs, args, "")
    seq = pick_max_seq_len(
        [len(i.input_ids) for i in inputs], n_decode, max_seq_len, draft_block(args), args.max_positions
    )
    args = args.with_runtime(max_batch_size=1, max_seq_len=seq, temperature=0.0)
    require_caches_fit(args, device, src / "config.json", shortest_drafted(args))
    require_prompts_fit(args, device, prompt_lengths(prompts, inputs))
    decode = [fixed_decode_ids(p, n_decode) for p in prompts]
    streamed = [StreamPrompt(i.input_ids, d, i.token_types, i.images) for i, d in zip(inputs, decode, strict=True)]
    say(f"reference: {src} layer by layer (tp 1, {len(prompts)} prompts, {n_decode} decode steps)")
    replay = rank_file_tp(src) is not None
    weights = RankWeights(src) if replay else SourceWeights(src)  # a rank file missing is named here
    tokenizer = src / "tokenizer.json"
    digests, weights_as = None, None
    try:
        if replay:
            _check_manifest(src, progress, say)
            fit_merged(weights.ranks, args)  # what no prompt reads is judged too
        results, timings = run_streamed(args, weights, streamed, tokenizer, capture_hidden, device, progress)
        if record_weights and isinstance(weights, SourceWeights) and weights.source_format == "fp8":
            experts = source_experts(src)
            weights_as = weight_digests.weights_as_other(src, experts) if record_experts_as else None
            say(
                f"weights: the sha256 of every tensor of {src} as the reference ran it"
                + (f", and of the routed experts as {weights_as.plan.expert_dtype}" if weights_as else "")
            )
            found, as_other = weight_digests.of_source(weights, progress, weights_as)
            digests = weight_digests.record([found], experts, as_other)
    finally:
        weights.close()
        if weights_as is not None:
            weights_as.close()
    runs = _prompt_runs(results, decode)
    source_format = weights.source_format
    recorded = _recorded(device)  # what decides bit equality, as the whole-model reference records it
    weights_kind = "converted" if source_format == "fp8" else "bf16"
    ref = Reference(
        inputs, runs, [p.label for p in prompts], seq, source_format, device, weights=weights_kind, **recorded
    )
    ref.provenance = provenance.record(src, args, digests)
    return ref, timings


def _check_manifest(folder: Path, progress: Progress | None, say: Callable[[str], None]) -> None:
    """A folder of rank files with a manifest.json is replayed only as that manifest records it: the file's
    provenance names the rank files by the manifest's sha256, so bytes changed since (a damaged copy, an
    edit) would be recorded as the conversion they are not. Without a manifest nothing is claimed ("")."""
    if not (folder / MANIFEST).is_file():
        return
    say(f"manifest: every file's size and sha256 against {folder / MANIFEST}")
    problems = check_folder(folder, progress=progress).problems
    if problems:
        raise VerifyInputError(
            f"{folder}: not the conversion its {MANIFEST} records ({first_few(problems, 2)}): the reference would "
            f"replay other bytes than it names; `dsv41-convert check {folder}` lists every file, `shard ... "
            "--resume` writes again each rank file that does not match"
        )


def replay_streamed(
    ranks: RankFiles, ref: Reference, device: str = "cpu", progress: Progress | None = None, ref_name: str = ""
) -> list[PromptRun]:
    """verify's tp-1 replay one unit at a time: every prompt of the tp-1 reference `ref` through `ranks`
    merged back to tp 1 per unit (RankWeights over them), the decode steps fed the reference's decode_ids,
    so a correct conversion gives the reference's every logit bit for bit (as verify.replay's whole merged
    model would) while one unit is held, not the model. Raises ShardConsistencyError where the rank files
    do not merge, VerifyInputError for a prompt or record the streamed model cannot run (naming `ref_name`, the
    file, where given)."""
    args = ranks.args.with_runtime(max_batch_size=1, max_seq_len=ref.max_seq_len, temperature=0.0)
    inputs = [attach_images(inp, args) for inp in ref.inputs]
    where = f"{ref_name}: " if ref_name else ""
    labels = [f"{where}prompt {label}" if where else label for label in ref.labels]
    _long_enough(labels, inputs, args, " (--stream-layers; verify without it runs any length)")
    fit_merged(ranks, args)
    decode = []
    for label, run in zip(ref.labels, ref.runs, strict=True):
        if ref.n_decode and run.decode_ids.numel() < ref.n_decode + 1:
            raise VerifyInputError(
                f"{where}prompt {label}: the reference records {run.decode_ids.numel()} decode tokens for "
                f"{ref.n_decode} decode steps: the streamed replay feeds the reference's tokens; verify without "
                "--stream-layers"
            )
        decode.append(run.decode_ids[: ref.n_decode + 1] if ref.n_decode else torch.zeros(1, dtype=torch.int64))
    streamed = [StreamPrompt(i.input_ids, d, i.token_types, i.images) for i, d in zip(inputs, decode, strict=True)]
    capture = any(r.hidden for r in ref.runs)
    weights = RankWeights.over(ranks)
    require_caches_fit(args, device, ranks.folder / "config.json", shortest_drafted(args))
    results, _ = run_streamed(args, weights, streamed, ranks.folder / "tokenizer.json", capture, device, progress)
    return _prompt_runs(results, [r.decode_ids for r in ref.runs])


def fit_merged(ranks: RankFiles, args: ModelArgs) -> None:
    """The strict load of the whole replay, without a weight in memory: every tensor the rank files merge
    into (headers only, convert.unshard.merge_of) against the tp-1 model built on the meta device, names,
    dtypes and shapes (model.load.check_header), so that a tensor the streamed run never asks for (an extra
    one, an expert no prompt routes to) is judged as the whole replay's load would judge it. Raises
    ShardConsistencyError (the headers do not merge) or PlanError (naming what does not fit)."""
    from types import SimpleNamespace

    from dsv41_convert.convert.rules import rule_of
    from dsv41_convert.convert.unshard import merge_of
    from dsv41_convert.model.load import check_header
    from dsv41_convert.model.transformer import Transformer

    # a name no rule knows has no merge: it is judged as the rank files hold it ("in the shard but not in the
    # model", a FAIL as in the whole replay's load; it was an input error naming no file: an audit)
    merged = {name: merge_of(ranks, name) if rule_of(name) else _as_held(ranks, name) for name in ranks.names()}
    tokenizer = ranks.folder / "tokenizer.json" if args.engram_layer_ids else None
    with torch.device("meta"):
        model = Transformer(args, tokenizer)
    check_header(model, SimpleNamespace(tensors=merged, path=f"{ranks.folder} (its rank files merged to tp 1)"))


def _as_held(ranks: RankFiles, name: str):
    """The header entry of the first rank file holding `name`."""
    return next(h.tensors[name] for h in ranks.headers if name in h.tensors)


def _prompt_runs(results: list[StreamResult], decode: list[torch.Tensor]) -> list[PromptRun]:
    return [
        PromptRun(r.logits_all, d, r.decode_logits, r.draft_logits, r.hidden, r.last, r.draft_confidence)
        for r, d in zip(results, decode, strict=True)
    ]


def _long_enough(labels: list[str], inputs: list[ModelInput], args: ModelArgs, why: str) -> None:
    """VerifyInputError naming the first prompt shorter than the largest compress ratio: its prefill would
    publish no index keys, so it cannot be streamed (the streamed model refuses it without naming it)."""
    ratio = max(args.compress_ratios[: args.n_layers], default=0)
    for label, inp in zip(labels, inputs, strict=True):
        if inp.input_ids.numel() < ratio:
            raise VerifyInputError(
                f"{label}: a {inp.input_ids.numel()}-token prompt: streaming needs {ratio} tokens (the largest "
                f"compress ratio){why}"
            )
