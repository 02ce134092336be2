"""--help of every command through the entry point, in a pipe at COLUMNS 80, 60 and 40 and in a 40-column terminal:
rich cut the options' names to fit (`reference-logits --help` at 80 columns: `--no-fp8-expert-di…`; at 60
`--stream-laye…`), and words of the help text (`machine-read…`). Faults planted: the widths at which it cut."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios

import click
import pytest
import typer
from test_cli_usage import entry_point

from dsv41_convert import cli

COMMANDS = [[], *[[name] for name in typer.main.get_command(cli.app).commands]]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def option_names(command: list[str]) -> list[list[str]]:
    """Per option of `command` (the root's where []), the long names its row of the help shows."""
    group = typer.main.get_command(cli.app)
    top = click.Context(group, info_name="dsv41-convert")
    cmd = group.commands[command[0]] if command else group
    ctx = click.Context(cmd, parent=top, info_name=command[0]) if command else top
    names = [[n for n in (*p.opts, *p.secondary_opts) if n.startswith("--")] for p in cmd.get_params(ctx)]
    return [n for n in names if n]


def assert_whole(command: list[str], text: str) -> None:
    assert "\u2026" not in text, text
    rows = [line for line in text.splitlines() if line.lstrip("\u2502 *").startswith("--")]
    for names in option_names(command):
        whole = [re.compile(rf"(?<![\w-]){re.escape(n)}(?![\w-])") for n in names]
        assert any(all(w.search(row) for w in whole) for row in rows), (names, text)


@pytest.mark.parametrize("columns", ["80", "60", "40"])
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0] if c else "root")
def test_help_in_a_pipe_shows_every_option_name_whole(command, columns):
    env = {**os.environ, "COLUMNS": columns, "NO_COLOR": "1"}
    proc = subprocess.run([entry_point(), *command, "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert_whole(command, proc.stdout)


def test_help_in_a_narrow_terminal_shows_every_option_name_whole():
    """A 40-column terminal (no COLUMNS): the width rich takes from the terminal itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    command = ["reference-logits"]
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 40, 0, 0))
    proc = subprocess.Popen([entry_point(), *command, "--help"], stdin=follower, stdout=follower, stderr=follower,
                            env=env)  # fmt: skip
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's other end closed
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    assert_whole(command, ANSI.sub("", out.decode()).replace("\r\n", "\n"))
