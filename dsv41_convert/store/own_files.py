"""Files of ours opened for writing by name, never through a link planted at that name: written through, a
link sent the bytes into what it points to (a source shard, or any file: an audit)."""

from __future__ import annotations

import os
from pathlib import Path


def open_own(path: Path, flags: int) -> int:
    """os.open(path, flags | O_CREAT | O_NOFOLLOW, 0o644), a link at `path` removed first (what it points to is
    left as it is); O_NOFOLLOW makes a link put there in between an error, not a target written. -> the fd"""
    if path.is_symlink():
        path.unlink()
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o644)
