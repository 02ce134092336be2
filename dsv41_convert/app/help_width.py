"""The width Typer's rich --help is printed at: the terminal's (or COLUMNS), or wider where rich would cut a cell
at it, as report.tables prints a table at the width its numbers need and the terminal wraps its lines.

rich's help tables shrink every column alike once the help text has given up its width, and cut what does not
fit with an ellipsis: `reference-logits --help` at 80 columns showed `--no-fp8-expert-di…`, at 60 `--stream-laye…`
and `--weight-dige…` (the options' own names), and words of the help text (`machine-read…`) (an audit).
"""

from __future__ import annotations

import contextlib
import io

import click

ELLIPSIS = "\u2026"  # what rich puts in place of the cut end of a cell
WIDEST = 1000  # columns at which no help cuts anything


def fit(ctx: click.Context) -> None:
    """Print the help of `ctx.command` (and any help this process prints) at the narrowest width no narrower than
    the terminal's at which rich cuts nothing: typer's rich_utils.MAX_WIDTH, the value Typer takes from
    TERMINAL_WIDTH (a TERMINAL_WIDTH of the user's is kept where it is wide enough)."""
    from rich.console import Console
    from typer import rich_utils

    terminal = rich_utils.MAX_WIDTH or Console().width
    own = _ellipses(ctx, WIDEST)  # any the help text itself holds

    def cuts(width: int) -> bool:
        return _ellipses(ctx, width) > own

    if not cuts(terminal):
        return
    narrow, wide = terminal, WIDEST  # cuts(narrow), not cuts(wide): more columns never cut more
    while wide - narrow > 1:
        middle = (narrow + wide) // 2
        narrow, wide = (middle, wide) if cuts(middle) else (narrow, middle)
    rich_utils.MAX_WIDTH = wide


def _ellipses(ctx: click.Context, width: int) -> int:
    """How many cells rich cuts in the help of `ctx.command` printed `width` columns wide (rendered, not shown)."""
    from typer import rich_utils

    before, rich_utils.MAX_WIDTH = rich_utils.MAX_WIDTH, width
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):  # Typer's console writes to sys.stdout as it is at the print
            ctx.command.format_help(ctx, click.HelpFormatter())
    finally:
        rich_utils.MAX_WIDTH = before
    return text.getvalue().count(ELLIPSIS)
