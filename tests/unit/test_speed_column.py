"""The progress bars' speed column: a bar finished in a burst of reports shows its mean, not the burst's rate."""

from __future__ import annotations

from rich.progress import Progress, TransferSpeedColumn

from dsv41_convert.app.speed_column import (
    MIN_SECONDS,
    STALL_SECONDS,
    AmountColumn,
    MeanSpeedColumn,
    StallAwareTimeRemaining,
    Stalls,
    bar_speed,
)

MB = 10**6


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def bar(reports: list[tuple[float, int]], total: int) -> tuple[Progress, int]:
    """A rich Progress with one bar fed `reports` of (seconds since its start, bytes done so far)."""
    clock = Clock()
    progress = Progress(get_time=clock, disable=True)
    task = progress.add_task("model0-mp8.safetensors", total=total)
    start = clock.now
    for at, done in reports:
        clock.now = start + at
        progress.update(task, completed=done)
    return progress, task


def test_a_bar_finished_in_a_burst_shows_its_mean_not_the_burst():
    # 100 MB over 2 s, the last 60 MB reported 1 ms after the rest (a worker's queued chunks)
    progress, task_id = bar([(0.5, 20 * MB), (1.999, 40 * MB), (2.0, 100 * MB)], total=100 * MB)
    task = progress.tasks[task_id]
    assert task.finished_time == 2.0
    assert bar_speed(task) == 50 * MB
    assert MeanSpeedColumn().render(task).plain == "50.0 MB/s"
    assert TransferSpeedColumn().render(task).plain != "50.0 MB/s"  # rich's own column: the burst's rate


def test_a_running_bar_shows_the_recent_rate():
    progress, task_id = bar([(0.0, 0), (1.0, 10 * MB), (2.0, 30 * MB)], total=100 * MB)
    task = progress.tasks[task_id]
    assert task.finished_time is None
    assert bar_speed(task) == task.speed == 20 * MB  # the last second's 20 MB
    assert MeanSpeedColumn().render(task).plain == "20.0 MB/s"


def test_a_bar_done_too_soon_shows_no_rate():
    progress, task_id = bar([(MIN_SECONDS / 10, 6 * MB)], total=6 * MB)
    task = progress.tasks[task_id]
    assert task.finished_time is not None and task.finished_time < MIN_SECONDS
    assert bar_speed(task) is None
    assert MeanSpeedColumn().render(task).plain == ""


def test_a_bar_without_new_bytes_says_stalled_not_its_last_rate():
    """A transfer stalled in a read showed "619.5 MB/s 0:00:01" for as long as it stalled (rich keeps the
    rate of the last updates until the next). After STALL_SECONDS without bytes both columns say so; the
    rate comes back with the next bytes."""
    clock = Clock()
    progress = Progress(get_time=clock, disable=True)
    task_id = progress.add_task("model-00001-of-00048.safetensors", total=100 * MB)
    stalls = Stalls()
    speed, eta = MeanSpeedColumn(stalls), StallAwareTimeRemaining(stalls)
    start = clock.now
    for at, done in [(0.0, 0), (1.0, 10 * MB), (2.0, 30 * MB)]:
        clock.now = start + at
        progress.update(task_id, completed=done)
        task = progress.tasks[task_id]
        assert "stalled" not in speed.render(task).plain
    clock.now = start + 2.0 + STALL_SECONDS - 0.1
    assert speed.render(task).plain == "20.0 MB/s" and eta.render(task).plain != "-:--:--"
    clock.now = start + 2.0 + STALL_SECONDS + 3
    assert speed.render(task).plain == f"stalled {STALL_SECONDS + 3:.0f} s" and eta.render(task).plain == "-:--:--"
    progress.update(task_id, completed=31 * MB)
    assert speed.render(progress.tasks[task_id]).plain.endswith("MB/s")


def test_a_counting_bar_shows_items_not_bytes(monkeypatch):
    """The streamed reference's passes count units: its bars showed "11/11 bytes" and a rate in bytes."""
    import io

    from rich.console import Console

    from dsv41_convert.app import report
    from dsv41_convert.progress import counting

    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=200, color_system=None)
    monkeypatch.setattr(report, "_console", lambda name: console)
    with report.byte_progress("reference-logits") as progress:
        for u in range(12):
            progress(counting("pass 1/4 (prefill)", "units"), u, 11)
        progress("model0-mp2.safetensors", 3 * 2**20, 3 * 2**20)
    shown = screen.getvalue()
    assert "11/11 units" in shown and "bytes" not in shown
    assert "pass 1/4 (prefill) " in shown and "\x1f" not in shown
    assert "3.0/3.0 MiB" in shown  # a bar of bytes beside it as before


def test_a_counting_bar_rate_is_in_items_its_mean_and_never_stalled():
    """Items come relayed from a rank's file every 0.25 s, several in one burst: the bar showed rich's rate
    of the burst ("186/687 tensors 3.9e+05"), and "stalled 17 s" while one 6000-token prompt ran (an audit);
    a counting bar shows its mean since it started and is never called stalled."""
    progress, task_id = bar([(0.0, 0), (1.0, 2), (2.0, 3), (2.0001, 6)], total=11)
    progress.update(task_id, noun="units")
    task = progress.tasks[task_id]
    assert TransferSpeedColumn().render(task).plain != "3.0 B/s"  # rich's: the burst's
    stalls = Stalls()
    speed, eta = MeanSpeedColumn(stalls), StallAwareTimeRemaining(stalls)
    assert speed.render(task).plain == "3 units/s"  # 6 units in 2 s
    progress.get_time.now += STALL_SECONDS + 10  # the next prompt takes long
    assert speed.render(task).plain == f"{6 / (2.0001 + STALL_SECONDS + 10):.2g} units/s"
    assert "stalled" not in speed.render(task).plain and eta.render(task).plain != "-:--:--"


def test_a_finished_bar_is_never_called_stalled():
    """A bar that is done gets no new bytes, ever: it shows its mean rate, however long the others still run.
    Catches the stall test forgetting `finished_time` (every done bar read "stalled" after STALL_SECONDS)."""
    progress, task_id = bar([(0.0, 0), (1.0, 50 * MB), (2.0, 100 * MB)], total=100 * MB)
    stalls = Stalls()
    speed, eta = MeanSpeedColumn(stalls), StallAwareTimeRemaining(stalls)
    task = progress.tasks[task_id]
    assert speed.render(task).plain == "50.0 MB/s"  # 100 MB in 2 s
    progress.get_time.now += STALL_SECONDS + 10
    assert speed.render(task).plain == "50.0 MB/s" and eta.render(task).plain != "-:--:--"


def test_a_counting_bar_shows_no_rate_in_its_first_moments():
    """Two units 0.1 s after the start are no rate ("20 units/s" for units of minutes): as a byte bar, a counting
    bar shows none before MIN_SECONDS. Catches the MIN_SECONDS test dropped for counting bars."""
    progress, task_id = bar([(0.0, 0), (MIN_SECONDS / 5, 2)], total=11)
    progress.update(task_id, noun="units")
    task = progress.tasks[task_id]
    assert task.elapsed is not None and 0 < task.elapsed < MIN_SECONDS
    assert bar_speed(task) is None and MeanSpeedColumn().render(task).plain == ""


def test_a_counting_bar_of_unknown_total_says_so():
    """Catches the count's total rendered as "None" (or a float) instead of "?"."""
    progress = Progress(get_time=Clock(), disable=True)
    task_id = progress.add_task("prompts", total=None, noun="prompts")
    progress.update(task_id, completed=3)
    assert AmountColumn().render(progress.tasks[task_id]).plain == "3/? prompts"
