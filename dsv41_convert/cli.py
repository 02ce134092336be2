"""The `dsv41-convert` command line. Commands parse, call the library and report, nothing more.

Exit codes: 0 success, 1 verification ran and found a mismatch, 2 usage or input error,
3 verification inconclusive (only statistical bounds applied; see `verify --help`).
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m dsv41_convert.cli` (torchrun's form): this module loaded under its own
    # name with Ctrl-C at its default, as the console script loads it (console.py), and run from there
    import importlib

    from dsv41_convert.interrupts import default_sigint

    with default_sigint():
        _cli = importlib.import_module(__spec__.name)
    _cli.entry()
    raise SystemExit

import atexit
import contextlib
import functools
import inspect
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from dsv41_convert import interrupts, torchrun
from dsv41_convert.app import help_width, report
from dsv41_convert.app import options as opts
from dsv41_convert.errors import ConvertError, RankFailedError, crash_line
from dsv41_convert.numbers import counted
from dsv41_convert.store.machine import MAX_THREADS

app = typer.Typer(
    name="dsv41-convert",
    help="Convert, quantize, shard and verify DeepSeek V4.1 checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_debug = {"on": False}
INTERRUPTED = 130
TERMINATED = 143  # 128 + SIGTERM, as a shell reports a process the signal ended
_stopped_by: list[str] = []  # set by _sigterm_as_interrupt: what stopped the run, for its last message


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for input errors.")) -> None:
    _debug["on"] = debug


# --- commands: make-tiny ---
# imports for this section only (the lead may hoist them to the top)


@app.command("make-tiny")
def make_tiny(
    out: opts.OutArg,
    seed: opts.SeedOpt = 0,
    source_dtype: opts.SourceDtypeOpt = "fp8",
    vision: opts.VisionOpt = True,
    shards: opts.LayerShardsOpt = None,
    preset: opts.PresetOpt = "tiny",
    overwrite: opts.OverwriteOpt = False,
    sparse: Annotated[
        bool,
        typer.Option(
            "--sparse", help="With --preset full: the published layout as sparse files that read as zeros (~20 MB)."
        ),
    ] = False,
    as_json: opts.JsonOpt = False,
) -> None:
    """Write a Hugging Face-format DeepSeek V4.1 checkpoint with random weights, laid out like the published one.

    `--preset full --sparse` writes the published V4.1-Flash layout at full size (real config, 48 shards,
    96,085 tensors, 510 GB apparent) as holes that read as zeros, plus a 129,280-id tokenizer.json, to
    test a pipeline at real size without downloading.

    Examples:
      dsv41-convert make-tiny /tmp/tiny
      dsv41-convert make-tiny /tmp/tiny-bf16 --source-dtype bf16 --seed 1
      dsv41-convert make-tiny /tmp/medium --preset medium --no-vision --shards 2
      dsv41-convert make-tiny /tmp/v41-hollow --preset full --sparse
    """
    from dsv41_convert.errors import ConfigError
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import check_checkpoint, write_checkpoint

    if preset == "full" or sparse:
        if not (preset == "full" and sparse):
            raise ConfigError("--preset full goes with --sparse (and --sparse only with --preset full)")
        if source_dtype != "fp8" or not vision or shards is not None or seed != 0:
            raise ConfigError(
                "--preset full --sparse writes the published layout with no weights (holes that read as zeros): "
                "no --source-dtype bf16, --no-vision, --shards or --seed"
            )
        from dsv41_convert.synth.hollow import write_hollow
        from dsv41_convert.synth.staged import refuse_out

        refuse_out(out, overwrite)  # before the progress's title (and the tokenizer's seconds); again under the lock
        with report.byte_progress(f"make-tiny full --sparse -> {out}", quiet=as_json) as progress:
            summary = write_hollow(out, overwrite=overwrite, progress=progress)
        if as_json:
            return report.print_json(summary)
        apparent = sum(f["bytes"] for f in summary["files"])  # the shards' sizes, headers included
        report.info(
            f"wrote {len(summary['files'])} sparse shards, {summary['n_tensors']} tensors, {apparent:,} bytes "
            f"apparent ({summary['total_size']:,} of tensors), {summary['disk_bytes'] / 2**20:.1f} MiB on disk to {out}"
        )
        return report.line(summary["out"])
    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r}: expected one of {sorted(PRESETS)} or full (with --sparse)")
    if source_dtype not in ("fp8", "bf16"):
        raise ConfigError(f"--source-dtype {source_dtype!r}: expected fp8 or bf16")
    quantized = source_dtype == "fp8"
    # refused before the progress's title; write_checkpoint checks again, OUT under its lock
    check_checkpoint(out, PRESETS[preset], quantized=quantized, vision=vision, layer_shards=shards, overwrite=overwrite)
    with report.byte_progress(f"make-tiny {preset} -> {out}", quiet=as_json) as progress:
        summary = write_checkpoint(
            out,
            PRESETS[preset],
            seed=seed,
            quantized=quantized,
            vision=vision,
            layer_shards=shards,
            overwrite=overwrite,
            progress=progress,
        )
    if as_json:
        report.print_json(summary)
    else:
        report.info(
            f"wrote {len(summary['files'])} shards, {summary['n_tensors']} tensors, "
            f"{summary['total_size'] / 2**20:.1f} MiB to {summary['out']}"
        )
        report.line(summary["out"])


# --- commands: plan, shard ---


def _local_source(src: Path, tp: int | None = None) -> Path:
    """SRC as a folder: an existing path as is; a Hub repo id (owner/name[@rev]) is downloaded and verified
    first, after its config.json alone has shown that the model can run at `tp` (when one is given)."""
    if src.exists():
        return src
    from dsv41_convert.config import load_model_args
    from dsv41_convert.convert.tp import check_tp
    from dsv41_convert.hub.download import download_command, resolve_source, source_repo_ref

    repo_id, revision = source_repo_ref(src)  # neither a folder nor a repo id: said before a download starts
    if torchrun.shared_rank() is not None:
        from dsv41_convert.errors import DownloadError

        raise DownloadError(
            f"{src}: a Hub repo id as SRC under torchrun: every process would download and hash the whole "
            f"checkpoint; download it once first (`{download_command(repo_id, revision, '--local-dir', 'DIR')}`), "
            "then give DIR as SRC"
        )

    def runs_at_tp(config: Path) -> None:
        check_tp(load_model_args(config), tp, f"{src}: {config.name}")

    with report.byte_progress(f"download {src}") as progress:
        return resolve_source(str(src), progress=progress, check_config=runs_at_tp if tp is not None else None)


WithHeadersOpt = Annotated[
    bool,
    typer.Option(
        "--with-headers",
        help="With --json: also each rank's raw safetensors header (hex) and every field of every tensor "
        "(what ConversionPlan.from_dict reads; ~120 MB for the real checkpoint).",
    ),
]


@app.command("plan")
def plan_cmd(
    src: opts.SrcArg,
    tp: opts.TpOpt = 1,
    expert_dtype: opts.ExpertDtypeOpt = "fp4",
    as_json: opts.JsonOpt = False,
    with_headers: WithHeadersOpt = False,
) -> None:
    """Read headers and index only, validate, and show each rank file: tensors, bytes, rules.

    --json: per rank its file, tensor count and bytes; per tensor its name, dtype, shape, rule, action
    and source reads (compact JSON, one document).

    Examples:
      dsv41-convert plan ./DeepSeek-V4.1-Flash --tp 8
      dsv41-convert plan ./ckpt --tp 4 --expert-dtype fp8 --json > plan.json
      dsv41-convert plan ./ckpt --tp 4 --json --with-headers > plan-full.json
    """
    from dsv41_convert.config import load_model_args
    from dsv41_convert.convert.memory import memory_figures
    from dsv41_convert.convert.plan import build_plan, collector_paused, summarize
    from dsv41_convert.errors import PlanError

    if with_headers and not as_json:
        raise PlanError("--with-headers goes with --json")
    folder = _local_source(src, tp)
    with collector_paused():  # the real plan's ~500k objects, none in a cycle: ~0.15 s of collector passes
        plan = build_plan(folder, tp, expert_dtype)
        _warn_of_unpublished_settings(folder / "config.json")
        memory = memory_figures(plan, load_model_args(folder / "config.json"))
        if as_json:
            if with_headers:
                return report.print_json(plan.to_dict(True) | {"memory": memory}, compact=True)
            return report.write_json_pieces(plan.json_pieces(extra={"memory": memory}))
        _plan_table(summarize(plan))
        _memory_table(memory)


def _memory_table(memory: dict) -> None:
    """Per rank what running the converted model in verify holds, and what the streamed reference needs."""
    from rich.table import Table

    big = max(r["total"] for r in memory["verify"]) >= 2**30
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    gib = lambda n: f"{n / scale:,.2f}"
    p = memory["prompts"]
    table = Table(title=f"memory ({unit}), verify's default prompts: {p['count']} x {p['tokens']} tokens, "
                  f"{p['decode_steps']} decode steps")  # fmt: skip
    for col in ("rank", "weights", "caches", "working", "total"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in memory["verify"]:
        table.add_row(str(r["rank"]), gib(r["weights"]), gib(r["caches"]), gib(r["working"]), gib(r["total"]))
    s = memory["streamed"]
    table.add_row(
        "streamed", f"{gib(s['unit'])} ({s['largest_unit']})", gib(s["caches"]), gib(s["working"]), gib(s["peak"])
    )
    report.tables(table)


def _plan_table(summary: dict) -> None:
    """Per output file (a rank's for plan and shard, a shard's for export): file, tensors, bytes; then how many
    tensors each rule and action made in each."""
    from rich.markup import escape
    from rich.table import Table

    if "tp" in summary:
        rows, unit = [(str(r["rank"]), r) for r in summary["files"]], "rank"
        title = f"{summary['src']}  tp {summary['tp']}  experts {summary['expert_dtype']}"
    else:
        rows, unit = [(str(i + 1), r) for i, r in enumerate(summary["files"])], "shard"
        title = f"{summary['src']}  export --format {summary['format']}"
    files = Table(title=escape(title))  # a folder named `x[b]y` printed as `xy` (markup)
    for col in (unit, "file", "tensors", "bytes"):
        files.add_column(col, justify="left", overflow="fold") if col == "file" else files.add_column(
            col, justify="right", no_wrap=True
        )
    for key, r in rows:
        files.add_row(key, r["file"], str(r["n_tensors"]), f"{r['bytes']:,}")
    files.add_row("", "total", str(sum(r["n_tensors"] for _, r in rows)), f"{summary['total_bytes']:,}")
    rules = Table(title=escape(f"tensors per rule [action], per {unit}"))
    rules.add_column(escape("rule [action]"), overflow="fold")
    for key, _ in rows:
        rules.add_column(key, justify="right", no_wrap=True)
    for name in sorted({k for _, r in rows for k in r["rules"]}):
        rules.add_row(escape(name), *(str(r["rules"].get(name, 0)) for _, r in rows))
    report.tables(files, rules)


@app.command("shard")
def shard_cmd(
    src: opts.SrcArg,
    out: opts.OutArg,
    tp: opts.TpOpt = 1,
    expert_dtype: opts.ExpertDtypeOpt = "fp4",
    workers: opts.WorkersOpt = "auto",  # parse_workers: 0, picked by execute()
    ranks: opts.RanksOpt = None,
    resume: opts.ResumeOpt = False,
    overwrite: opts.OverwriteOpt = False,
    device: opts.DeviceOpt = "cpu",
    dry_run: opts.DryRunOpt = False,
    direct_io: opts.DirectIoOpt = True,
    as_json: opts.JsonOpt = False,
) -> None:
    """Write model{r}-mp{N}.safetensors for every rank r, the tokenizer, config.json and manifest.json.

    Examples:
      dsv41-convert shard ./DeepSeek-V4.1-Flash ./mp8 --tp 8 --workers 4
      dsv41-convert shard ./ckpt ./mp4 --tp 4 --expert-dtype fp8 --ranks 0,1
      dsv41-convert shard ./ckpt ./mp4 --tp 4 --resume
      torchrun --nproc-per-node 8 -m dsv41_convert.cli shard ./ckpt ./mp8 --tp 8
    """
    from dsv41_convert.convert.execute import check_destination, check_out, execute
    from dsv41_convert.convert.plan import build_plan, summarize
    from dsv41_convert.errors import PlanError

    try:
        rank_list = [opts.ascii_int(r) for r in ranks.split(",")] if ranks is not None else None
    except ValueError as exc:
        raise PlanError(f"--ranks {ranks!r}: expected comma-separated integers in the digits 0-9, like 0,3") from exc
    plan = build_plan(_local_source(src, tp), tp, expert_dtype)
    says_once = torchrun.says_the_common_lines()
    if says_once:
        _warn_of_the_source(Path(plan.src), out)
    if dry_run:
        mine = {f.rank for f in check_destination(plan, out, resume, overwrite, rank_list, device=device)}
    else:
        mine = check_out(plan, out, resume, overwrite, rank_list, device)  # refused before the progress's title
    _warn_of_a_share_without_torchrun("rank files" if rank_list is None else "--ranks rank files", rank_list is None)
    if dry_run:  # a dry run's listing is of one share too: the warning above is said before it
        summary = summarize(plan, mine)  # what this run would write
        return report.print_json(summary) if as_json else _plan_table(summary)
    # a share of no file shows no progress (its title and an empty bar came before "no files in this share")
    with report.byte_progress(f"shard {src} -> {out} (tp {tp})", quiet=as_json or not mine) as progress:
        summary = execute(
            plan, out, workers=workers, ranks=rank_list, resume=resume, overwrite=overwrite, device=device,
            progress=progress, direct_io=direct_io,
        )  # fmt: skip
    _report_run(summary, as_json, "file", summary["manifest"] or "pending (not every rank is done yet)")
    if as_json:
        return
    if summary.get("fragment"):  # kept until manifest.json is written (a share gathered elsewhere needs it)
        finish = (
            "the process of this launch that finishes last writes manifest.json and removes it"
            if rank_list is None and torchrun.on_one_host()  # every share writes into this OUT
            else "in one folder, the share that finishes last writes manifest.json and removes it; gathered "
            "from several machines, `dsv41-convert manifest OUT` does"
        )
        report.info(f"fragment: {summary['fragment']} ({finish})")
    if says_once:  # the result, for a script (`MP=$(dsv41-convert shard ...)`), as export prints it
        report.line(summary["out"])


def _warn_of_a_share_without_torchrun(files: str, advise_ranks: bool) -> None:
    """A warning where RANK and WORLD_SIZE give this process a share but torchrun's rendezvous variables are
    missing: variables left in the environment, not a launch, most likely (the run still writes its share).
    files: what is shared out ("rank files", "shards", or "--ranks rank files": a --ranks list given, which
    the variables share out in turn). advise_ranks: --ranks is the way to a share (shard without it; export
    has none: advised there, it was a usage error)."""
    missing = torchrun.lacks_rendezvous()
    if missing:
        rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
        report.warn(
            f"RANK={rank} and WORLD_SIZE={world} are set without {' and '.join(missing)} (torchrun sets all of "
            f"them): this process writes share {rank} of {world} of the {files} only; unset RANK and WORLD_SIZE "
            f"to write them all{', or use --ranks for a share' if advise_ranks else ''}"
        )


def _warn_of_the_source(src: Path, out: Path) -> None:
    """shard's and export's warnings about SRC (a dry run's too): settings unlike the published ones, no
    tokenizer.json. Said by one process of a torchrun launch (torchrun.says_the_common_lines)."""
    _warn_of_unpublished_settings(src / "config.json")
    _warn_without_tokenizer(src, f"so {out} will have none either")


def _warn_of_unpublished_settings(config: Path) -> None:
    """A warning where `config` describes the published V4.1-Flash tensors with other settings (`published.
    settings_unlike_published`): nothing refuses them, and verify compares source and conversion under this one
    config, so an edited sliding_window or rope beta ran, exit 0, as another model than the published one.
    Each setting is named by its key in `config` (rank files' inference config: `window_size`, not
    `text_config.sliding_window`)."""
    from dsv41_convert.config import HF_NAMES, is_hf_config, load_json, model_args_of
    from dsv41_convert.published import settings_unlike_published

    data = load_json(config)
    unlike = settings_unlike_published(model_args_of(data, config), HF_NAMES if is_hf_config(data) else {})
    if unlike:
        report.warn(
            f"{config}: the published V4.1-Flash tensors with other settings: {'; '.join(unlike)}. No tensor shows "
            "these, so the model runs as this config says and verify cannot tell (it runs the source and the "
            "conversion under this one config): put back the published values unless the change is meant"
        )


def _warn_without_tokenizer(folder: Path, then: str) -> None:
    """A warning where `folder` (SRC of shard and export, OUT of manifest) has no tokenizer.json: the rank
    files are complete without it, but the model is not (Engram's hashes and text prompts read it). The advice
    is what lists it in OUT's manifest.json: "beside the weights", a tokenizer.json put beside the rank files
    was left unchecked by `check` and refused by `manifest` (no share recorded it)."""
    if not (folder / "tokenizer.json").is_file():
        report.warn(
            f"{folder}: no tokenizer.json, {then}; verify and inference need the checkpoint's own "
            "(Engram's hashes, text prompts): put the model's tokenizer.json in SRC and convert into OUT again "
            "with --resume (it copies it and lists it in manifest.json)"
        )


def _report_run(summary: dict, as_json: bool, noun: str, manifest: str) -> None:
    """What a writing run (shard, export) did: locks taken over (stderr), then the summary as JSON, or one
    line of counts and the files continued from an earlier run."""
    for holder in summary["took_over"]:
        report.info(f"took over the lock of a run that ended without releasing it: {holder}")
    for path in summary.get("set_aside", []):
        report.warn(f"moved {path} there from OUT: an earlier run's tokenizer file, which this source lacks")
    if as_json:
        report.print_json(summary)
        return
    if summary.get("nothing_to_write"):
        if torchrun.lacks_rendezvous():  # no launch (the share warning above): no other share runs (it said so)
            report.info(f"no {noun}s in this share, so none written: without torchrun no other share writes them")
        else:
            report.info(f"no {noun}s in this share (more processes than {noun}s): the other shares write them all")
        return
    report.info(
        f"wrote {counted(len(summary['written']), noun)}, {summary['bytes'] / 1e9:.2f} GB in "
        f"{summary['seconds']:.1f} s ({summary['gb_per_s'] or 0:.2f} GB/s), skipped {len(summary['skipped'])}; "
        f"manifest: {manifest}"
    )
    if summary.get("resumed"):
        kept = sum(summary["resumed"].values())
        report.info(
            f"continued {counted(len(summary['resumed']), 'partial file')}, {kept / 1e9:.2f} GB kept from before"
        )


# --- commands: verify, reference-logits, check, demo ---


ConvertedArg = Annotated[
    Path, typer.Argument(parser=opts.given_path, help="Folder written by `shard`: rank files, config.json, tokenizer.")
]
ReferenceOpt = Annotated[
    Path | None,
    typer.Option(
        "--reference", parser=opts.given_path, help="Source checkpoint: reference logits at tp 1, computed here."
    ),
]
ReferenceLogitsOpt = Annotated[
    Path | None,
    typer.Option(
        "--reference-logits", parser=opts.given_path, help="File written by `reference-logits` (safetensors)."
    ),
]
PromptsOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts", parser=opts.given_path, help='JSONL: {"input_ids": [...]} or {"text": "..."}, optional "image".'
    ),
]
RankTimeoutOpt = Annotated[
    int | None,
    typer.Option(
        "--rank-timeout",
        parser=opts.whole_number(1, most=86_400),
        help="Seconds a rank (--tp > 1, torchrun) waits in a collective for a peer that does not answer (hung, "
        "stopped) before the run fails naming it (default 600). Too short, a slow peer is taken for a hung one.",
    ),
]
VerifyTpOpt = Annotated[
    int | None, typer.Option("--tp", parser=opts.whole_number(1), help="Rank count (default: from the rank files).")
]
DecodeOpt = Annotated[
    int, typer.Option("--decode-steps", parser=opts.whole_number(0), help="Greedy decode steps after each prompt.")
]
VerifyDecodeOpt = Annotated[
    int | None,
    typer.Option(
        "--decode-steps",
        parser=opts.whole_number(0),
        help="With --reference SRC: greedy decode steps after each prompt (3).",
    ),
]
MaxSeqOpt = Annotated[
    int | None, typer.Option("--max-seq-len", parser=opts.whole_number(1), help="Runtime max_seq_len (default: auto).")
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option(
        "--threads", parser=opts.whole_number(1, most=MAX_THREADS), help="torch threads per process (cores / tp)."
    ),
]
AtolOpt = Annotated[
    float | None, typer.Option("--atol", parser=opts.finite_number(0), help="Max |ref - conv| logit difference (>= 0).")
]
MaxKlOpt = Annotated[
    float | None,
    typer.Option("--max-kl", parser=opts.finite_number(0), help="Max per-row KL(ref || conv), nats (>= 0)."),
]
MaxKlMeanOpt = Annotated[
    float | None, typer.Option("--max-kl-mean", parser=opts.finite_number(0), help="Max mean KL(ref || conv) (>= 0).")
]
MinTop1Opt = Annotated[
    float | None, typer.Option("--min-top1", parser=opts.finite_number(0, 1), help="Min top-1 agreement (0 to 1).")
]
MinCosOpt = Annotated[
    float | None, typer.Option("--min-cos", parser=opts.finite_number(-1, 1), help="Min per-row cosine (-1 to 1).")
]
NoLocalizeOpt = Annotated[bool, typer.Option("--no-localize", help="On failure, skip the hidden-state/tensor diff.")]
StatisticalOpt = Annotated[
    bool,
    typer.Option(
        "--statistical", help="Accept statistical bounds (--max-kl, --min-top1, ...) as PASS where no check is exact."
    ),
]
NoReplayOpt = Annotated[
    bool,
    typer.Option(
        "--no-replay",
        help="Do not merge the rank files back to tp 1 (it holds the whole model here); the weights check "
        "decides where the reference file records weight digests.",
    ),
]
VerifyStreamOpt = Annotated[
    bool,
    typer.Option(
        "--stream-layers",
        help="Instead of running the rank files at tp N, merge them back to tp 1 one unit at a time (embedding, "
        "each layer, each DSpark stage, head) and replay them here against a tp-1 --reference-logits FILE, bit "
        "for bit: bounded memory, for a model larger than the machine. The replicas, manifest and weights "
        "checks run as without it.",
    ),
]
RefTpOpt = Annotated[
    int, typer.Option("--tp", parser=opts.whole_number(1), help="Ranks to compute the reference on (one process each).")
]
AsConvertedOpt = Annotated[
    bool,
    typer.Option("--as-converted", help="bf16 source: run the converter's quantized output, so verify can be exact."),
]
DemoDirArg = Annotated[Path, typer.Argument(parser=opts.given_path, help="Working folder (created).")]


@app.command("verify")
def verify_cmd(
    converted: ConvertedArg,
    reference: ReferenceOpt = None,
    reference_logits: ReferenceLogitsOpt = None,
    prompts: PromptsOpt = None,
    device: opts.DeviceOpt = "cpu",
    tp: VerifyTpOpt = None,
    decode_steps: VerifyDecodeOpt = None,
    max_seq_len: MaxSeqOpt = None,
    threads: ThreadsOpt = None,
    atol: AtolOpt = None,
    max_kl: MaxKlOpt = None,
    max_kl_mean: MaxKlMeanOpt = None,
    min_top1: MinTop1Opt = None,
    min_cos: MinCosOpt = None,
    no_localize: NoLocalizeOpt = False,
    statistical: StatisticalOpt = False,
    no_replay: NoReplayOpt = False,
    stream_layers: VerifyStreamOpt = False,
    rank_timeout: RankTimeoutOpt = None,
    as_json: opts.JsonOpt = False,
) -> None:
    """Run the converted weights (one process per rank) and compare their logits with a reference.

    The reference is the source checkpoint (run here at tp 1, weights transformed in memory) or a file
    from `reference-logits`. Compared per prompt and overall: last-position and all-position logits,
    greedy decode steps, DSpark drafts. PASS needs a decisive check, bit for bit: a reference file
    computed at this tp and device; a tp-1 reference file (the rank files are also merged back to tp 1
    and replayed here); a reference file that records the digests of the weights it ran (any tp: every
    tensor compared byte for byte, "weights"); or a source (its converted output, the "twin", runs on the
    same ranks). A reference file with hidden states from this device also runs each module on the
    reference's input to it, within measured noise ("teacher": its failures fail the run, its holding is
    evidence only). Where only statistical bounds apply the verdict is INCONCLUSIVE (exit 3), unless
    --statistical. On failure, names the first diverging module and (with
    a source) the tensors that differ. Under torchrun, joins its process group.
    Exit 0 PASS, 1 FAIL (mismatch), 2 input error, 3 INCONCLUSIVE.

    Examples:
      dsv41-convert verify ./mp8 --reference ./DeepSeek-V4.1-Flash-tiny
      dsv41-convert verify ./mp8 --reference-logits ref.safetensors --json
      dsv41-convert verify ./mp8 --reference-logits ref-tp1.safetensors --stream-layers
      torchrun --nproc-per-node 8 -m dsv41_convert.cli verify ./mp8 --reference-logits ref.safetensors --device cuda
    """
    from dsv41_convert.verify.run import VerifyOptions, verify
    from dsv41_convert.verify.table import render
    from dsv41_convert.verify.verdict import EXIT_CODES

    overrides = {"atol": atol, "max_kl": max_kl, "max_kl_mean": max_kl_mean, "min_top1": min_top1, "min_cos": min_cos}
    opts = VerifyOptions(
        converted, reference, reference_logits, prompts, device, tp, decode_steps, max_seq_len, overrides,
        not no_localize, threads, statistical, replay=not no_replay, stream_layers=stream_layers,
        rank_timeout=rank_timeout,
    )  # fmt: skip
    speaks = not as_json and torchrun.shared_rank() in (None, 0)  # one process of a torchrun launch speaks
    result = verify(
        opts,
        progress=report.info if speaks else None,
        shown=report.byte_progress if speaks else None,
        warn=report.warn if torchrun.shared_rank() in (None, 0) else None,
    )
    if result is None:  # a torchrun rank other than 0
        return
    if as_json:
        report.print_json(result.to_json())
    else:
        report.tables(render(result))
    if EXIT_CODES[result.verdict]:
        raise typer.Exit(EXIT_CODES[result.verdict])


def _refuse_a_converted_file(out: Path) -> None:
    """OutputError where reference-logits' OUT is a file the manifest.json beside it lists: --overwrite replaced a
    converted rank file with the reference, and `check` and `verify` then failed the conversion (a helper's hunt;
    the warning said the manifest did not list it). A damaged manifest is left to the warning below it."""
    from dsv41_convert.errors import OutputError, VerifyInputError
    from dsv41_convert.store.manifest_check import read_manifest

    try:
        listed = out.name in read_manifest(out.parent)["files"]
    except VerifyInputError:  # no manifest (or folder) there, or a damaged one
        return
    if listed:
        raise OutputError(
            f"{out}: a file of the conversion in {out.parent} (its manifest.json lists it); a reference written "
            "there would replace it: write the reference to another path"
        )


@app.command(
    "reference-logits",
    short_help="Compute reference logits from SRC (once, on --tp ranks) and save them, with what decides bit "
    "equality, for `verify --reference-logits`.",
)
def reference_logits_cmd(
    ctx: typer.Context,
    src: opts.LocalSrcArg,
    out: Annotated[Path, typer.Argument(parser=opts.given_path, help="Output .safetensors file.")],
    prompts: PromptsOpt = None,
    device: opts.DeviceOpt = "cpu",
    tp: RefTpOpt = 1,
    as_converted: AsConvertedOpt = False,
    decode_steps: DecodeOpt = 3,
    max_seq_len: MaxSeqOpt = None,
    threads: ThreadsOpt = None,
    stream_layers: Annotated[
        bool,
        typer.Option(
            "--stream-layers",
            help="Hold one unit of weights at a time (embedding, each layer, each DSpark stage, head): bounded "
            "memory for models larger than RAM. Decode tokens are fixed before the run (the prompt file's "
            "decode_ids, else the prompt's own tokens repeated), not greedy.",
        ),
    ] = False,
    weight_digests: Annotated[
        bool,
        typer.Option(
            "--weight-digests/--no-weight-digests",
            help="Record the sha256 of every converted weight the reference runs (an fp8 source, or "
            "--as-converted), so that verify compares every weight of CONVERTED, also those no prompt reaches. "
            "With --stream-layers this reads the whole source once more.",
        ),
    ] = True,
    fp8_expert_digests: Annotated[
        bool,
        typer.Option(
            "--fp8-expert-digests/--no-fp8-expert-digests",
            help="With the weight digests of fp4 routed experts, also record each expert as `shard "
            "--expert-dtype fp8` writes it (the set for Hopper serving), so that verify compares an fp8-expert "
            "set's every expert too. Costs the cast of every expert (~3 CPU s per GB of fp4 experts).",
        ),
    ] = True,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
    rank_timeout: RankTimeoutOpt = None,
    as_json: opts.JsonOpt = False,
) -> None:
    """Compute reference logits from SRC on --tp ranks (one process each, every rank transforming only its
    own slices of SRC in memory) and save them for `verify --reference-logits`: prompts, last/all-position
    logits, decode steps, DSpark drafts, per-module hidden states, and what decides bit equality (tp,
    device, threads, torch; format: dsv41_convert/verify/reffile.py). verify at the same tp and device is
    then exact; a tp-1 file is exact at every tp (the rank files are replayed at tp 1).

    Examples:
      dsv41-convert reference-logits ./DeepSeek-V4.1-Flash ref.safetensors --device cuda
      dsv41-convert reference-logits ./DeepSeek-V4.1-Flash ref.safetensors --stream-layers --decode-steps 1
      dsv41-convert reference-logits ./tiny ref-tp8.safetensors --tp 8
      dsv41-convert reference-logits ./tiny ref.safetensors --prompts prompts.jsonl --decode-steps 5
    """
    import torch

    from dsv41_convert.config import load_model_args
    from dsv41_convert.convert.execute import check_output_file
    from dsv41_convert.store.lock import hold, refuse_held
    from dsv41_convert.store.made_folder import made_folder
    from dsv41_convert.store.manifest import remove_stale_temporaries, temporary_stem
    from dsv41_convert.store.source_stamps import require_unchanged, source_stamps
    from dsv41_convert.verify import reffile
    from dsv41_convert.verify.launch import backend_for, default_threads
    from dsv41_convert.verify.reference import compute_reference_ranks, read_prompts, records_weight_digests

    backend_for(device)
    threads = threads or default_threads(tp)
    if device == "cpu":
        torch.set_num_threads(threads)  # tp 1 runs in this process
    refuse_held(src)  # a run writing into SRC (shard into a folder of rank files, download): files not final
    args = load_model_args(src / "config.json")
    if torchrun.shared_rank() in (None, 0):
        _warn_of_unpublished_settings(src / "config.json")
    tokenizer = src / "tokenizer.json"
    prompt_list = read_prompts(prompts, tokenizer if tokenizer.exists() else None, args, stream_layers)
    from dsv41_convert.verify.run import not_run_by

    # the process that saves (rank 0 of a torchrun launch, else this one) speaks for the run
    writes = torchrun.shared_rank() in (None, 0)
    timings = None
    if stream_layers and (tp != 1 or as_converted):
        from dsv41_convert.errors import VerifyInputError

        raise VerifyInputError("--stream-layers computes the tp-1 reference: no --tp or --as-converted")
    if stream_layers and torchrun.world() not in (None, 1):  # each process would compute and save it
        from dsv41_convert.errors import VerifyInputError

        raise VerifyInputError("--stream-layers runs in one process: run it without torchrun")
    if rank_timeout is not None:  # no ranks to time out (tp 1, --stream-layers): refused, as it was ignored
        from dsv41_convert.verify.launch import check_rank_timeout

        check_rank_timeout(
            tp, stream_layers, "--tp 1" if opts.given_on_command_line(ctx, "--tp") else "--tp 1, the default"
        )
    if not stream_layers:  # a tp the model cannot run, or torchrun's other count: refused before OUT's folders
        from dsv41_convert.convert.tp import check_tp
        from dsv41_convert.verify.launch import check_world

        check_tp(args, tp, str(src / "config.json"))
        check_world(tp)
    if writes:
        _refuse_a_converted_file(out)
    inputs = ([(prompts, "the --prompts file")] if prompts is not None else []) + [
        (Path(p.image), f"the image of {p.origin or p.label}") for p in prompt_list if p.image is not None
    ]
    check_output_file(src, out, overwrite, inputs)  # before anything is created; again once OUT's folder is held
    digested = weight_digests and records_weight_digests(src, args, as_converted, stream_layers)
    for part in not_run_by(prompt_list, args) if writes else ():  # said before the compute (stderr)
        # verify compares the bytes of what the file records the digests of (a changed one fails), as its
        # report says (`no prompt runs it (its weights compared byte for byte)`); it said `cannot check it`
        checked = "compares only its weights' bytes, not what it computes" if digested else "cannot check it"
        report.warn(f"no prompt runs it, so verify against {out} {checked}: {part}")
    if stream_layers:
        from dsv41_convert.verify.streamed import unfed_decode_ids

        for said in filter(None, (unfed_decode_ids(p, decode_steps) for p in prompt_list)):
            report.warn(said)
    if writes and (out.parent / "manifest.json").is_file():
        report.warn(
            f"{out.parent} holds a manifest.json (a converted folder?): `check` will name {out.name} as a file it "
            "does not list (verify with this reference ignores it there)"
        )
    # the process that saves holds OUT's folder from the start, so a second writer is refused before minutes
    # of compute, and torchrun's ranks do not contend; the folders it made for OUT go again where nothing is
    # saved (Ctrl-C, non-finite outputs, a full disk: they stayed, empty). It alone makes them: torchrun's other
    # processes, which never write OUT, made them too, and a launch stopped in the compute left them, empty (rank 0
    # found them there and kept them as not its own: a helper's hunt)
    with (
        made_folder(out.parent) if writes else contextlib.nullcontext(),
        hold(out.parent) if writes else contextlib.nullcontext(),
    ):
        check_output_file(src, out, overwrite, inputs)  # on every rank: all stop, not rank 0 after the compute
        if writes:  # OUT.PID.partial of a run that died while saving (reffile.save's temporary), nothing else
            remove_stale_temporaries(out.parent, lambda name: name == temporary_stem(out.name))
        stamps = source_stamps(src)  # before the plan reads a header: a shard rewritten from here on is refused
        if stream_layers:
            from dsv41_convert.verify.streamed import compute_streamed_reference

            with report.byte_progress(f"reference-logits {src} --stream-layers", quiet=as_json) as progress:
                say = None if as_json else report.info
                ref, timings = compute_streamed_reference(
                    src, prompt_list, decode_steps, max_seq_len, device, True, progress, say, weight_digests,
                    fp8_expert_digests,
                )  # fmt: skip
        else:
            with report.byte_progress(f"reference-logits {src}", quiet=as_json or not writes) as progress:
                ref = compute_reference_ranks(
                    src, prompt_list, tp, decode_steps, max_seq_len, device, as_converted, threads,
                    report.info if writes else None, weight_digests, progress, fp8_expert_digests, rank_timeout,
                )  # fmt: skip
        if ref is None:  # a torchrun rank other than 0
            return
        # the fp8-expert digests read SRC again after the run (and a rank may read late): none of two versions
        require_unchanged(src, stamps, f"nothing written to {out}; run again once SRC is as it should be")
        if as_converted and ref.source_format == "fp8":
            report.info("--as-converted changes nothing here: an fp8 source holds the converted values already")
        tensors = reffile.file_tensors(ref)
        non_finite = reffile.non_finite(tensors)
        if non_finite:  # verify refuses such a file: say it here, where the source can still be named
            from dsv41_convert.errors import VerifyInputError

            raise VerifyInputError(
                f"{src}: the model computed non-finite outputs ({'; '.join(non_finite[:3])}): a NaN or Inf weight in "
                f"the source, or an overflow on these prompts (`shard` names a non-finite source tensor); "
                f"nothing written to {out}"
            )
        reffile.save(ref, out, tensors)
    summary = {
        "out": str(out),
        "prompts": len(ref.runs),
        "decode_steps": ref.n_decode,
        "max_seq_len": ref.max_seq_len,
        "source_format": ref.source_format,
        "weights": ref.weights,
        "tp": ref.tp,
        "device": ref.device,
        "threads": ref.threads,
        "bytes": out.stat().st_size,
    }
    recorded = (ref.provenance or {}).get("weights")
    summary["weight_digests"] = sum(map(len, recorded["ranks"])) if recorded else 0  # tensors, over every rank
    experts_as = (recorded or {}).get("experts_as")  # the routed experts' tensors as the other expert dtype
    summary["weight_digests_experts_as"] = {experts_as["expert_dtype"]: len(experts_as["sha256"])} if experts_as else {}
    unrecorded = {
        "--weight-digests": (recorded, "they are of converted weights: an fp8 source, or --as-converted", "no weight"),
        "--fp8-expert-digests": (
            experts_as,
            "they are of fp4 routed experts, with the weight digests",
            "no fp8 expert",
        ),
    }
    for flag, (got, why, what) in unrecorded.items():  # given and silently without effect: an audit
        if opts.given_on_command_line(ctx, flag) and not got:
            report.warn(f"{flag}: nothing recorded ({why}); verify against {out} compares {what} digests")
    if torch.device(device).type == "cuda" and tp == 1:  # this process ran the model
        summary["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    if timings is not None:
        summary["units"] = [vars(t) for t in timings]
        for key in ("read_s", "transfer_s", "compute_s", "wait_s", "bytes_read"):
            summary[key] = sum(getattr(t, key) for t in timings)
        summary["largest_unit_bytes"] = max(t.param_bytes for t in timings)
    if as_json:
        report.print_json(summary)
    else:
        report.line(str(out))
        report.info(
            f"{summary['prompts']} prompts, {summary['decode_steps']} decode steps, tp {tp} on {device}, "
            f"{summary['bytes']:,} bytes"
        )
        if timings is not None:
            report.info(
                f"streamed: read {summary['read_s']:.1f} s ({summary['bytes_read'] / 2**30:.2f} GiB), "
                f"transfer {summary['transfer_s']:.1f} s, compute {summary['compute_s']:.1f} s, "
                f"waiting for weights {summary['wait_s']:.1f} s"
            )


@app.command("check")
def check_cmd(out: opts.OutArg, workers: opts.HashWorkersOpt = "auto", as_json: opts.JsonOpt = False) -> None:
    """Check every file listed in OUT/manifest.json (size, then sha256) without running the model; several
    files at once (--workers).

    Exit 1 naming each missing, resized or corrupt file; exit 2 while a run writes into OUT, naming it, or
    where a rank file changed while it was read.

    Examples:
      dsv41-convert check ./mp8
      dsv41-convert check ./mp8 --json --workers 1
    """
    from dsv41_convert.errors import first_few
    from dsv41_convert.store.lock import refuse_held
    from dsv41_convert.store.manifest import MANIFEST
    from dsv41_convert.store.manifest_check import check_folder, read_manifest
    from dsv41_convert.store.source_stamps import require_unchanged, source_stamps

    refuse_held(out)  # a run writing into OUT (a share too): its files are not final, nor its manifest's absence
    manifest = read_manifest(out)  # no folder, no manifest or a damaged one: refused before the progress's title
    stamps = source_stamps(out)  # a run that starts writing into OUT from here on is not refused by the lock
    with report.byte_progress(f"check {out}", quiet=as_json) as progress:
        result = check_folder(out, progress=progress, threads=workers or None, manifest=manifest)
    # a rank file rewritten meanwhile (`shard --overwrite`) was named corrupt, exit 1, on a folder fine once written
    require_unchanged(out, stamps, "no verdict; check it again once the run writing into it has ended")
    for problem in result.problems:
        report.error(problem)
    if result.unchecked:
        report.warn(f"{out}: not in {MANIFEST}, so not checked: {first_few(result.unchecked)}")
    if as_json:
        report.print_json(result.to_json())
    else:
        report.line(f"{'ok' if result.ok else 'FAILED'}: {out}")
        report.info(_matched(len(result.checked), result.mismatched, result.not_listed))
    if not result.ok:
        raise typer.Exit(1)


def _matched(good: int, bad: int, not_listed: int = 0) -> str:
    """check's summary, each count with its own verb: "1 file matches the manifest, 2 do not" (it said "1 files
    match ..., 1 do not"), and the problems with what it does not list apart: a .safetensors file it leaves out
    was counted among the listed files that do not match ("6 files match the manifest, 1 does not" of 6 listed)."""
    said = f"{counted(good, 'file', ('matches', 'match'))} the manifest, {bad} {'does' if bad == 1 else 'do'} not"
    if not_listed:
        said += f"; {counted(not_listed, 'problem')} with what it does not list (named above)"
    return said


@app.command("demo")
def demo_cmd(
    folder: DemoDirArg = Path("dsv41-demo"),
    tp: opts.TpOpt = 8,
    seed: opts.SeedOpt = 0,
    overwrite: opts.DemoOverwriteOpt = False,
    threads: ThreadsOpt = None,
    as_json: opts.JsonOpt = False,
) -> None:
    """The main job on a tiny model, in about a minute: make-tiny, shard --tp 8, reference-logits (tp 1), and
    verify against that file: 8 ranks on the CPU, then the decisive check (the rank files replayed at tp 1).

    Examples:
      dsv41-convert demo
      dsv41-convert demo /tmp/demo --tp 4 --overwrite
    """
    from dsv41_convert.app.demo import run_demo
    from dsv41_convert.verify.table import render
    from dsv41_convert.verify.verdict import EXIT_CODES

    with report.byte_progress("demo", quiet=True) as progress:
        result, seconds = run_demo(
            folder, tp, seed, overwrite, step=None if as_json else report.info, progress=progress, threads=threads
        )
    if as_json:
        report.print_json(result.to_json() | {"stage_seconds": seconds})
    else:
        report.tables(render(result))
        report.info(", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()) + f"; total {sum(seconds.values()):.1f} s")
    raise typer.Exit(EXIT_CODES[result.verdict])


# --- commands: download ---
# imports for this section only (the lead may hoist them to the top)


RepoIdArg = Annotated[str, typer.Argument(help="Hub repo id: owner/name.")]
RevisionOpt = Annotated[
    str | None,
    typer.Option("--revision", parser=opts.given_revision, help="Branch, tag or commit (default: main)."),
]
LocalDirOpt = Annotated[
    Path | None, typer.Option("--local-dir", parser=opts.given_path, help="Put the files here, not in the HF cache.")
]
IncludeOpt = Annotated[list[str] | None, typer.Option("--include", help="Only files matching this glob; repeatable.")]
ExcludeOpt = Annotated[list[str] | None, typer.Option("--exclude", help="Skip files matching this glob; repeatable.")]
WorkersOpt = Annotated[
    int,
    typer.Option(
        "--max-workers",
        parser=opts.whole_number(1),
        help="Files fetched at once (and hashed: one per core, 8 at most).",
    ),
]
VerifyOnlyOpt = Annotated[
    bool,
    typer.Option(
        "--verify-only", help="No network: check the local copy against the download record (or huggingface_hub's)."
    ),
]

DownloadOverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Let --local-dir's files that are not this revision's (another revision's, your own) be replaced.",
    ),
]


@app.command("download")
def download_cmd(
    repo_id: RepoIdArg,
    revision: RevisionOpt = None,
    local_dir: LocalDirOpt = None,
    include: IncludeOpt = None,
    exclude: ExcludeOpt = None,
    max_workers: WorkersOpt = 8,
    verify_only: VerifyOnlyOpt = False,
    overwrite: DownloadOverwriteOpt = False,
    json_out: opts.JsonOpt = False,
) -> None:
    """Download a checkpoint from the Hugging Face Hub and check every file (size, sha256, headers, index).

    Files found missing or corrupt are fetched again, and only those. Without --local-dir the files go to
    the HF cache (HF_HOME); HF_TOKEN authenticates, HF_ENDPOINT picks the Hub, HF_HUB_OFFLINE=1 only checks.
    Exit 1 if a check fails, 2 on a Hub, network or disk error.

    Examples:
      dsv41-convert download deepseek-ai/DeepSeek-V4.1-Flash --local-dir ./v41
      dsv41-convert download deepseek-ai/DeepSeek-V4.1-Flash --include "*.json" --include "model-0000[1-2]*"
      dsv41-convert download deepseek-ai/DeepSeek-V4.1-Flash --local-dir ./v41 --verify-only --json
    """
    from dsv41_convert.hub import download as dl

    dl.check_repo_id(repo_id)  # before the banner
    if verify_only and overwrite:  # it writes nothing: the option was ignored, silently (an audit)
        raise typer.BadParameter("--verify-only checks the folder and writes nothing: drop --overwrite")
    # before the banner too: a refusal after it read as if the download had started
    dl.check_download(repo_id, revision=revision, local_dir=local_dir, verify_only=verify_only, overwrite=overwrite)
    patterns = {"include": include or [], "exclude": exclude or []}
    with report.byte_progress(f"{'verifying' if verify_only else 'downloading'} {repo_id}") as progress:
        if verify_only:
            result = dl.verify_local(
                repo_id, revision=revision, local_dir=local_dir, workers=max_workers, progress=progress, **patterns
            )
        else:
            result = dl.download(
                repo_id, revision=revision, local_dir=local_dir, max_workers=max_workers, progress=progress,
                overwrite=overwrite, **patterns,
            )  # fmt: skip
    for problem in result.problems:
        report.error(str(problem))
    if json_out:
        report.print_json(result.to_json())
    else:
        report.line(str(result.folder))
    verdict = "all checks passed" if result.ok else counted(len(result.problems), "problem")
    report.info(
        f"{counted(result.files, 'file')}, {result.nbytes / 1e9:.2f} GB, commit {result.commit or 'unknown'}; "
        f"fetched {len(result.fetched)}, re-fetched {len(result.refetched)}; checked {result.checks}: {verdict}"
    )
    if not result.ok:
        raise typer.Exit(1)


# --- commands: manifest (merge the fragments of ranks written on several machines) ---


@app.command("manifest")
def manifest_cmd(out: opts.OutArg, as_json: opts.JsonOpt = False) -> None:
    """Write OUT/manifest.json for rank files written on several machines and gathered into OUT.

    Each `shard --ranks` (or torchrun share) run leaves manifest-fragment-mp{N}-r{ranks}.json beside its
    rank files. Copy every rank file, fragment, config.json and tokenizer into one folder, then run this:
    it checks each rank file's and side file's (config, tokenizer) size and sha256 against the fragments and
    that all come from one plan. Exit 2 naming each missing or mismatching file.

    Examples:
      dsv41-convert manifest ./mp8
      dsv41-convert manifest ./mp8 --json
    """
    from dsv41_convert.convert.unshard import shares_agree
    from dsv41_convert.store.manifest_merge import check_mergeable, merge

    check_mergeable(out)  # refused before the progress's title; merge checks again, then under OUT's lock
    with report.byte_progress(f"manifest {out}", quiet=as_json) as progress:

        def agree(folder: Path, tp: int) -> list[str]:
            if not as_json:  # reads every rank file's replicated tensors (29 GB of the real model at tp 8)
                report.info("replicas: the tensors every rank holds, compared across the rank files")
            return shares_agree(folder, tp, progress)

        summary = merge(out, progress=progress, shares_agree=agree)
    _warn_without_tokenizer(out, "so the manifest lists none")
    if summary.get("side_files_unchecked"):
        report.warn(
            f"side files not checked against {', '.join(summary['side_files_unchecked'])}: written by an "
            "earlier version, they record rank files only"
        )
    if as_json:
        return report.print_json(summary)
    report.line(summary["manifest"])
    if summary.get("already_merged"):
        kept, removed = summary.get("export_fragments"), summary.get("fragments_removed")
        left = (
            f"{counted(len(kept), 'fragment')} of its shares kept beside it, as an export's are; none merged"
            if kept
            else f"{counted(len(removed), 'fragment')} left beside it, which it supersedes, removed"
            if removed
            else "no fragment left"
        )
        report.info(
            f"already written by the run of these files (or by its share that finished last; {left}); "
            "every file it lists checked against it (size and sha256)"
        )
        return
    report.info(
        f"{counted(len(summary['rank_files']), 'rank file')} checked from "
        f"{counted(len(summary['fragments']), 'fragment')}"
        + (", which manifest.json supersedes: removed" if summary.get("fragments_removed") else "")
    )


# --- commands: export (Hugging Face-format checkpoints in another weight format) ---


@app.command("export")
def export_cmd(
    src: opts.SrcArg,
    out: opts.OutArg,
    fmt: opts.FormatOpt,
    workers: opts.WorkersOpt = "auto",  # parse_workers: 0, picked by execute()
    resume: opts.ResumeOpt = False,
    overwrite: opts.OverwriteOpt = False,
    device: opts.DeviceOpt = "cpu",
    dry_run: opts.DryRunOpt = False,
    direct_io: opts.DirectIoOpt = True,
    as_json: opts.JsonOpt = False,
) -> None:
    """Write a Hugging Face-format checkpoint shaped like SRC (same names and shard grouping) in another format.

    bf16: every quantized weight dequantized, scales dropped, no quantization_config (fine-tuning).
    fp8: routed experts cast losslessly to e4m3 with 32x32 scales (Hopper serving); the rest as published.
    fp8-fp4: the published scheme (from a published source: a byte-identical copy of every tensor).
    Writes the shards, then config.json, model.safetensors.index.json, the tokenizer and manifest.json.

    Examples:
      dsv41-convert export ./DeepSeek-V4.1-Flash ./v41-bf16 --format bf16 --workers 4
      dsv41-convert export ./DeepSeek-V4.1-Flash ./v41-fp8 --format fp8
      dsv41-convert export ./finetuned-bf16 ./finetuned-fp8-fp4 --format fp8-fp4 --resume
    """
    from dsv41_convert.convert.execute import check_destination, check_out
    from dsv41_convert.convert.export import RECORDS, build_export_plan, export, not_carried, summarize_export

    ep = build_export_plan(_local_source(src), fmt)
    says_once = torchrun.says_the_common_lines()
    if says_once:
        _warn_of_the_source(Path(ep.plan.src), out)
    # what OUT lacks of them: copied in as the warning advises, a --resume named them again (an audit)
    others = [name for name in not_carried(Path(ep.plan.src)) if not (out / name).exists()]
    if others and says_once:  # a dry run's too (it said nothing of them)
        report.warn(
            f"{ep.plan.src}: not carried into {out}: {', '.join(others)} (export writes the weights, config.json, "
            "the index and the tokenizer files); copy them if the weight set needs them"
        )
    if dry_run:
        mine = {f.file for f in check_destination(ep.plan, out, resume, overwrite, records=RECORDS, device=device)}
    else:
        mine = check_out(ep.plan, out, resume, overwrite, None, device, RECORDS)  # refused before the progress's title
    _warn_of_a_share_without_torchrun("shards", False)
    if dry_run:  # a dry run's listing is of one share too: the warning above is said before it
        summary = summarize_export(ep, mine)  # what this run would write
        return report.print_json(summary) if as_json else _plan_table(summary)
    with report.byte_progress(f"export {src} -> {out} ({fmt})", quiet=as_json or not mine) as progress:
        summary = export(
            ep, out, workers=workers, resume=resume, overwrite=overwrite, device=device, progress=progress,
            direct_io=direct_io,
        )  # fmt: skip
    summary["not_carried"] = others  # the warning's files, for pipelines
    _report_run(summary, as_json, "shard", summary["manifest"] or "pending (not every shard is done yet)")
    if as_json:
        return
    if summary.get("fragment"):  # a torchrun share: RANK and WORLD_SIZE split the shards
        report.info(
            f"fragment: {summary['fragment']} (once every share is done: in one folder, the last share to finish "
            f"writes the rest; gathered from several machines, `dsv41-convert export SRC OUT --format {fmt} --resume`)"
        )
    if says_once:
        report.line(summary["out"])


# --- end of commands ---


def _one_line_summaries() -> None:
    """The command list of `--help` shows each command's first docstring paragraph, and typer's rich list
    keeps its single line breaks (ragged lines at any width): give each command that paragraph on one line."""
    for info in app.registered_commands:
        if info.short_help is None and info.callback is not None and info.callback.__doc__:
            info.short_help = " ".join(inspect.cleandoc(info.callback.__doc__).split("\n\n")[0].split())


_one_line_summaries()


def _click_exceptions():
    """The exceptions module of the click that Typer runs on: its own copy (`typer._click`, typer >= 0.25) or click."""
    import importlib

    return importlib.import_module(typer.BadParameter.__module__)


def os_error_message(exc: OSError) -> str:
    """One line for an OSError: the path(s) it names, then the system's reason."""
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    return f"{paths}: {exc.strerror or exc}" if paths else str(exc.strerror or exc)


def _input_error(message: str) -> None:
    """`error: message` on stderr, and with --json also {"ok": false, "exit_code": 2, "error": message} on
    stdout (a pipeline that reads stdout gets a document either way); exit 2."""
    _say_ending(message, 2)
    sys.exit(2)


def _run_failed(message: str) -> None:
    """`error: message` and its --json document for a run that failed, not its input (a process of it died);
    exit 1."""
    _say_ending(message, 1)
    sys.exit(1)


def _say_ending(message: str, code: int) -> None:
    """`error: message` on stderr and its --json document, a signal held off while they are said: torchrun's
    stop of a process that was saying its own error (its other process refused the same input a moment
    earlier) ended it mid-line, exit 130 and no document (CI)."""
    with interrupts.held():
        with contextlib.suppress(OSError):  # stderr's own failure (a full disk): the document still says it
            report.error(message)
        _json_error(message, code)


def _json_error(message: str, code: int = 2) -> None:
    """With --json: {"ok": false, "exit_code": code, "error": message} on stdout, where it can be written (the
    error may be stdout's own: closed, a full disk; stderr has said it), and where this run has written no
    document yet (one per run: after the result's, stderr alone says it)."""
    if "--json" in sys.argv[1:] and report.documents_written() == _run["documents_before"]:
        try:
            report.print_json(report.error_document(message, code), after_a_signal=True)
        except OSError:
            pass


RESUMABLE = {
    "shard": "continues it with --resume",
    "export": "continues it with --resume",
    "download": "run again continues it (mid-file into --local-dir; in the HF cache unfinished files start over)",
}


def interrupted_message(command: list[str], how: str = "interrupted") -> str:
    """What Ctrl-C (or SIGTERM, `how`) left: for a command that writes in steps, how to go on; for the others,
    and a `--dry-run` (a stopped one was told to continue with --resume), nothing written.
    command: the command line's arguments after the program's name (_command)."""
    name, dry_run = (command[0] if command else ""), "--dry-run" in command[1:]
    if name in RESUMABLE and not dry_run:
        return f"{how}; what is on disk is kept: {name} {RESUMABLE[name]}"
    return how + ("; nothing was written" if name in ("verify", "plan", "check") or dry_run else "")


def _sigterm_as_interrupt(signum, frame) -> None:
    """SIGTERM (a scheduler's stop, `timeout`, `kill`): the orderly stop of Ctrl-C (workers stopped, locks and
    semaphores released, the message and --json document), then exit 143. Killed outright, the run left its
    fork server's semaphores to multiprocessing's tracker, which warned of them as leaked."""
    _stopped_by.append("terminated (SIGTERM)")
    _arm_stop_watchdog()
    interrupts.interrupt(frame)


def _sigint_as_interrupt(signum, frame) -> None:
    """Ctrl-C: KeyboardInterrupt as Python raises it, but postponed while a file's writer threads run
    (interrupts.py: raised inside a queue operation, it hung the cleanup)."""
    _arm_stop_watchdog()
    interrupts.interrupt(frame)


STOP_GRACE_S = 30.0  # the longest the orderly stop after a signal may take (workers end within a chunk)
# the least the watchdog re-armed at exit gives the interpreter's teardown (torch's takes up to a second on a busy
# 2-core box): 0.1 s once the grace had passed ended a caller of main() that went on by SIGALRM at its exit (-14)
EXIT_TEARDOWN_S = 5.0
_watchdog: dict = {}  # while armed: "deadline" (time.monotonic()) and "previous" (the SIGALRM handler it replaced)


def _arm_stop_watchdog(seconds: float | None = None) -> None:
    """At the first signal: end this process STOP_GRACE_S later if its orderly stop has not (_stop_overran).
    A cleanup that waits forever on a lock a signal left held (a rare race: interrupts.py) must not hold
    OUT's lock and the caller forever. A timer signal, not a thread: the handler runs in the main thread
    even while it waits for a lock or a join, and a thread started inside a signal handler can deadlock.
    main() disarms it when the command returns and re-arms it for the rest of the grace at the process's
    exit (atexit): a caller of main() in its own process goes on, and the interpreter's own cleanup of a
    stopped run (multiprocessing's joins) is still bounded."""
    if "deadline" in _watchdog:
        return
    seconds = STOP_GRACE_S if seconds is None else seconds
    _watchdog.update(deadline=time.monotonic() + seconds, previous=signal.signal(signal.SIGALRM, _stop_overran))
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _disarm_stop_watchdog() -> None:
    if "deadline" not in _watchdog:
        return
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, _watchdog.pop("previous"))
    left = _watchdog.pop("deadline") - time.monotonic()
    atexit.register(_arm_stop_watchdog, max(left, EXIT_TEARDOWN_S))


def _stop_overran(signum, frame) -> None:
    """The orderly stop outlasted STOP_GRACE_S: say so and exit now (os._exit, no cleanup that could wait
    again). The kernel ends the workers, verify's ranks and their fork server with this process
    (die_with.py) and releases OUT's lock; partial files stay for --resume, as after a kill -9. The words
    cannot keep it alive: a reader gone (BrokenPipeError) is ignored, and a write blocked on a full pipe is
    cut by a last timer."""
    said, code = _how_stopped()
    signal.signal(signal.SIGALRM, lambda *_: os._exit(code))
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    message = f"{said} (the orderly stop did not end within {STOP_GRACE_S:g} s of the signal: ended at once)"
    try:
        report.error_at_once(message, code, as_json="--json" in sys.argv[1:])
    finally:
        os._exit(code)


def _how_stopped() -> tuple[str, int]:
    """-> (what the signal left, for the run's last message; the exit code): SIGTERM's 143 or Ctrl-C's 130."""
    how, code = (_stopped_by[0], TERMINATED) if _stopped_by else ("interrupted", INTERRUPTED)
    return interrupted_message(_command(), how), code


def _say_stopped() -> int:
    """The stopped run's last words (_say_ending); -> its exit code."""
    said, code = _how_stopped()
    _say_ending(said, code)
    return code


def _command() -> list[str]:
    """The command's arguments from its name on ([] before one): the name is the first argument that is no
    option (--debug)."""
    names = [n for n, a in enumerate(sys.argv[1:], 1) if not a.startswith("-")]
    return sys.argv[names[0] :] if names else []


def entry() -> None:
    """The process's entry point (the `dsv41-convert` script, `python -m dsv41_convert.cli`, torchrun's
    processes): main(), then the exit handlers, then the process ends with main's exit code, without the
    interpreter's teardown. The teardown (its last collection, every module's, torch's destructors: tens to
    hundreds of ms) runs after the interpreter has put the default signal handlers back, so a SIGTERM there
    ended a finished run by the signal itself, without the line _late_signals_exit_at_once writes (CI: the
    SIGTERM test of `export --workers 2`, once in about four runs). Registered before the command imports
    anything that registers its own (multiprocessing, torch), _end_before_the_teardown runs after them; one
    registered before entry() (a wrapper's, a .pth file's: subprocess coverage) does not run."""
    atexit.register(_end_before_the_teardown)
    try:
        main()
    except SystemExit as exc:
        _exit_code["code"] = _system_exit_code(exc.code)
        raise
    except KeyboardInterrupt:  # --debug: the traceback, then 130 (the interpreter would end by SIGINT)
        _exit_code["code"] = INTERRUPTED
        raise
    except BaseException:  # --debug, or a bug: the traceback, then 1, as the interpreter's own
        _exit_code["code"] = 1
        raise


_exit_code = {"code": 0}
_run = {"documents_before": 0}  # report.documents_written() when this run began: main may run more than once


def _system_exit_code(code: object) -> int:
    """sys.exit's argument as the interpreter turns it into an exit status: None 0, an int itself, anything
    else (a message, printed) 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _end_before_the_teardown() -> NoReturn:
    """The last exit handler: stdout and stderr flushed, the process ends with its exit code (120 where a flush
    fails, as the interpreter's own)."""
    code = _exit_code["code"]
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            code = code or 120
    os._exit(code)


def main() -> None:
    """One command line's run (entry() adds the process's end): ConvertError -> `error: ...` on stderr and
    exit 2, and so an OSError (the system refused a path); a usage error -> Typer's usage message on stderr
    and exit 2; Ctrl-C -> exit 130, SIGTERM 143; with --json each of these also one document on stdout;
    anything else keeps its traceback."""
    click_exceptions = _click_exceptions()
    _run["documents_before"] = report.documents_written()
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # an ignored SIGTERM stays ignored
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # and an ignored SIGINT
        signal.signal(signal.SIGINT, _sigint_as_interrupt)
    try:
        interrupts.quiet_when_dropped()
        _end_with_the_torchrun_agent()
        if sys.stdout is None:  # started with it closed (`cmd >&-`): said before the work, not after hours of it
            report.error("stdout: closed, so the results cannot be written; send it to a file or /dev/null instead")
            sys.exit(2)
        _paths_pass_through_stdout()
        _no_width_of_zero()
        if "--help" in sys.argv[1:] or len(sys.argv) == 1:  # no command: the help, as --help
            _help_reader_gone_as_sigpipe()
            help_width.fit(_command_context(sys.argv[1:]))
        _main(click_exceptions)
    except KeyboardInterrupt:  # a signal outside _main's own handling: in these first steps, or in its last ones
        if _debug["on"]:
            raise
        sys.exit(_say_stopped())
    finally:
        _disarm_stop_watchdog()


def _paths_pass_through_stdout() -> None:
    """A path that is not UTF-8 (Linux names are bytes; Python holds such a byte as a surrogate) is written to
    stdout as its bytes, as a shell tool writes it: under a UTF-8 locale stdout is strict, and `check` of such a
    folder ended its passing check in a UnicodeEncodeError traceback, exit 1 ("a check failed"), as did every
    result naming such a path. The C locale's stdout does this already; stderr escapes them (backslashreplace)."""
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="surrogateescape")


def _no_width_of_zero() -> None:
    """COLUMNS=0 (`COLUMNS=$(tput cols)` where there is no terminal) is no width: rich printed every line at width
    0, that is nothing, so results, errors and --help vanished and the run exited 0 or 2 without a word. Dropped,
    the width is the terminal's, or report.PIPE_WIDTH for a file or a pipe."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) == 0:
        del os.environ["COLUMNS"]


def _end_with_the_torchrun_agent() -> None:
    """Under torchrun, SIGTERM this process when its parent, torchrun's agent, is gone: after a kill -9 of
    torchrun its processes ran on, orphans, until they finished (an audit). SIGTERM ends it as torchrun's own
    stop does (exit 143, its document; what is on disk is kept)."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK") is not None:
        from dsv41_convert.convert.die_with import die_with_parent

        die_with_parent(signal.SIGTERM)


def _help_reader_gone_as_sigpipe() -> None:
    """--help is printed by Typer's own rich console, whose reader going away (`--help | head -1`) ended the run
    with exit 1, "a check failed" (an audit): 141, as for every other output (report.reader_gone). Only for
    --help: rich is not imported by a run that writes only JSON."""
    from rich.console import Console

    Console.on_broken_pipe = lambda self: report.reader_gone(self.file)  # type: ignore[method-assign]
    write_buffer = Console._write_buffer

    def named_stdout(self) -> None:  # `--help > /dev/full` said only "error: No space left on device"
        if self.stderr:
            return write_buffer(self)
        return report.named_call("stdout", write_buffer, self)

    Console._write_buffer = named_stdout  # type: ignore[method-assign]


def _command_context(argv: list[str]):
    """A click context of the command `argv` names, for a usage error click's parser raised without one (an option
    given without its value, `plan SRC --tp`: only the error line was shown, no usage line, no hint at --help);
    the top-level group's where argv names no command."""
    group = typer.main.get_command(app)
    top = group.make_context("dsv41-convert", [], resilient_parsing=True)
    name = next((a for a in argv if not a.startswith("-")), None)
    command = group.get_command(top, name) if name is not None else None
    if command is None:
        return top
    return command.make_context(name, [], parent=top, resilient_parsing=True)


def _main(click_exceptions) -> None:
    try:
        # in non-standalone mode click returns typer.Exit's code instead of exiting with it
        code = app(standalone_mode=False)
    except RankFailedError as exc:  # a rank died: the run failed, its input may be fine
        if _debug["on"]:
            raise
        _run_failed(str(exc))
    except (ConvertError, OSError) as exc:  # OSError: the system refused a path (read-only, not a folder)
        if _debug["on"]:
            raise
        _input_error(str(exc) if isinstance(exc, ConvertError) else os_error_message(exc))
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort as exc:
        cause = exc.__context__
        if interrupts.interrupted() or cause is None or isinstance(cause, KeyboardInterrupt):
            code = INTERRUPTED  # said below as every interrupt is (SIGTERM's 143 too), with its document
        else:
            # click turns an EOFError into Abort: a pipe to a process the run needs closed (its fork server
            # killed), which said "aborted" and exit 130 as for a Ctrl-C nobody sent (an audit)
            _run_failed(
                f"stopped: {type(cause).__name__} from a process the run depends on (a worker or its fork server "
                "killed?); what is on disk is kept"
            )
    except KeyboardInterrupt:  # a signal before the command runs (Typer building it): not a traceback
        if _debug["on"]:
            raise
        code = INTERRUPTED

    except click_exceptions.ClickException as exc:  # non-standalone mode hands usage errors to the caller
        if sys.stderr is None:  # closed (`2>&-`): click wrote the usage on stdout instead, before --json's document
            pass
        elif torchrun.shared_rank() is None:
            if isinstance(exc, click_exceptions.UsageError) and exc.ctx is None:
                exc.ctx = _command_context(sys.argv[1:])
            try:
                exc.show()
            except BrokenPipeError:  # its reader gone (`2>&1 | head -c1`): 141, not the traceback's 1 (an audit)
                report.reader_gone(sys.stderr)
            except OSError as failed:  # stderr cannot be written (`2>>log` on a full disk): exit 2 all the same, not 1
                report.stream_failed("stderr", failed)
        else:  # processes sharing stderr: one line that says which (click's lines said no rank: an audit)
            report.error(f"{exc.format_message()} (see --help)")
        code = 2 if isinstance(exc, click_exceptions.UsageError) else exc.exit_code
        if code == 2:
            _json_error(exc.format_message())
        sys.exit(code)
    except Exception as exc:
        # after a signal, what fails is its doing: a module half-imported when the KeyboardInterrupt landed
        # (reference-logits at 0.5 s: numpy without `multiply`)
        if _debug["on"] or not interrupts.interrupted():
            if _debug["on"] or torchrun.shared_rank() is None:
                raise
            # processes sharing stdout: a crash is a document too, as verify's and reference-logits' are (a
            # shard or export process left its traceback alone, no `exit_code` for a pipeline to read: an audit)
            _run_failed(crash_line(exc))
        code = INTERRUPTED
    if interrupts.interrupted():  # --debug too: a signal held off raised nothing to trace, and it exited 0
        code = INTERRUPTED  # the command ended as if none came: a signal during an import, or after its last check
    if code == INTERRUPTED:  # Typer's exit code for Ctrl-C (KeyboardInterrupt), returned in non-standalone mode
        code = _say_stopped()
    if not _late["registered"]:  # at the process's exit, not when main returns: a caller that goes on keeps its own
        _late["registered"] = True
        atexit.register(_late_signals_exit_at_once)
    if isinstance(code, int) and code:
        sys.exit(code)


_late = {"registered": False}


def _late_signals_exit_at_once() -> None:
    """At exit (the first of the exit handlers: torch's and multiprocessing's run after it), a Ctrl-C or SIGTERM
    ends the process at once with its own code (130, 143) and a line on stderr: one in those last moments (~0.4
    s) was recorded and never looked at, and the run exited 0 (an audit). An ignored signal stays ignored."""
    for sig, (code, what) in {signal.SIGINT: (INTERRUPTED, "interrupted"),
                              signal.SIGTERM: (TERMINATED, "terminated (SIGTERM)")}.items():  # fmt: skip
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, functools.partial(_exit_now, code, what))


def _exit_now(code: int, what: str, signum, frame) -> NoReturn:
    """The signal's line on stderr, then the exit with its code: a stderr that cannot take the line (a full disk,
    closed) raised an OSError out of this handler before its exit, and the run ended with its own 0 (an audit)."""
    try:
        report.say_at_once(f"error: {torchrun.by_rank(what)} while the process ended, after its result\n")
    finally:
        os._exit(code)
