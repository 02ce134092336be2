"""A run's output folder made for it, and taken away again when the run fails before writing into it: a run
refused (no room, a bad source) left an empty OUT, and the folders `mkdir -p` made above it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path


def missing_above(out: Path) -> list[Path]:
    """The folders above `out` that do not exist (mkdir -p makes them with it), nearest first."""
    missing, here = [], Path(out).parent
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    return missing


@contextmanager
def made_folder(out: Path) -> Iterator[bool]:
    """`out` made, with the folders above it that are missing. Where the block raises (an error, Ctrl-C), the
    folders this call made are removed again, nearest first, as far as they are empty: what the run left
    there (a partial file to resume) keeps them. -> whether `out` was made here"""
    out = Path(out)
    above = missing_above(out)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield made
    except BaseException:
        if made:
            for folder in [out, *above]:
                with suppress(OSError):
                    folder.rmdir()
        raise
