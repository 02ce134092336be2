"""Typer option and argument aliases shared by the commands, so each is spelled once."""

from pathlib import Path
from typing import Annotated

import typer

SrcArg = Annotated[Path, typer.Argument(help="Source checkpoint folder (config.json, index, shards).")]
OutArg = Annotated[Path, typer.Argument(help="Output folder.")]
TpOpt = Annotated[int, typer.Option("--tp", min=1, help="Number of tensor-parallel ranks.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON summary on stdout.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Allow writing into a non-empty output folder.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Plan and validate, write nothing.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda.")]
ExpertDtypeOpt = Annotated[str, typer.Option("--expert-dtype", help="Routed experts as fp4 (as published) or fp8.")]
