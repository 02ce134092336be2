"""The names of rank files: `model{rank}-mp{tp}.safetensors`, upstream convert.py's; every module reads them here."""

from __future__ import annotations

import re
from pathlib import Path

RANK_FILE = re.compile(r"model(\d+)-mp(\d+)\.safetensors")  # rank_file_name's names: (rank, tp)


def rank_file_name(rank: int, tp: int) -> str:
    """The file of rank `rank` of a tp-`tp` conversion (upstream convert.py's name)."""
    return f"model{rank}-mp{tp}.safetensors"


def rank_files_in(folder: Path) -> dict[int, set[int]]:
    """tp -> the ranks whose files `folder` holds (regular files named `model{rank}-mp{tp}.safetensors`), one
    listing of the folder; {} for a folder without any."""
    found: dict[int, set[int]] = {}
    for p in Path(folder).iterdir():
        if (m := RANK_FILE.fullmatch(p.name)) and p.is_file():
            found.setdefault(int(m[2]), set()).add(int(m[1]))
    return found
