"""interrupts.py: a signal's KeyboardInterrupt postponed while a file's writer threads run, raised at the
writers' next check, so it never lands inside a queue operation (which hung the cleanup: an audit)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from dsv41_convert import interrupts
from dsv41_convert.store.sink import Sink


def test_raised_at_once_outside_and_at_the_next_check_inside():
    with pytest.raises(KeyboardInterrupt):
        interrupts.interrupt()
    with interrupts.deferred():
        interrupts.interrupt()  # a handler returns
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
        interrupts.check()  # raised once
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():  # one still pending at the end
        interrupts.interrupt()


def test_a_real_signal_mid_write_stops_the_sink_before_its_queue_and_it_finishes(tmp_path):
    """SIGINT at random moments of a writing loop (the CLI's handler): the interrupt comes out of Sink.write's
    check, never out of the queue, and the sink then finishes at once, every queued byte in the file."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupts.interrupt())
    try:
        for round_ in range(20):
            sink = Sink(tmp_path / f"f{round_}", "f", 1 << 30, lambda *a: None, direct=False)
            chunk = bytes(64 << 10)
            timer = threading.Timer(0.001 + 0.002 * round_, os.kill, (os.getpid(), signal.SIGINT))
            with pytest.raises(KeyboardInterrupt) as caught, interrupts.deferred():
                timer.start()
                for _ in range(100_000):
                    sink.write(chunk)
                time.sleep(5)  # not reached: the signal comes first
            timer.join()
            assert caught.traceback[-1].name == "check", caught.traceback[-1]  # interrupts.check, not a queue's
            t0 = time.monotonic()
            sink.finish()
            assert time.monotonic() - t0 < 5
            assert (tmp_path / f"f{round_}").stat().st_size == sink.queued == sink.done
            os.close(sink.fd)
    finally:
        signal.signal(signal.SIGINT, previous)
