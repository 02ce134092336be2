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
    print("writing", file=sys.stderr, flush=True)
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        threading.Event().wait()  # a cleanup that never ends

execute._run = stuck
cli.STOP_GRACE_S = 2.0
sys.argv = ["dsv41-convert", *sys.argv[1:]]
cli.main()
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("watchdog") / "src")


@pytest.mark.parametrize(("sig", "code", "said"), [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                                   (signal.SIGINT, 130, "interrupted")])  # fmt: skip
def test_a_stop_that_never_ends_is_ended_after_the_grace(src, tmp_path, sig, code, said):
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", _STUCK_AFTER_THE_SIGNAL, "shard", str(src), str(out), "--tp", "2", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)  # fmt: skip
    assert proc.stderr.readline() == "writing\n"
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
    assert stderr.endswith(f"error: {message}\n"), stderr
    assert json.loads(stdout) == {"ok": False, "exit_code": code, "error": message}
    assert not (out / "manifest.json").exists() and not list(out.glob("*.safetensors"))
    again = subprocess.run([sys.executable, "-m", "dsv41_convert.cli", "shard", str(src), str(out), "--tp", "2",
                            "--resume"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr  # OUT's lock went with the process
    assert (out / "manifest.json").exists()
