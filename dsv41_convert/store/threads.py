"""Work spread over threads that all stop at their next step once their caller stops waiting.

hashlib's update and pread release the GIL, so threads hash files or tensors in parallel. A plain
ThreadPoolExecutor lets every running item finish after an error or a Ctrl-C in the caller (tens of seconds
for a 10 GB file) and then starts the queued ones; here each item calls `keep_going()` between its steps
(every chunk), which raises in its thread once the caller has given up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Abandoned(Exception):
    """Ends a thread's item whose caller has stopped waiting for it."""


def map_stoppable(fn: Callable[[T, Callable[[], None]], R], items: Sequence[T], threads: int, name: str) -> list[R]:
    """[fn(item, keep_going) for item in items], `threads` items at a time, in order. An error in any item, or
    Ctrl-C / SIGTERM in the calling thread, is raised once every thread has stopped at its next keep_going()
    and no queued item has begun."""
    stop = threading.Event()

    def keep_going() -> None:
        if stop.is_set():
            raise Abandoned

    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix=name)
    try:
        return list(pool.map(lambda item: fn(item, keep_going), items))
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
