"""The `dsv41-convert` console script: the command line loaded with Ctrl-C at its default
(interrupts.default_sigint; `python -m dsv41_convert.cli` loads it the same way). Once it is loaded, cli.entry
installs its own handlers."""

from __future__ import annotations

from dsv41_convert.interrupts import default_sigint


def entry() -> None:
    with default_sigint():
        from dsv41_convert import cli
    cli.entry()
