"""die_with.die_with_parent: a process dies with the one that forked it, also where that one is gone already."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import default_sigint

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

# argv: the marker file, then "gone" (the forking process exits before the child asks to die with it) or
# "alive" (it waits, and its child forks a grandchild that asks too: each has its own forker)
_FORKED = """
import os, sys, time
from dsv41_convert.convert import die_with

marker, case = sys.argv[1], sys.argv[2]

def say(word):
    with open(marker, "a") as f:
        f.write(word + "\\n")

me = os.getpid()
child = os.fork()
if child == 0:
    if case == "gone":
        deadline = time.monotonic() + 20
        while os.getppid() == me and time.monotonic() < deadline:  # handed to another process
            time.sleep(0.01)
        say("asking")
        die_with.die_with_parent()
        say("survived")
    else:
        grandchild = os.fork()
        if grandchild == 0:
            die_with.die_with_parent()
            say("grandchild survived")
            os._exit(0)
        os.waitpid(grandchild, 0)
        die_with.die_with_parent()
        say("child survived")
    os._exit(0)
if case == "alive":
    os.waitpid(child, 0)
"""


def test_a_child_whose_forker_is_gone_dies_at_once(tmp_path):
    """The race an audit met: a verify rank forked by the fork server, which died with its Ctrl-C'd run before
    the rank's first line; the rank then saw another parent, set its death signal on that one, and waited 10
    minutes for its peers holding the run's stdout. The parent is now the one that forked it, noted at the fork."""
    marker = tmp_path / "said"
    subprocess.run([sys.executable, "-c", _FORKED, str(marker), "gone"], check=True, timeout=60)
    deadline = time.monotonic() + 30
    while "asking" not in _said(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # what it says after die_with_parent returns, it says within milliseconds
    assert _said(marker) == ["asking"]


def test_a_child_and_a_grandchild_whose_forkers_live_go_on(tmp_path):
    marker = tmp_path / "said"
    subprocess.run([sys.executable, "-c", _FORKED, str(marker), "alive"], check=True, timeout=60)
    assert _said(marker) == ["grandchild survived", "child survived"]


def _said(marker: Path) -> list[str]:
    return marker.read_text().splitlines() if marker.exists() else []


def test_a_fork_whose_forker_was_not_noted_asks_the_kernel(monkeypatch):
    """Two threads forking at once: one thread's after-fork hook in the parent may clear what the other's child
    was to read. That child raised a KeyError in the hook and kept its forker's own forker (a review); now it
    falls back to getppid."""
    from dsv41_convert.convert import die_with

    monkeypatch.setattr(die_with, "_forked_by", {"pid": 1})  # inherited from the forker's own fork
    die_with._after_a_fork_in_the_child()
    assert die_with._forked_by == {}


def test_alive_tells_a_live_process_from_a_gone_one(monkeypatch):
    """alive() is how a worker learns that its run is gone (execute._init_worker kills itself then). Bugs
    guarded: a gone (reaped) process said to exist, so a worker of a killed run ran on holding its lock; and a
    process of another user (kill says EPERM) said to be gone."""
    import os

    from dsv41_convert.convert import die_with

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    assert die_with.alive(os.getpid()) and not die_with.alive(child.pid)

    def not_yours(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(die_with.os, "kill", not_yours)
    assert die_with.alive(child.pid)  # it exists: only the signal was refused


# the run's fork server, while its interpreter starts (site, before its preloads): says so, then takes its time
_SLOW_SERVER_START = """
import os, time
if os.environ.get("DSV41_CONVERT_FORK_SERVER_OF") == str(os.getppid()):
    open(os.environ["SERVER_STARTING"], "w").close()
    time.sleep(1.0)
"""

_SIGNAL_THE_STARTING_SERVER = """
import multiprocessing as mp, os, signal, time
from dsv41_convert.convert.die_with import fork_server_pid, start_fork_server
ctx = mp.get_context("forkserver")
ctx.set_forkserver_preload(["dsv41_convert.convert.die_with"])
start_fork_server()
deadline = time.monotonic() + 60
while not os.path.exists(os.environ["SERVER_STARTING"]) and time.monotonic() < deadline:
    time.sleep(0.01)
os.kill(fork_server_pid(), signal.SIGINT)
_, status = os.waitpid(fork_server_pid(), 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_ctrl_c_while_the_fork_server_starts_ends_it_quietly(tmp_path):
    """Ctrl-C reaches every process of the terminal's group, the run's fork server too. One that landed while
    the server's interpreter started (site, its first imports: before die_with, its first preload, sets its
    quiet handler) printed "Fatal Python error: init_import_site ... Traceback ... KeyboardInterrupt" under the
    run's own message (`export --format fp8-fp4` of a bf16 source, Ctrl-C a second in, on the loaded dev box).
    The server now starts with SIGINT blocked until that handler is set: it exits 130 without a word."""
    import os

    (tmp_path / "sitecustomize.py").write_text(_SLOW_SERVER_START)
    env = dict(os.environ, SERVER_STARTING=str(tmp_path / "starting"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    res = subprocess.run(
        [sys.executable, "-c", _SIGNAL_THE_STARTING_SERVER],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=default_sigint,  # the suite's own SIGINT may be ignored (a background job): the server keeps that
    )
    assert (res.returncode, res.stdout.split(), res.stderr) == (0, ["130"], ""), res.stderr


# the run: starts its fork server and asks it for a worker (queued while the server still starts), then waits
_RUN_ASKING_FOR_A_WORKER = """
import multiprocessing as mp, time
from dsv41_convert.convert.die_with import fork_server_pid, start_fork_server
ctx = mp.get_context("forkserver")
ctx.set_forkserver_preload(["dsv41_convert.convert.die_with"])
start_fork_server()
print(fork_server_pid(), flush=True)
ctx.Process(target=time.sleep, args=(600,)).start()
time.sleep(600)
"""


def test_a_fork_server_whose_run_was_killed_while_it_started_dies(tmp_path):
    """kill -9 of a run while its fork server's interpreter still started (before die_with, its first preload,
    asked to die with the run): the server, an orphan by then, asked nothing, served the worker the run had
    queued, and both lived on holding the run's stdout and stderr, so a caller reading them to their end
    (`subprocess.run(..., capture_output=True)`, `| tee`) waited for ever (`shard --workers 2` killed half a
    second in). The server now dies at once where the run that started it is gone."""
    import os
    import signal

    (tmp_path / "sitecustomize.py").write_text(_SLOW_SERVER_START)
    env = dict(os.environ, SERVER_STARTING=str(tmp_path / "starting"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    run = subprocess.Popen([sys.executable, "-c", _RUN_ASKING_FOR_A_WORKER], stdout=subprocess.PIPE, env=env)
    try:
        server = int(run.stdout.readline())
        deadline = time.monotonic() + 60
        while not (tmp_path / "starting").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        run.kill()
        run.wait(30)
        deadline = time.monotonic() + 20
        while _exists(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _exists(server), "the fork server outlived its killed run"
    finally:
        run.kill()
        run.wait(30)
        run.stdout.close()
        if _exists(server):
            os.kill(server, signal.SIGKILL)


def _exists(pid: int) -> bool:
    """Whether `pid` is a live process (not a zombie: the server, an orphan, is reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
