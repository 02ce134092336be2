"""interrupts.py: a signal's KeyboardInterrupt postponed while a file's writer threads run, raised at the
writers' next check, so it never lands inside a queue operation (which hung the cleanup: an audit)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from dsv41_convert import interrupts
from dsv41_convert.store.sink import Sink


@pytest.fixture(autouse=True)
def not_interrupted(monkeypatch):
    """This process as if no signal had reached it, before and after each test (an interrupt stays)."""
    monkeypatch.setitem(interrupts._state, "interrupted", False)


def test_raised_at_once_outside_and_at_the_next_check_inside(monkeypatch):
    interrupts.check()
    with pytest.raises(KeyboardInterrupt):
        interrupts.interrupt()
    monkeypatch.setitem(interrupts._state, "interrupted", False)
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():  # and at the end, once more
        interrupts.interrupt()  # a handler returns
        for _ in range(2):  # and stays: every later check raises
            with pytest.raises(KeyboardInterrupt):
                interrupts.check()
    monkeypatch.setitem(interrupts._state, "interrupted", False)
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():  # one not raised inside is raised at the end
        interrupts.interrupt()


def test_an_interrupt_dropped_in_a_weakref_callback_still_stops_the_next_write(monkeypatch):
    """A KeyboardInterrupt raised while a weakref callback runs is printed and dropped by Python (CI: a
    worker's SIGINT inside importlib's module-lock callback, and the worker ran on); the next check, here
    the one a write_partial makes before its first chunk, raises it all the same."""
    import weakref

    dropped = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: dropped.append(u.exc_type))

    class Lock:
        pass

    lock = Lock()
    ref = weakref.ref(lock, lambda r: interrupts.interrupt())  # the handler, run inside the callback
    del lock
    assert ref() is None and dropped == [KeyboardInterrupt]
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        interrupts.check()


def test_a_dropped_interrupt_is_not_printed_and_anything_else_dropped_is(monkeypatch):
    """The CLI's sys.unraisablehook: a KeyboardInterrupt of interrupt()'s that Python drops
    printed "Exception ignored in: ..." under the run's message (CI); it says nothing of it, as the next
    check raises it, and passes on anything else, and a KeyboardInterrupt nobody's interrupt() raised."""
    import weakref

    printed = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: printed.append(u.exc_type))
    for _ in range(3):  # the CLI run three times in one process installs it once
        interrupts.quiet_when_dropped()
    assert getattr(sys.unraisablehook, "quiet_when_dropped", False)

    def drop(callback) -> None:
        class Held:
            pass

        held = Held()
        ref = weakref.ref(held, lambda r: callback())
        del held
        assert ref() is None

    def not_ours() -> None:
        raise KeyboardInterrupt

    drop(not_ours)
    drop(interrupts.interrupt)
    drop(lambda: 1 / 0)
    assert printed == [KeyboardInterrupt, ZeroDivisionError]


def test_a_real_signal_mid_write_stops_the_sink_before_its_queue_and_it_finishes(tmp_path):
    """SIGINT at random moments of a writing loop (the CLI's handler): the interrupt comes out of Sink.write's
    check, never out of the queue, and the sink then finishes at once, every queued byte in the file."""
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupts.interrupt())
    try:
        for round_ in range(20):
            interrupts._state["interrupted"] = False
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


def test_a_signal_during_an_import_is_raised_at_the_next_check_not_inside_it(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised inside an import (torch's takes about a second) aborted the process where
    an extension module's init had called back into Python (exit 134, "terminate called after throwing
    ... KeyboardInterrupt"), or was swallowed and the run went on. Now the import completes and the next
    check raises."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGUSR1)\nafter_the_signal = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: interrupts.interrupt(frame))
    try:
        import slow_module  # the import the signal lands in
    finally:
        signal.signal(signal.SIGUSR1, old)
        sys.modules.pop("slow_module", None)
    assert slow_module.after_the_signal and interrupts.interrupted()
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()


def test_importing_names_importlib_frames_only():
    assert not interrupts.importing(sys._getframe()) and not interrupts.importing(None)
    seen = []

    class Finder:
        def find_spec(self, name, path=None, target=None):
            seen.append(interrupts.importing(sys._getframe()))

    sys.meta_path.insert(0, Finder())
    try:
        import dsv41_convert_no_such_module  # noqa: F401
    except ImportError:
        pass
    finally:
        sys.meta_path.pop(0)
    assert seen == [True]


def test_a_writer_that_took_an_interrupt_begins_no_file(tmp_path, monkeypatch):
    """A writer worker takes Ctrl-C only at checks (execute._interrupt_worker): write_partial checks before it
    creates the file's partial, so a job that began before the signal and reaches its file after it leaves
    nothing in OUT."""
    from tiny_ckpt import make_tiny

    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.convert.transform import quantizer_for
    from dsv41_convert.convert.write import write_partial

    src = make_tiny(tmp_path / "src", quantized=False, vision=False)
    rf = build_plan(src, 2).files[0]
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setitem(interrupts._state, "interrupted", True)
    with pytest.raises(KeyboardInterrupt):
        write_partial(rf, src, out, quantizer_for("cpu"), plan_digest="d")
    assert list(out.iterdir()) == []
