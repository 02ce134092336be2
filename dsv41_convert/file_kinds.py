"""What a path that should be a regular file is instead: reading a FIFO blocks until a writer comes (an
audit found plan, verify and reference-logits waiting forever on one), a device never ends."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

SPECIAL = "a FIFO, a socket or a device"
DANGLING = "a link that leads to no file (its target is missing, or it leads in a loop)"


def special_kind(path: Path) -> str | None:
    """SPECIAL where `path` is a FIFO, a socket or a device (links followed); None for a regular file, a
    folder, or nothing there (each said where it is read)."""
    path = Path(path)
    return SPECIAL if path.exists() and not (path.is_file() or path.is_dir()) else None


def refuse_non_file(path: Path, error: type[Exception]) -> None:
    """`error` naming `path` where it is a FIFO, a socket, a device, a folder or a link that leads in a loop or
    to no file, before anything opens it (a folder was "No such device (os error 19)", a loop "No such file", a
    link to a deleted file "missing": audits). Nothing there is left to the caller, which says it in its own
    words."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(
                f"{path}: not a regular file (a link that leads in a loop); put the file itself there"
            ) from None
        if exc.errno == errno.ENOENT and path.is_symlink():
            raise error(
                f"{path}: not a regular file (a link that leads to no file: its target is missing); put the file "
                "itself there, or remove the link"
            ) from None
        return
    kind = "a folder" if stat.S_ISDIR(mode) else None if stat.S_ISREG(mode) else SPECIAL
    if kind:
        raise error(f"{path}: not a regular file ({kind}); put the file itself there, or remove it")


def nearest_existing(path: Path, *, links: bool = False) -> Path:
    """`path`, or the nearest path above it that exists (links followed); with `links`, a link on the way
    stops the walk too, dangling or not, so that the caller can name it. The root ends every walk."""
    here = Path(path)
    while not (here.exists() or (links and here.is_symlink())) and here != here.parent:
        here = here.parent
    return here


def refuse_unmakeable(path: Path, error: type[Exception]) -> None:
    """`error` where `path` cannot be made because the nearest existing path above it is no folder (`afile/r`:
    mkdir said "afile: File exists", an audit)."""
    above = nearest_existing(Path(path).parent, links=True)
    if above.is_symlink() and not above.exists():
        raise error(f"{above}: a link to {os.readlink(above)}, which does not exist, so {path} cannot be made in it")
    if not above.is_dir():
        raise error(f"{above}: Not a directory, so {path} cannot be made in it")


def refuse_non_folder(path: Path, error: type[Exception]) -> None:
    """`error` where `path`, a folder to write into, is a link to nothing or exists and is no folder (mkdir said
    only "File exists" of either: an audit), or cannot be made (refuse_unmakeable)."""
    if path.is_symlink() and not path.exists():
        raise error(f"{path}: a link to {os.readlink(path)}, which does not exist; give a folder path")
    if path.exists() and not path.is_dir():
        raise error(f"{path}: exists and is not a folder; give a folder path")
    refuse_unmakeable(path, error)
