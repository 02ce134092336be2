"""The names of rank files: `model{rank}-mp{tp}.safetensors`, upstream convert.py's; every module reads them here."""

from __future__ import annotations

import re

RANK_FILE = re.compile(r"model(\d+)-mp(\d+)\.safetensors")  # rank_file_name's names: (rank, tp)


def rank_file_name(rank: int, tp: int) -> str:
    """The file of rank `rank` of a tp-`tp` conversion (upstream convert.py's name)."""
    return f"model{rank}-mp{tp}.safetensors"
