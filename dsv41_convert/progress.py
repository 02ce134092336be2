"""The progress callback every long-running library function takes (library code never prints)."""

from collections.abc import Callable

Progress = Callable[[str, int, int], None]
"""progress(label, done, total): `label` names a unit of work (an output file); done/total in bytes."""
