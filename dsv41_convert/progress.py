"""What long-running library functions report while they work (library code never prints): progress
callbacks, and seconds per stage."""

from collections.abc import Callable

Progress = Callable[[str, int, int], None]
"""progress(label, done, total): `label` names a unit of work (an output file); done/total in bytes."""


def add_seconds(stages: dict[str, float], stage: str, seconds: float) -> None:
    """Count `seconds` towards `stage` (stage -> seconds summed over chunks and threads; `--json`'s stages)."""
    stages[stage] = stages.get(stage, 0.0) + seconds
