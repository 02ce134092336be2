"""The amount and speed columns of the progress bars (app/report.py), imported with rich when a bar is shown.

A bar counts bytes, or whole items where its task has a `noun` field (progress.counting: "5/11 units").

rich's own column keeps, once a bar is done, the speed of its last few updates. Workers report in bursts
(a worker's chunks reach the display queued behind each other), so a bar that finishes in a burst showed
the burst's rate: a 6 MiB rank file "written at 78 GB/s". This column shows rich's recent-window rate while
a bar runs and the bar's mean once it is done, and no rate at all for a bar done in under MIN_SECONDS.

rich's rate is kept from the last updates until the next one: a transfer stalled in a read showed its
last rate and ETA for as long as it stalled. A bar without new bytes for STALL_SECONDS says "stalled" in
both columns instead. A counting bar is never called stalled (one prompt, one unit of the real model, may take
minutes) and shows its mean rate since it started (its items come relayed in bursts: "3.9e+05 tensors/s").
"""

from __future__ import annotations

from rich import filesize
from rich.progress import DownloadColumn, ProgressColumn, Task, TaskID, TimeRemainingColumn
from rich.text import Text

MIN_SECONDS = 0.5  # a bar finished sooner has no rate worth showing: its first report came after its start
STALL_SECONDS = 5.0  # a running bar without new bytes this long is called stalled


class Stalls:
    """How long each running bar has gone without new bytes, as seen by the columns that render it (rich
    renders every column at each refresh, with the time of its own clock)."""

    def __init__(self) -> None:
        self._since: dict[TaskID, tuple[float, float]] = {}  # task -> (bytes done, first seen at that count)

    def seconds(self, task: Task) -> float | None:
        """Seconds `task` has been stalled, or None while bytes come or STALL_SECONDS have not passed."""
        if task.fields.get("noun") is not None:  # one item (a prompt, a unit of the real model) may take minutes
            return None
        now = task.get_time()
        done, since = self._since.get(task.id, (None, now))
        if done != task.completed:
            self._since[task.id] = (task.completed, now)
            return None
        waited = now - since
        return waited if task.finished_time is None and waited >= STALL_SECONDS else None


class AmountColumn(DownloadColumn):
    """Bytes done of the total (binary units), or for a counting bar items done of the total."""

    def __init__(self) -> None:
        super().__init__(binary_units=True)

    def render(self, task: Task) -> Text:
        noun = task.fields.get("noun")
        if noun is None:
            return super().render(task)
        total = "?" if task.total is None else f"{int(task.total)}"
        return Text(f"{int(task.completed)}/{total} {noun}", style="progress.download")


class MeanSpeedColumn(ProgressColumn):
    """Bytes per second (decimal units), or items per second: recent while running, the whole bar's mean once finished;
    "stalled N s" for a running bar without new bytes for STALL_SECONDS."""

    def __init__(self, stalls: Stalls | None = None) -> None:
        super().__init__()
        self.stalls = stalls or Stalls()

    def render(self, task: Task) -> Text:
        stalled = self.stalls.seconds(task)
        if stalled is not None:
            return Text(f"stalled {stalled:.0f} s", style="progress.remaining")
        speed = bar_speed(task)
        if speed is None:
            return Text("")
        noun = task.fields.get("noun")
        shown = f"{speed:.2g} {noun}/s" if noun is not None else f"{filesize.decimal(int(speed))}/s"
        return Text(shown, style="progress.data.speed")


class StallAwareTimeRemaining(TimeRemainingColumn):
    """rich's time remaining, and "-:--:--" for a bar stalled (its rate says nothing of what is left)."""

    def __init__(self, stalls: Stalls) -> None:
        super().__init__()
        self.stalls = stalls

    def render(self, task: Task) -> Text:
        if self.stalls.seconds(task) is not None:
            return Text("-:--:--", style="progress.remaining")
        return super().render(task)


def bar_speed(task: Task) -> float | None:
    """Bytes per second of `task`, or None where there is nothing to show (see the module's docstring)."""
    if task.finished_time is not None:
        if task.finished_time < MIN_SECONDS:
            return None
        return task.completed / task.finished_time
    if task.fields.get("noun") is not None:  # items come relayed in bursts: their mean since the start
        elapsed = task.elapsed
        return None if elapsed is None or elapsed < MIN_SECONDS or not task.completed else task.completed / elapsed
    return task.speed
