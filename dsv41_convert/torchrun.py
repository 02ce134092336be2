"""The enclosing torchrun launch, as its environment tells it (no torch import): one process of several
that run the same command line."""

from __future__ import annotations

import os


def world() -> int | None:
    """WORLD_SIZE of an enclosing torchrun launch, or None when not launched by one."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def shared_rank() -> int | None:
    """This process's RANK where a torchrun launch runs the command in more than one process (their
    stdout and stderr are one stream), else None."""
    size = world()
    return int(os.environ["RANK"]) if size is not None and size > 1 else None
