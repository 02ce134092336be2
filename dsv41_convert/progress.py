"""What long-running library functions report while they work (library code never prints): progress
callbacks, and seconds per stage."""

import threading
from collections.abc import Callable

Progress = Callable[[str, int, int], None]
"""progress(label, done, total): `label` names a unit of work (an output file); done/total in bytes, or in
whole items for a label made by `counting`."""

_COUNTS = "\x1f"  # between a label and the noun of what it counts; never in a file name or tensor name


def counting(label: str, noun: str) -> str:
    """`label` for a bar that counts whole `noun`s (the streamed model's units, prompts), not bytes."""
    return f"{label}{_COUNTS}{noun}"


def counted(label: str) -> tuple[str, str | None]:
    """-> (the label as shown, the noun it counts or None for bytes): `counting` undone."""
    shown, _, noun = label.partition(_COUNTS)
    return shown, noun or None


def add_seconds(stages: dict[str, float], stage: str, seconds: float) -> None:
    """Count `seconds` towards `stage` (stage -> seconds summed over chunks and threads; `--json`'s stages)."""
    stages[stage] = stages.get(stage, 0.0) + seconds


class Tally:
    """Bytes done of `total` under `label`, counted from several threads; progress(label, done, total) after
    each add (nothing without a progress)."""

    def __init__(self, progress: Progress | None, label: str, total: int):
        self.progress, self.label, self.total = progress, label, total
        self.done = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if self.progress is None:
            return
        with self._lock:
            self.done += n
            self.progress(self.label, self.done, self.total)
