"""Slowed writes for the O_DIRECT appender's tests: a buffer reused before its write finished would show."""

from __future__ import annotations

import os
import threading
import time

from dsv41_convert.store import direct_write
from dsv41_convert.store.direct_write import address


def slow_pwrites(monkeypatch, seconds: float) -> list[tuple[int, int, int]]:
    """Make each pwrite of the appender take `seconds` first; -> the (address, length, offset) of each, as made."""
    made, real, lock = [], os.pwrite, threading.Lock()

    def pwrite(fd, view, offset):
        time.sleep(seconds)
        with lock:
            made.append((address(memoryview(view)), len(view), offset))
        return real(fd, view, offset)

    monkeypatch.setattr(direct_write.os, "pwrite", pwrite)
    return made
