"""What a path that should be a regular file is instead: reading a FIFO blocks until a writer comes (an
audit found plan, verify and reference-logits waiting forever on one), a device never ends."""

from __future__ import annotations

from pathlib import Path

SPECIAL = "a FIFO, a socket or a device"


def special_kind(path: Path) -> str | None:
    """SPECIAL where `path` is a FIFO, a socket or a device (links followed); None for a regular file, a
    folder, or nothing there (each said where it is read)."""
    path = Path(path)
    return SPECIAL if path.exists() and not (path.is_file() or path.is_dir()) else None


def refuse_special(path: Path, error: type[Exception]) -> None:
    """`error` naming `path` where it is a FIFO, a socket or a device, before anything opens it."""
    kind = special_kind(path)
    if kind:
        raise error(f"{path}: not a regular file ({kind}); put the file itself there, or remove it")
