"""Ctrl-C and SIGTERM while a file is written by threads that share queues with the interrupted thread.

Python raises KeyboardInterrupt in the main thread at whatever bytecode it is running. Inside a
queue.Queue operation that can leave the queue's lock held, or an item put without its wake-up, and the
cleanup that then hands the writer thread its stop item waits forever: an audit saw `export --workers 2`
hang after SIGTERM in 5 of 10 tries, its workers stuck in Sink.finish, the folder locked.

So the CLI's signal handlers call `interrupt()`: it raises at once, as Python would, except inside
`deferred()` (write.write_partial while its threads run, the worker pool's wait), where it is postponed to
the next `check()`. The writers call `check()` before each queue operation of theirs (every chunk of every
tensor), so a run still stops within one chunk's write. A worker process's handler never raises
(`interrupt_later()`): all of its code shares locks with the run, up to the send-back of its result.

Where a cleanup waits forever all the same, the run does not: a watchdog armed by the first signal ends the
process (cli.py, STOP_GRACE_S).

A signal that lands while a module is imported (torch's first import takes about a second) is postponed
too, to the next check: a KeyboardInterrupt inside an extension module's import aborted the process
(pybind11's "terminate called after throwing ... KeyboardInterrupt", exit 134), or was swallowed by the
import and the run went on to the end and exited 0.

An interrupt stays: every later `check()` raises again. A KeyboardInterrupt raised while the interpreter
runs a weakref callback or a __del__ is printed ("Exception ignored in ...") and dropped, and the process
runs on (seen on CI: a SIGINT raised inside importlib's module-lock callback); the next check
stops it all the same. Nothing in a process that took one is meant to write again.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_state = {"depth": 0, "interrupted": False}


@contextmanager
def default_sigint() -> Iterator[None]:
    """SIGINT at its default while the block runs, then Python's handler again: the command line's modules (typer,
    rich: a fraction of a second, before any work) load so, and a Ctrl-C there ends the process by the signal,
    where Python's handler printed a KeyboardInterrupt traceback over half a screen first. An ignored SIGINT (a
    job a script started in the background) or another handler stays as it is, and so does a thread's but the
    main one's (only that one may set a handler)."""
    python_s = threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
    if python_s:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        if python_s:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupt(frame: FrameType | None = None) -> None:
    """For a signal handler (`frame`: the one it interrupted): raise KeyboardInterrupt now, or at the next
    check() while deferred or while `frame` imports a module."""
    _state["interrupted"] = True
    if not _state["depth"] and not importing(frame):
        raise KeyboardInterrupt


def interrupt_later() -> None:
    """For a worker process's signal handler: record the interrupt, raise nothing; the next check() raises it.
    A worker's code between checks holds locks it shares with other processes (the pool's queues), so no
    place in it is safe for an exception that a signal raises (execute._interrupt_worker)."""
    _state["interrupted"] = True


def importing(frame: FrameType | None) -> bool:
    """Whether `frame` or a frame that called it is importlib's: a module is being imported."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def interrupted() -> bool:
    """Whether a signal reached interrupt() in this process."""
    return _state["interrupted"]


def check() -> None:
    """Raise KeyboardInterrupt if this process was interrupted (postponed, or raised where it was dropped)."""
    if _state["interrupted"]:
        raise KeyboardInterrupt


@contextmanager
def deferred() -> Iterator[None]:
    """Interrupts inside wait for a check(); one not yet raised by the end is raised there."""
    with held():
        yield
    check()


@contextmanager
def held() -> Iterator[None]:
    """Interrupts inside wait, and are not raised at its end (deferred() raises them there): for a run's last
    words (its error line and --json document), said once its ending is decided; the process ends right after
    with the code decided (cli._say_ending)."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1


def quiet_when_dropped() -> None:
    """Install a sys.unraisablehook that says nothing of a KeyboardInterrupt of interrupt()'s that Python
    dropped (it printed "Exception ignored in: ... KeyboardInterrupt" under the run's own message): the next
    check() raises it again. Anything else it drops is printed as before."""
    printed = sys.unraisablehook
    if getattr(printed, "quiet_when_dropped", False):  # installed already (the CLI run again in one process)
        return

    def hook(unraisable) -> None:
        if not (unraisable.exc_type is KeyboardInterrupt and _state["interrupted"]):
            printed(unraisable)

    hook.quiet_when_dropped = True
    sys.unraisablehook = hook
