"""Typer option and argument aliases shared by the commands, so each is spelled once."""

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from dsv41_convert.numbers import ascii_int


def whole_number(least: int | None = None, other: str = "", most: int | None = None) -> Callable[[str], int]:
    """The parser of an int option: ascii_int, at least `least` and at most `most`; typer's own takes what
    int() takes. `other` names what else the option takes, for the error ("or auto")."""
    wanted = "an integer" if least is None else f"a number >= {least}"
    wanted += "" if most is None else f" and <= {most}"

    def parse(value: str) -> int:
        try:
            n = ascii_int(str(value))
        except ValueError:
            n = None
        if n is None or (least is not None and n < least) or (most is not None and n > most):
            raise typer.BadParameter(f"{value!r}: expected {wanted} in the digits 0-9{other}") from None
        return n

    return parse


def finite_number(least: float, most: float | None = None) -> Callable[[str], float]:
    """The parser of a float option: a decimal number in the digits 0-9, finite, at least `least` and at most
    `most`. typer's own takes nan and inf (nan was refused as "should be >= 0", inf let a bound pass anything)."""
    wanted = f"a finite number >= {least:g}" + ("" if most is None else f" and <= {most:g}")

    def parse(value: str) -> float:
        text = str(value)
        x = float(text) if re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", text) else math.nan
        if not (math.isfinite(x) and x >= least and (most is None or x <= most)):
            raise typer.BadParameter(f"{value!r}: expected {wanted}")
        return x

    return parse


def given_on_command_line(ctx: typer.Context, flag: str) -> bool:
    """Whether the option whose on-form is `flag` (e.g. --weight-digests) was given as such on the command line,
    not taken as its default."""
    param = next(p for p in ctx.command.params if flag in p.opts)
    source = ctx.get_parameter_source(param.name)
    return getattr(source, "name", None) == "COMMANDLINE" and bool(ctx.params.get(param.name))


def given_path(value: str | Path) -> Path:
    """The parser of a path argument or option: the path as given, unless it is empty, or begins with a ~ the
    shell left as it is. An empty one ("$OUT" of a variable left unset) was the current folder: shard, export,
    make-tiny and demo wrote into it, download --local-dir fetched a checkpoint into it, plan and check read it,
    all without a word. A shell expands ~ at a word's start only: `--local-dir=~/v41` fetched the checkpoint
    into a folder named ~ under the current one. Such a path is taken where its first name exists here."""
    text = str(value)
    if text == "":
        raise typer.BadParameter("'': an empty path; give the path (. for the current folder)")
    first = text.split("/", 1)[0]
    if first.startswith("~") and not (Path(first).exists() or Path(first).is_symlink()):
        raise typer.BadParameter(
            f"{text!r}: ~ is not expanded here (a shell expands it unquoted at a word's start, not in quotes or "
            f"after --option=): give the path itself (--option ~/x, $HOME/x), or ./{text} for a folder named {first}"
        )
    return Path(value)


def given_revision(value: str) -> str:
    """The parser of --revision: the branch, tag or commit as given, unless it is empty ("$REV" of a variable
    left unset): that reached the Hub as a revision of no name, which answered "revision 'main' not found"
    (main was there); offline it was checked as a revision named ''."""
    if str(value) == "":
        raise typer.BadParameter(
            "'': an empty revision; give a branch, tag or commit, or leave --revision out for main"
        )
    return str(value)


SrcArg = Annotated[
    Path,
    typer.Argument(
        parser=given_path,
        help=r"Source checkpoint folder (config.json, index, shards) or Hub repo id owner/name\[@rev].",
    ),
]
LocalSrcArg = Annotated[
    Path,
    typer.Argument(
        parser=given_path,
        help="Checkpoint folder: Hugging Face format (config.json, index, shards), or rank files (model{r}-mp{N}, "
        "with --stream-layers).",
    ),
]
OutArg = Annotated[Path, typer.Argument(parser=given_path, help="Output folder.")]
TpOpt = Annotated[int, typer.Option("--tp", parser=whole_number(1), help="Number of tensor-parallel ranks.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON summary on stdout.")]
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace what an earlier run of this command wrote in OUT; a file it did not write is never removed.",
    ),
]
DemoOverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite", help="Replace DIR if an earlier demo wrote it (DIR/.dsv41-demo); nothing else is removed."
    ),
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Plan and validate, write nothing.")]
DirectIoOpt = Annotated[
    bool,
    typer.Option(
        "--direct-io/--buffered-io",
        help="Write the output shards with O_DIRECT, past the page cache (the default: as fast as buffered writes or "
        "faster, with less CPU, in every measurement since 2026-12-02, docs/BENCHMARKS.md), or through it. "
        "Falls back to buffered writes where the file system refuses O_DIRECT.",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", parser=whole_number(), help="Random seed.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
ExpertDtypeOpt = Annotated[str, typer.Option("--expert-dtype", help="Routed experts as fp4 (as published) or fp8.")]
SourceDtypeOpt = Annotated[
    str, typer.Option("--source-dtype", help="fp8: the published fp8/fp4 layout; bf16: the same model unquantized.")
]
VisionOpt = Annotated[bool, typer.Option("--vision/--no-vision", help="Include the vision tower and aligner.")]
LayerShardsOpt = Annotated[
    int | None,
    typer.Option("--shards", parser=whole_number(1), help="Files for the backbone layers (default: one per layer)."),
]
PresetOpt = Annotated[
    str, typer.Option("--preset", help="tiny (a few MB), medium (real hidden sizes, GBs) or full (with --sparse).")
]


def parse_workers(value: str) -> int:
    """--workers N (N >= 1, in the digits 0-9) or auto, which becomes 0: execute() picks from cores, memory and
    rank files."""
    return 0 if str(value) == "auto" else whole_number(1, " or auto")(value)


WorkersOpt = Annotated[
    int,
    typer.Option(
        "--workers",
        parser=parse_workers,
        help="Local worker processes (one output file each), or auto: a quarter of the cores but at least 4 "
        "(half but at least 2 where most bytes are computed), within memory and the number of output files "
        "(1 with --device cuda).",
    ),
]
HashWorkersOpt = Annotated[
    int,
    typer.Option(
        "--workers",
        parser=parse_workers,
        help="Files hashed at once (threads), or auto: one per usable core, at most 8 and the number of files. "
        "1 reads one file at a time (a spinning disk).",
    ),
]
RanksOpt = Annotated[str | None, typer.Option("--ranks", help="Only these output ranks, e.g. 0,3 (default: all).")]
ResumeOpt = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Continue a run: skip finished output files whose size and sha256 match their record; "
        "continue unfinished ones from their last verified checkpoint.",
    ),
]
FormatOpt = Annotated[
    str,
    typer.Option(
        "--format",
        help="bf16 (everything dequantized), fp8 (published scheme, experts fp8 32x32) or fp8-fp4 (the published "
        "scheme: fp8 weights, MXFP4 experts).",
    ),
]
