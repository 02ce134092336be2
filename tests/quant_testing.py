"""A CPU quantizer for tests that interrupt a conversion: counts encode calls and raises a Ctrl-C at one."""

from __future__ import annotations

from dsv41_convert.convert.transform import quantizer_for


class CountingQuantizer:
    """The CPU quantizer, counting encode calls per tensor; raises KeyboardInterrupt (a Ctrl-C) at call `stop`."""

    def __init__(self, stop: int | None = None):
        self.q, self.calls, self.n, self.stop = quantizer_for("cpu"), {}, 0, stop
        self.device = "cpu"

    def __getattr__(self, attr):
        func = getattr(self.q, attr)
        if not attr.startswith("encode_"):
            return func

        def wrapped(*args):
            self.n += 1
            if self.stop is not None and self.n == self.stop:
                raise KeyboardInterrupt
            name = args[-1].split(": ")[-1].split(" (source rows ")[0]  # stream.py names a block's rows
            self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args)

        return wrapped
