"""The per-rank body of verify: load this rank's shard into the bundled model and run the prompts.

Runs inside a process group set up by verify.launch (or with none at tp 1). A shard that does not
fit the model (a missing tensor, a wrong dtype or shape) is a verification failure, not a crash: the
ranks exchange their load errors before any collective of the forward pass, so all of them stop
together and rank 0 returns every rank's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dsv41_convert.config import load_model_args
from dsv41_convert.errors import HeaderError, PlanError
from dsv41_convert.model import parallel
from dsv41_convert.model.load import load_shards
from dsv41_convert.model.warm import warm_up_kernels
from dsv41_convert.progress import counting
from dsv41_convert.verify.launch import told_each
from dsv41_convert.verify.runner import ModelInput, PromptRun, attach_images, build_model, load_state, run_prompt
from dsv41_convert.verify.twin import rank_state


@dataclass
class RankJob:
    folder: str
    max_seq_len: int
    inputs: list[ModelInput]
    teachers: list[torch.Tensor]  # per prompt, decode_ids [T + 1] of the reference
    n_decode: int
    device: str
    capture_hidden: bool = True
    twin: dict[str, torch.Tensor] | None = None  # the converter's expected tp-1 output (verify.twin)


@dataclass
class LoadFailure:
    messages: list[tuple[int, str]]  # (rank, message)


@dataclass
class RankResult:
    runs: list[PromptRun]  # the converted files
    twin_runs: list[PromptRun] | None  # the twin, same ranks, same order of everything
    compile_seconds: float = 0.0  # kernel warm-up before the first forward pass (CUDA)
    twin_weights: list[str] | None = None  # every rank's tensors whose bytes are not the twin's (with a twin)


def run_converted(job: RankJob) -> RankResult | LoadFailure:
    """Build the model for this rank, check that model{rank}-mp{world}.safetensors loads on every rank,
    then run every prompt on the twin (when given) and on the shard."""
    folder = Path(job.folder)
    args = load_model_args(folder / "config.json").with_runtime(
        max_batch_size=1, max_seq_len=job.max_seq_len, temperature=0.0
    )
    model = build_model(args, folder, "cpu", runs_on=job.device)
    error = _try_load(model, folder)
    errors = [error]
    if parallel.is_distributed():
        errors = [None] * parallel.world_size()
        torch.distributed.all_gather_object(errors, error)
    if any(errors):
        return LoadFailure([(r, e) for r, e in enumerate(errors) if e])
    twin_runs, twin_weights, compile_seconds = None, None, [0.0]
    if job.twin is not None:
        want = rank_state(model, job.twin, parallel.rank(), parallel.world_size())
        load_state(model, want)
        twin_runs = _run_all(model, job, args, compile_seconds, counting("prompts, on the twin", "prompts"))
        load_shards(model, folder)  # loaded cleanly above, so it loads again
        twin_weights = _gathered(differing_weights(model, want))
    runs = _run_all(model, job, args, compile_seconds, counting("prompts", "prompts"))
    return RankResult(runs, twin_runs, compile_seconds[0], twin_weights)


def differing_weights(model, want: dict[str, torch.Tensor]) -> list[str]:
    """The model's tensors (as loaded from this rank's file) whose bytes differ from `want` (this rank's cut
    of the converter's expected output, in file dtypes: bf16 is widened as the load widens it, exactly),
    one line each naming the rank. Every weight, whether a prompt reaches it or not."""
    from dsv41_convert.model.load import expected_tensors

    out = []
    for name, (p, _owner) in expected_tensors(model).items():
        w = want[name] if want[name].dtype == p.dtype else want[name].to(p.dtype)
        got, exp = p.detach().contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)
        if not torch.equal(got, exp):
            n = int((got != exp).sum())
            out.append(f"{name} on rank {parallel.rank()}: {n} of {got.numel()} bytes differ")
    return out


def _gathered(lines: list[str]) -> list[str]:
    """Every rank's `lines`, in rank order (this rank's alone without a process group)."""
    if not parallel.is_distributed():
        return lines
    every: list[list[str] | None] = [None] * parallel.world_size()
    torch.distributed.all_gather_object(every, lines)
    return [line for part in every for line in part or ()]


def _try_load(model, folder: Path) -> str:
    """'' when this rank's shard loads, else the loader's message (it names the tensors)."""
    try:
        load_shards(model, folder)
    except (PlanError, HeaderError) as exc:
        return str(exc)
    return ""


def _run_all(model, job: RankJob, args, compile_seconds: list[float], label: str) -> list[PromptRun]:
    """Every prompt on `job.device`, told under `label` (launch.told_each); the first call on CUDA compiles every
    kernel family first (all ranks together, before any collective of a forward pass) and adds their time
    to compile_seconds[0]."""
    if job.device != "cpu":
        model = model.to(job.device)
        if not compile_seconds[0]:
            compile_seconds[0] += warm_up_kernels(model, job.device)["seconds"]
    runs = []
    for inp, teacher in told_each(label, list(zip(job.inputs, job.teachers, strict=True))):
        inp = attach_images(inp, args)
        runs.append(run_prompt(model, inp, job.n_decode, teacher, job.capture_hidden, job.device))
    if job.device != "cpu":
        model.to("cpu")  # the next load reads into CPU parameters
    return runs
