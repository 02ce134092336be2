"""What a path that should be a regular file is instead: reading a FIFO blocks until a writer comes (an
audit found plan, verify and reference-logits waiting forever on one), a device never ends."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

SPECIAL = "a FIFO, a socket or a device"


def special_kind(path: Path) -> str | None:
    """SPECIAL where `path` is a FIFO, a socket or a device (links followed); None for a regular file, a
    folder, or nothing there (each said where it is read)."""
    path = Path(path)
    return SPECIAL if path.exists() and not (path.is_file() or path.is_dir()) else None


def refuse_non_file(path: Path, error: type[Exception]) -> None:
    """`error` naming `path` where it is a FIFO, a socket, a device, a folder or a link that leads in a loop,
    before anything opens it (a folder was "No such device (os error 19)", a loop "No such file": an audit).
    Nothing there is left to the caller, which says it in its own words."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(
                f"{path}: not a regular file (a link that leads in a loop); put the file itself there"
            ) from None
        return
    kind = "a folder" if stat.S_ISDIR(mode) else None if stat.S_ISREG(mode) else SPECIAL
    if kind:
        raise error(f"{path}: not a regular file ({kind}); put the file itself there, or remove it")


def refuse_unmakeable(path: Path, error: type[Exception]) -> None:
    """`error` where `path` cannot be made because the nearest existing path above it is no folder (`afile/r`:
    mkdir said "afile: File exists", an audit)."""
    above = Path(path).parent
    while not above.exists() and not above.is_symlink() and above != above.parent:
        above = above.parent
    if above.is_symlink() and not above.exists():
        raise error(f"{above}: a link to {os.readlink(above)}, which does not exist, so {path} cannot be made in it")
    if not above.is_dir():
        raise error(f"{above}: Not a directory, so {path} cannot be made in it")
