"""Ctrl-C in a writer worker process (convert/execute.py): recorded by the worker's handler, never raised
where it lands. The pool's send-back of a result takes a lock the workers and the run share: a SIGINT
raised inside it (between the acquire and the `with` block) left that lock held, the send-back's retry
waited for it forever, and so did the other worker and the run's shutdown (CI: `export --workers 2` hung
after SIGTERM; reproduced here 2 runs in ~115 with the CPUs loaded, the workers' stacks in
_sendback_result). The job stops at its next check (every chunk), and a worker waiting for its next job
waits for the pool's shutdown."""

from __future__ import annotations

import subprocess
import sys

from dsv41_convert import interrupts

_CHILD = """
import multiprocessing as mp, os, signal, sys, threading, time
from dsv41_convert.convert import execute
from dsv41_convert import interrupts

def worker(ready, results, checking):
    signal.signal(signal.SIGINT, execute._interrupt_worker)
    results.put(0)
    ready.set()
    sent, end = 1, time.monotonic() + 1.0
    try:
        while time.monotonic() < end:
            if checking:
                interrupts.check()  # as a job's writer checks before every chunk
            results.put(sent)  # as the pool's send-back of a result: a lock shared with the other processes
            sent += 1
        results.put(("done", sent, interrupts.interrupted()))
        interrupts.check()  # the next job: refused
    finally:
        results.put("end")

ctx = mp.get_context("fork")
ready, results = ctx.Event(), ctx.SimpleQueue()
p = ctx.Process(target=worker, args=(ready, results, sys.argv[1] == "job"))
p.start()
ready.wait(10)
got = []
reader = threading.Thread(target=lambda: got.extend(iter(results.get, "end")), daemon=True)
reader.start()
end = time.monotonic() + 0.8
while time.monotonic() < end and p.is_alive():
    os.kill(p.pid, signal.SIGINT)
    time.sleep(0.001)
p.join(20)
reader.join(20)
ints = [g for g in got if isinstance(g, int)]
done = [g for g in got if not isinstance(g, int)]
print(p.exitcode, len(ints) > 0 and ints == list(range(len(ints))), done and done[0][0] == "done" and done[0][2])
"""


def _run(state: str) -> tuple[str, str]:
    """-> ("exit code, every send completed in order, a done marker recording the interrupt", stderr)"""
    done = subprocess.run([sys.executable, "-c", _CHILD, state], capture_output=True, text=True, timeout=60)
    return done.stdout.strip(), done.stderr


def _raised_at(comment: str) -> str:
    """The traceback lines of a KeyboardInterrupt raised by the check on _CHILD's line marked `comment`."""
    line = next(i for i, text in enumerate(_CHILD.splitlines(), start=1) if comment in text)
    return f'File "<string>", line {line}, in worker\n  File "{interrupts.__file__}", line'


def test_signals_raise_nothing_where_they_land_and_the_next_check_stops_the_worker():
    """Hundreds of SIGINTs while a worker sends results through a shared queue: every send completes, in
    order, the worker records the interrupt, and only its next check raises (before: SystemExit(130) out
    of the first signal, wherever it landed)."""
    out, err = _run("idle")
    assert out == "1 True True", (out, err)
    assert err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err  # Process prints it
    assert _raised_at("# the next job") in err and "_interrupt_worker" not in err, err


def test_a_worker_in_a_job_stops_at_its_next_check():
    out, err = _run("job")
    assert out == "1 True []", (out, err)
    assert _raised_at("# as a job's writer") in err and "_interrupt_worker" not in err, err
