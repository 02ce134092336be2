"""The `dsv41-convert` console script (and `python -m dsv41_convert.cli`, which comes here first): the command line
loaded with Ctrl-C at its default.

A SIGINT that lands while the command line's modules load (typer, rich: a fraction of a second; before any
work) ends the process by the signal itself, as README says, where Python's handler printed a
KeyboardInterrupt traceback over half a screen first. Once they are loaded, cli.entry installs its own."""

from __future__ import annotations

import signal
import threading


def entry() -> None:
    # an ignored SIGINT (a job started in the background by a script) stays ignored
    python_s = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if python_s:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    from dsv41_convert import cli

    if python_s:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    cli.entry()
