"""make-tiny's output folder, in place whole or not at all.

The checkpoint is written into a hidden folder beside OUT (`.OUT.partial-XXXX`) and renamed to OUT once
every file is written: a failure (a full disk, Ctrl-C, SIGTERM) removes it and leaves OUT as it was, and
a kill -9 leaves only the hidden folder. `--overwrite` replaces a folder that holds nothing but files
make-tiny writes (by exact name, regular files): OUT is moved aside, the new one renamed in, the old one
removed. Two runs into one OUT at once each end with a whole checkpoint there, the last one's.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsv41_convert.errors import OutputError
from dsv41_convert.store.publish import new_folder_mode

INDEX = "model.safetensors.index.json"
_FIXED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", INDEX)
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def writes(name: str) -> bool:
    """Whether make-tiny writes a file of this name (config, tokenizer files, index, a shard)."""
    return name in _FIXED_FILES or _SHARD.fullmatch(name) is not None


def check_out(out: Path, overwrite: bool) -> Path:
    """OutputError unless make-tiny may put a checkpoint at `out`. -> the folder it goes to (a link to a
    folder: that folder)"""
    if out.is_symlink() and not out.exists():
        raise OutputError(f"{out}: a link to {os.readlink(out)}, which does not exist; give a folder path")
    out = out.resolve() if out.is_symlink() else out
    above = out.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise OutputError(f"{above}: Not a directory, so {out} cannot be made in it")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: exists and is not a folder; give a folder path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise OutputError(f"{out}: not empty; pass --overwrite to replace a checkpoint there, or pick a new folder")
        foreign = sorted(p.name for p in out.iterdir() if p.is_symlink() or not p.is_file() or not writes(p.name))
        if foreign:
            raise OutputError(
                f"{out}: holds what make-tiny does not write ({', '.join(foreign[:5])}"
                f"{', ...' if len(foreign) > 5 else ''}); --overwrite replaces only a folder of make-tiny's files "
                "(config, tokenizer, index, model-NNNNN-of-NNNNN.safetensors, no links or folders): pick another"
            )
    return out


@contextmanager
def staged(out: Path, overwrite: bool) -> Iterator[Path]:
    """A fresh hidden folder beside `out` to write the checkpoint into, renamed to `out` when the block ends
    without an error (see the module docstring). An OSError while writing (a full disk) becomes an
    OutputError naming `out`."""
    out = check_out(Path(out), overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        try:
            yield stage
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise OutputError(f"{out}: {exc.strerror or exc} while writing the checkpoint; {out} is as it was") from exc
        os.chmod(stage, new_folder_mode())
        _put_in_place(stage, out, overwrite)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _put_in_place(stage: Path, out: Path, overwrite: bool) -> None:
    if out.is_dir() and any(out.iterdir()):
        check_out(out, overwrite)  # again: files may have come since the start
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
        os.rename(out, aside / out.name)
        os.rename(stage, out)
        shutil.rmtree(aside)
        return
    try:
        os.rename(stage, out)  # also onto an empty folder, which it replaces
    except OSError as exc:  # another run put files there meanwhile
        raise OutputError(f"{out}: files appeared there while this run wrote; nothing of this run was kept") from exc
