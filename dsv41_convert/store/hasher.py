"""A thread that runs one sha256 update at a time beside its caller, so that hashing a chunk and writing
the same chunk take the time of the slower of the two, not their sum (hashlib and pwrite both release
the GIL for buffers this large).

The caller hands over one (hash object, bytes) at a time with `start`, does its own work on the same
bytes, then calls `wait`, which returns once the update is done (or raises the update's error). Nothing
is queued beyond that one update: the bytes stay the caller's, unchanged, from `start` to `wait`.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any


class Hasher:
    """One background hashing thread; `seconds` sums the time spent in updates (this thread only)."""

    def __init__(self, name: str):
        self.seconds = 0.0
        self._jobs: queue.Queue = queue.Queue(maxsize=1)
        self._done: queue.Queue = queue.Queue(maxsize=1)
        self._busy = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start(self, sha: Any, data: memoryview) -> None:
        """Begin sha.update(data); `data` must not change, and `sha` must not be used, until `wait`."""
        assert not self._busy, "Hasher.start before the last update was waited for"
        self._busy = True
        self._jobs.put((sha, data))

    def wait(self) -> None:
        """Return once the update begun by `start` is done; raise its error if it failed."""
        if not self._busy:
            return
        error = self._done.get()
        self._busy = False
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the update in flight (its error is dropped: the caller has one of its own) and stop."""
        if self._busy:
            self._done.get()
            self._busy = False
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            sha, data = job
            t0 = time.perf_counter()
            try:
                sha.update(data)
            except BaseException as exc:  # handed to the caller by wait()
                self._done.put(exc)
                continue
            finally:
                self.seconds += time.perf_counter() - t0
            self._done.put(None)
