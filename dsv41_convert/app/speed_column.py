"""The speed column of the byte progress bars (app/report.py), imported with rich when a bar is shown.

rich's own column keeps, once a bar is done, the speed of its last few updates. Workers report in bursts
(a worker's chunks reach the display queued behind each other), so a bar that finishes in a burst showed
the burst's rate: a 6 MiB rank file "written at 78 GB/s". This column shows rich's recent-window rate while
a bar runs and the bar's mean once it is done, and no rate at all for a bar done in under MIN_SECONDS.
"""

from __future__ import annotations

from rich import filesize
from rich.progress import ProgressColumn, Task
from rich.text import Text

MIN_SECONDS = 0.5  # a bar finished sooner has no rate worth showing: its first report came after its start


class MeanSpeedColumn(ProgressColumn):
    """Bytes per second (decimal units): recent while running, the whole bar's mean once finished."""

    def render(self, task: Task) -> Text:
        speed = bar_speed(task)
        return Text("" if speed is None else f"{filesize.decimal(int(speed))}/s", style="progress.data.speed")


def bar_speed(task: Task) -> float | None:
    """Bytes per second of `task`, or None where there is nothing to show (see the module's docstring)."""
    if task.finished_time is not None:
        if task.finished_time < MIN_SECONDS:
            return None
        return task.completed / task.finished_time
    return task.speed
