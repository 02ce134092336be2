"""The `dsv41-convert` command line. Commands parse, call the library and report, nothing more.

Exit codes: 0 success, 1 verification ran and found a mismatch, 2 usage or input error.
"""

from __future__ import annotations

import sys

import typer

from dsv41_convert import report
from dsv41_convert.errors import ConvertError

app = typer.Typer(
    name="dsv41-convert",
    help="Convert, quantize, shard and verify DeepSeek V4.1 checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_debug = {"on": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for input errors.")) -> None:
    _debug["on"] = debug


# --- commands: make-tiny ---

# --- commands: plan, shard ---

# --- commands: verify, reference-logits, check, demo ---

# --- commands: download ---

# --- end of commands ---


def main() -> None:
    """Entry point: ConvertError -> `error: ...` on stderr and exit 2; anything else keeps its traceback."""
    try:
        app(standalone_mode=False)
    except ConvertError as exc:
        if _debug["on"]:
            raise
        report.error(str(exc))
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        report.error("aborted")
        sys.exit(130)
    except Exception as exc:  # click usage errors come through here in non-standalone mode
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
