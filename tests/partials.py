"""Watching a run's output folder from a test while the run writes it."""

from __future__ import annotations

from pathlib import Path


def a_file_started(out: Path, pattern: str = "*.partial") -> bool:
    """Whether a .partial file in OUT matching `pattern` holds bytes; one renamed into place between the
    listing and its stat is passed over (it raced the test's look, it did not fail the run)."""
    for partial in out.glob(pattern):
        try:
            if partial.stat().st_size:
                return True
        except FileNotFoundError:
            pass
    return False
