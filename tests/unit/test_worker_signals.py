"""Ctrl-C in a writer worker process (convert/execute.py): a worker in a job stops its file with
KeyboardInterrupt (the pool sends it back to the run); a worker waiting for its next job leaves quietly.
It printed multiprocessing's "Process ForkServerProcess-1: Traceback ... KeyboardInterrupt" from the pool's
queue under the run's own message (seen on a loaded 2-core box, test_misuse's signal-while-the-pool-starts
run, 1 run in 2 with two busy loops beside it)."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import multiprocessing as mp, os, signal, sys, time
from dsv41_convert.convert import execute
from dsv41_convert import interrupts

def worker(ready, in_job):
    signal.signal(signal.SIGINT, execute._interrupt_worker)
    interrupts.quiet_when_dropped()
    execute._IN_JOB[0] = in_job
    ready.set()
    if in_job:
        time.sleep(30)  # a job's work
    else:
        mp.get_context("fork").SimpleQueue().get()  # the pool's call queue, waiting

ctx = mp.get_context("fork")
ready = ctx.Event()
p = ctx.Process(target=worker, args=(ready, sys.argv[1] == "job"))
p.start()
ready.wait(10)
time.sleep(0.2)
os.kill(p.pid, signal.SIGINT)
p.join(20)
print(p.exitcode)
"""


def _run(state: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", _CHILD, state], capture_output=True, text=True, timeout=60)
    return done.stdout.strip(), done.stderr


def test_an_idle_worker_leaves_quietly_with_130():
    code, err = _run("idle")
    assert code == "130" and "Traceback" not in err, err


def test_a_worker_in_a_job_is_interrupted():
    code, err = _run("job")
    assert code == "1" and "KeyboardInterrupt" in err, err  # outside a pool nothing catches it: Process prints it
