"""The watchdog a signal arms (cli.STOP_GRACE_S): a run whose orderly stop waits forever (as the worker
pool's shutdown did on a lock a signal left held) still ends, says so, exits 143 or 130 with its --json
document, and leaves OUT to --resume (its lock released, nothing published)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import default_sigint
from tiny_ckpt import make_tiny

# the CLI with a 2 s grace and a shard whose cleanup, after the signal, waits forever
_STUCK_AFTER_THE_SIGNAL = """
import sys, threading, time
from dsv41_convert import cli
from dsv41_convert.convert import execute

def stuck(*args, **kwargs):
    try:
        print("writing", file=sys.stderr, flush=True)
        time.sleep(120)
    except KeyboardInterrupt:
        while True:  # a cleanup that never ends, whatever is raised inside it
            try:
                threading.Event().wait()
            except BaseException:
                pass

execute._run = stuck
cli.STOP_GRACE_S = 2.0
sys.argv = ["dsv41-convert", *sys.argv[1:]]
cli.main()
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("watchdog") / "src")


@pytest.mark.parametrize(("sig", "code", "said", "reader_gone"), [
    (signal.SIGTERM, 143, "terminated (SIGTERM)", False),
    (signal.SIGINT, 130, "interrupted", False),
    (signal.SIGTERM, 143, "terminated (SIGTERM)", True),  # `... --json | jq`, jq ended by the same Ctrl-C
])  # fmt: skip
def test_a_stop_that_never_ends_is_ended_after_the_grace(src, tmp_path, sig, code, said, reader_gone):
    """A stuck stop ends 2 s after the signal (the grace patched down from 30 s), saying so; with stdout's
    reader gone, the document's BrokenPipeError does not keep the process in its cleanup (it did: an
    audit)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", _STUCK_AFTER_THE_SIGNAL, "--debug", "shard", str(src), str(out), "--tp", "2",
           "--json"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)  # fmt: skip
    assert proc.stderr.readline() == "writing\n"
    if reader_gone:
        proc.stdout.close()
        proc.stdout = None  # communicate() reads stderr alone
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run hung after the signal: no watchdog")
    took = time.monotonic() - t0
    assert proc.returncode == code and 1.5 < took < 30, (proc.returncode, took, stderr)
    message = (
        f"{said}; what is on disk is kept: shard continues it with --resume (the orderly stop did not end within "
        "2 s of the signal: ended at once)"
    )
    assert stderr.endswith(f"error: {message}\n"), stderr  # the command named after --debug too
    if not reader_gone:
        assert json.loads(stdout) == {"ok": False, "exit_code": code, "error": message}
    assert not (out / "manifest.json").exists() and not list(out.glob("*.safetensors"))
    again = subprocess.run([sys.executable, "-m", "dsv41_convert.cli", "shard", str(src), str(out), "--tp", "2",
                            "--resume"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr  # OUT's lock went with the process
    assert (out / "manifest.json").exists()


_SIGNALLED_IN_PROCESS = """
import os, signal, sys, time
from dsv41_convert import cli
from dsv41_convert.synth import staged

real = staged.check_out
def check_out(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # during the command: the CLI's handler arms the watchdog
    return real(*args, **kwargs)

staged.check_out = check_out
cli.STOP_GRACE_S = 1.0
sys.argv = ["dsv41-convert", "make-tiny", sys.argv[1]]
try:
    cli.main()
except SystemExit as exc:
    print("main ended", exc.code, flush=True)
time.sleep(3)  # the caller goes on
print("the caller went on", flush=True)
"""


def test_main_run_in_a_process_that_goes_on_leaves_no_watchdog_behind(tmp_path):
    """main() called in-process (tests, an embedding tool) and stopped by a signal: the timer it armed is
    off once it returns, so the caller is not ended a grace later (it was: an audit)."""
    done = subprocess.run([sys.executable, "-c", _SIGNALLED_IN_PROCESS, str(tmp_path / "t")], capture_output=True,
                          text=True, timeout=120, preexec_fn=default_sigint)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "main ended 143\nthe caller went on\n"), done.stderr


def test_the_watchdog_at_exit_gives_the_teardown_a_few_seconds(tmp_path):
    """A caller of main() that ends: the watchdog re-armed at its exit gave the interpreter's teardown what was
    left of the grace when main returned (here under 1 s; 0.1 s at least), so a longer teardown (torch's, on a
    busy box) was ended by it (exit 143, or SIGALRM once Python had reset its handlers: the test above failed
    so under load). It gives EXIT_TEARDOWN_S at least."""
    script = _SIGNALLED_IN_PROCESS.replace(
        "sys.argv = [", "import atexit\natexit.register(time.sleep, 1.5)  # a slow teardown\nsys.argv = ["
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "t")], capture_output=True, text=True,
                          timeout=120, preexec_fn=default_sigint)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "main ended 143\nthe caller went on\n"), done.stderr
