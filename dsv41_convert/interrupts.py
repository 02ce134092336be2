"""Ctrl-C and SIGTERM while a file is written by threads that share queues with the interrupted thread.

Python raises KeyboardInterrupt in the main thread at whatever bytecode it is running. Inside a
queue.Queue operation that can leave the queue's lock held, or an item put without its wake-up, and the
cleanup that then hands the writer thread its stop item waits forever: an audit saw `export --workers 2`
hang after SIGTERM in 5 of 10 tries, its workers stuck in Sink.finish, the folder locked.

So the signal handlers of the CLI and of its worker processes call `interrupt()`: it raises at once,
as Python would, except inside `deferred()` (write.write_partial while its threads run), where it is
postponed to the next `check()`. The writers call `check()` before each queue operation of theirs (every
chunk of every tensor), so a run still stops within one chunk's write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_state = {"depth": 0, "pending": False}


def interrupt() -> None:
    """For a signal handler: raise KeyboardInterrupt now, or at the next check() while deferred."""
    if _state["depth"]:
        _state["pending"] = True
        return
    raise KeyboardInterrupt


def check() -> None:
    """Raise the KeyboardInterrupt a signal postponed, if one did."""
    if _state["pending"]:
        _state["pending"] = False
        raise KeyboardInterrupt


@contextmanager
def deferred() -> Iterator[None]:
    """Interrupts inside wait for a check(); one still pending at the end is raised there."""
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
    check()
