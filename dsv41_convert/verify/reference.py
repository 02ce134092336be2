"""Reference outputs from the source checkpoint: the bundled model at tp 1 on the source weights,
transformed in memory (verify.source), no files written.

Runs in the calling process with no process group (tp 1). Used by `verify --reference SRC` and by
`reference-logits SRC OUT`, which saves the same outputs to a file (verify.reffile) so that a
pipeline can compute them once on a big machine.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.errors import VerifyInputError
from dsv41_convert.model import parallel
from dsv41_convert.verify.prompts import Prompt, default_prompts, load_prompts
from dsv41_convert.verify.reffile import Reference
from dsv41_convert.verify.runner import build_model, load_state, model_input, run_prompt
from dsv41_convert.verify.source import reference_state

DEFAULT_DECODE_STEPS = 3
SEQ_ALIGN = 64


def pick_max_seq_len(prompt_lengths: list[int], n_decode: int, requested: int | None) -> int:
    """The runtime max_seq_len both sides are built with (it sizes caches and decides whether YaRN
    is active, so reference and converted must agree): the request, or the longest prompt plus the
    decode steps rounded up to 64, at least 128."""
    need = max(prompt_lengths) + n_decode + 1
    if requested is not None:
        if requested < need:
            raise VerifyInputError(f"--max-seq-len {requested}: the longest prompt plus decode steps needs {need}")
        return requested
    return max(128, -(-need // SEQ_ALIGN) * SEQ_ALIGN)


def read_prompts(prompts_file: Path | None, tokenizer_json: Path | None, args: ModelArgs) -> list[Prompt]:
    if prompts_file is None:
        return default_prompts(args.vocab_size)
    return load_prompts(prompts_file, tokenizer_json, args.vocab_size)


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
) -> SourceReference:
    """Run the source weights through the model at tp 1 over `prompts` (greedy decode, drafts)."""
    src = Path(src)
    if parallel.is_distributed():
        raise VerifyInputError("the tp-1 reference must be computed before joining a process group")
    say = progress or (lambda _msg: None)
    args = load_model_args(src / "config.json")
    inputs = [model_input(p, args) for p in prompts]
    seq = pick_max_seq_len([len(i.input_ids) for i in inputs], n_decode, max_seq_len)
    args = args.with_runtime(max_batch_size=1, max_seq_len=seq, temperature=0.0)
    say(f"reference: transforming {src} in memory (tp 1)")
    source_format, state = reference_state(src)
    tokenizer = src / "tokenizer.json"
    model = build_model(args, tokenizer if tokenizer.exists() else None, "cpu")
    load_state(model, state)
    if device != "cpu":
        model = model.to(device)
    runs = []
    for i, inp in enumerate(inputs):
        say(f"reference: prompt {i + 1}/{len(inputs)} ({len(inp.input_ids)} tokens, {n_decode} decode steps)")
        runs.append(run_prompt(model, inp, n_decode, None, capture_hidden, device))
    del model
    gc.collect()
    ref = Reference(inputs, runs, [p.label for p in prompts], seq, source_format, device)
    return SourceReference(ref, args, state)
