"""Terminal output for cli.py: rich progress and tables on stderr, results and JSON on stdout.

Library code never prints; it takes a `progress(event)` callback. This module makes such callbacks.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from dsv41_convert.progress import Progress as ProgressFn

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def print_json(data: Any, compact: bool = False) -> None:
    """One JSON document on stdout, for pipelines. `compact`: no indentation, for large documents (the
    indenting encoder is pure Python, ~10x slower than the compact one), and no check for cycles, which
    costs a third of the encoding of a plan's 400k containers (JSON data has none: one would recurse
    until RecursionError instead of a ValueError)."""
    if compact:
        text = json.dumps(data, separators=(",", ":"), default=str, check_circular=False)
    else:
        text = json.dumps(data, indent=2, default=str)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def write(*pieces: str) -> None:
    """A document already rendered (e.g. JSON), given whole or in pieces, on stdout with a final newline, as
    print_json ends it."""
    for piece in pieces:
        sys.stdout.write(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()


def error(message: str) -> None:
    stderr.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)


def warn(message: str) -> None:
    stderr.print(f"[yellow]warning:[/] {message}", highlight=False)


def info(message: str) -> None:
    stderr.print(message, highlight=False)


@contextmanager
def byte_progress(title: str, quiet: bool = False) -> Iterator[ProgressFn]:
    """A rich progress display with one bar per label, bytes, speed and ETA, on stderr."""
    if quiet:
        yield lambda label, done, total: None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    tasks: dict[str, TaskID] = {}
    with Progress(*columns, console=stderr, transient=False) as progress:
        progress.console.print(title, highlight=False)

        def update(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = progress.add_task(label, total=total)
            progress.update(tasks[label], completed=done, total=total)

        yield update
