"""A shard started with SIGINT ignored (a job a script runs in the background: a Ctrl-C then ends the script, not
the job) runs on through a Ctrl-C at the terminal, as the CLI itself does (cli.py keeps an ignored SIGINT). Its
worker processes set their own handler all the same, so the Ctrl-C that reached the terminal's process group
stopped every worker and the run ended "interrupted", exit 130, nothing published (a helper's hunt)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tiny_ckpt import make_tiny

# the run, whose workers (forked by the fork server, which imports this script as __mp_main__) send the terminal's
# Ctrl-C to the run's process group as they begin their file
_CTRL_C_AT_THE_FIRST_FILE = """
import os, signal, sys
from dsv41_convert.convert import execute

real = execute._worker_file

def ctrl_c_then_write(*args, **kwargs):
    os.killpg(int(os.environ["RUN_PGID"]), signal.SIGINT)
    return real(*args, **kwargs)

execute._worker_file = ctrl_c_then_write

if __name__ == "__main__":
    os.environ["RUN_PGID"] = str(os.getpgid(0))
    from dsv41_convert import cli
    sys.argv = ["dsv41-convert", "shard", sys.argv[1], sys.argv[2], "--tp", "2", "--workers", "2"]
    cli.main()
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_shard_that_ignores_sigint_runs_on_through_a_ctrl_c(tmp_path: Path):
    src, out = make_tiny(tmp_path / "src"), tmp_path / "out"
    script = tmp_path / "run.py"
    script.write_text(_CTRL_C_AT_THE_FIRST_FILE)
    done = subprocess.run([sys.executable, str(script), str(src), str(out)], capture_output=True, text=True,
                          timeout=300, start_new_session=True, preexec_fn=_ignore_sigint)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "manifest.json").exists() and not list(out.glob("*.partial"))
