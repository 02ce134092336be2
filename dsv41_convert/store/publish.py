"""A finished temporary file put in place under its final name, as a file created by open() would be.

safetensors' `save_file` creates its file readable by its owner alone (mode 0600); every other file we write
gets the usual 0666 less the umask. `publish` gives a saved temporary that mode, puts its bytes on disk and
renames it: under its final name a file is complete, also after a power cut (where asked: `durable`).
"""

from __future__ import annotations

import os
from pathlib import Path

from dsv41_convert import interrupts
from dsv41_convert.store.manifest import fsync_path
from dsv41_convert.store.own_files import NEW_FILE


def new_file_mode() -> int:
    """NEW_FILE (0o666) less the process's umask: the mode open() gives a new file."""
    return NEW_FILE & ~_umask()


def new_folder_mode() -> int:
    """0o777 less the process's umask: the mode mkdir() gives a new folder (tempfile.mkdtemp's is 0o700)."""
    return 0o777 & ~_umask()


def _umask() -> int:
    try:
        with open("/proc/self/status") as status:  # Linux: read without changing it (no race with threads)
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration):
        umask = os.umask(0)
        os.umask(umask)
        return umask


def publish(tmp: Path, path: Path, durable: bool = True) -> None:
    """`tmp` (written and closed) -> `path`: the mode of a new file, fsync (unless not `durable`: data made
    again in seconds, as make-tiny's), rename. A process that took Ctrl-C or SIGTERM (interrupts.py) puts no
    file in place: `tmp` is removed and KeyboardInterrupt raised."""
    if interrupts.interrupted():
        tmp.unlink(missing_ok=True)
        interrupts.check()
    os.chmod(tmp, new_file_mode())
    if durable:
        fsync_path(tmp)
    os.replace(tmp, path)
