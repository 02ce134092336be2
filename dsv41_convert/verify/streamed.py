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

from dsv41_convert.config import load_model_args
from dsv41_convert.errors import VerifyInputError, first_few
from dsv41_convert.model import parallel
from dsv41_convert.model.streamed import StreamPrompt, UnitTiming, run_streamed
from dsv41_convert.progress import Progress
from dsv41_convert.store.manifest import MANIFEST
from dsv41_convert.store.manifest_check import check_folder
from dsv41_convert.verify import provenance, weight_digests
from dsv41_convert.verify.prompts import Prompt
from dsv41_convert.verify.rank_weights import RankWeights, rank_file_tp
from dsv41_convert.verify.reference import _recorded, pick_max_seq_len
from dsv41_convert.verify.reffile import Reference
from dsv41_convert.verify.runner import ModelInput, PromptRun, draft_block, model_input
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
    ratio = max(args.compress_ratios[: args.n_layers], default=0)
    for p, inp in zip(prompts, inputs, strict=True):
        if inp.input_ids.numel() < ratio:  # the streamed model refuses it too, without naming the line
            raise VerifyInputError(
                f"{p.origin or p.label}: a {inp.input_ids.numel()}-token prompt: streaming needs {ratio} tokens "
                "(the largest compress ratio)"
            )
    seq = pick_max_seq_len([len(i.input_ids) for i in inputs], n_decode, max_seq_len, draft_block(args))
    args = args.with_runtime(max_batch_size=1, max_seq_len=seq, temperature=0.0)
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
    runs = [
        PromptRun(r.logits_all, d, r.decode_logits, r.draft_logits, r.hidden, r.last, r.draft_confidence)
        for r, d in zip(results, decode, strict=True)
    ]
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
