"""Run the dsv41-convert CLI in this process, as a user would from the shell, and capture its output."""

from __future__ import annotations

import sys

from dsv41_convert.cli import main


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """-> (exit code, stdout, stderr with rich's line wrapping undone)"""
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())
