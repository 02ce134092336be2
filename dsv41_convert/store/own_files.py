"""Files of ours opened for writing by name, never through a link planted at that name: written through, a
link sent the bytes into what it points to (a source shard, or any file: an audit). A hard link is such a
link too: a file of ours with another name elsewhere is another file's bytes under our name, and a write
in place (a partial file appended to or truncated) changes that other file."""

from __future__ import annotations

import os
import stat
from pathlib import Path

NEW_FILE = 0o666  # less the umask, as open() gives (publish.new_file_mode): 0o644 ignored a umask 002's group write


def linked(st: os.stat_result) -> bool:
    """Whether an lstat result is a link: symbolic, or a regular file with more than one name."""
    return stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1)


def remove_link(path: Path) -> None:
    """Remove `path` where it is a link (`linked`), leaving what it points to, or its other names, as they are."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if linked(st):
        os.unlink(path)


def open_own(path: Path, flags: int) -> int:
    """os.open(path, flags | O_CREAT | O_NOFOLLOW, NEW_FILE), a link at `path` (`linked`) removed first; O_NOFOLLOW
    makes a symbolic link put there in between an error, not a target written. -> the fd"""
    remove_link(path)
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, NEW_FILE)
