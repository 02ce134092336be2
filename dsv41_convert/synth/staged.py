"""make-tiny's output folder: a checkpoint in place whole, or OUT as it was.

OUT is made if missing, with any missing folders above it (all removed again if the run fails), and held as
every writer holds its folder (store/lock.py: a second run into it is refused). The files are written into a
hidden folder inside OUT (`.make-tiny.partial-XXXX`: the same filesystem, whatever OUT is mounted on, and
nothing written beside OUT) and moved in by rename at the end, with signals postponed: the old index and
shards first removed, each new file put in place, the new index last (a folder without its index is no
checkpoint to a loader, nor one with part of its shards), then the old files the new checkpoint does not
have. A failure before that (a full disk: an error naming OUT; Ctrl-C; SIGTERM) removes the hidden folder
and leaves OUT's files as they were; --overwrite needs room for both.

`--overwrite` replaces a folder that holds nothing but what make-tiny leaves there: its files by exact
name (regular files; `.partial` ones of an interrupted run of before), its lock and its hidden folders, and
only where its mark is (`.dsv41-make-tiny`, written with every checkpoint): a copy of real shards under the
same names is no output of make-tiny's.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from dsv41_convert import interrupts
from dsv41_convert.errors import OutputError
from dsv41_convert.file_kinds import refuse_non_folder
from dsv41_convert.store.lock import LOCK_NAME, hold, refuse_held
from dsv41_convert.store.made_folder import made_folder
from dsv41_convert.store.manifest import fsync_path

INDEX = "model.safetensors.index.json"
STAGE = ".make-tiny.partial-"
MARK = ".dsv41-make-tiny"  # in OUT: make-tiny wrote the checkpoint there; --overwrite replaces nothing else
_FIXED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", INDEX)
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def writes(name: str) -> bool:
    """Whether make-tiny writes a file of this name (config, tokenizer files, index, a shard)."""
    return name in _FIXED_FILES or _SHARD.fullmatch(name) is not None


def _left_by_us(p: Path) -> bool:
    """An entry of OUT that a make-tiny run leaves or may have left there."""
    if p.is_symlink():
        return False
    if p.is_dir():
        return p.name.startswith(STAGE)
    return p.is_file() and (p.name in (LOCK_NAME, MARK) or writes(p.name.removesuffix(".partial")))


def check_out(out: Path, overwrite: bool) -> Path:
    """OutputError unless make-tiny may put a checkpoint at `out`. -> the folder it goes to, absolute (a
    link to a folder: that folder)"""
    refuse_non_folder(out, OutputError)
    out = out.resolve() if out.is_symlink() else out.absolute()
    entries = [p for p in out.iterdir() if p.name != LOCK_NAME] if out.is_dir() else []
    # what --overwrite refuses is refused first, without it too: "not empty; pass --overwrite" was said of a
    # folder of a user's files or of real shards, where --overwrite then refused (an audit)
    foreign = sorted(p.name for p in entries if not _left_by_us(p))
    if foreign:
        raise OutputError(
            f"{out}: holds what make-tiny does not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); --overwrite replaces only a folder of make-tiny's files "
            "(config, tokenizer, index, model-NNNNN-of-NNNNN.safetensors, no links or folders): pick another"
        )
    files = [p.name for p in entries if not p.is_dir()]  # hidden stage folders alone: an interrupted first run
    if files and not (out / MARK).is_file():
        raise OutputError(
            f"{out}: no {MARK}, so not a checkpoint make-tiny wrote (a copy of real shards? one written before "
            f"2026-12-04?); --overwrite replaces only make-tiny's own output: remove the folder yourself, or pick "
            "another"
        )
    if entries and not overwrite:
        raise OutputError(f"{out}: not empty; pass --overwrite to replace a checkpoint there, or pick a new folder")
    return out


def refuse_out(out: Path, overwrite: bool) -> Path:
    """What `staged` refuses of `out` as found, before it holds it: another run writing there (named as a held
    folder, not as "not empty"), then check_out. Nothing is made or locked: the CLI calls it before its progress
    display (a refusal after the display's title read as if the run had started). -> check_out's folder"""
    if out.is_dir():
        refuse_held(out)
    return check_out(out, overwrite)


@contextmanager
def staged(out: Path, overwrite: bool) -> Iterator[Path]:
    """A fresh hidden folder inside `out` to write the checkpoint into, moved in when the block ends without
    an error (see the module docstring). An OSError while writing (a full disk) becomes an OutputError
    naming `out`."""
    out = refuse_out(Path(out), overwrite)
    with made_folder(out) as made:
        try:
            with hold(out):
                check_out(out, overwrite)  # again, now that no other run writes here
                stage = Path(tempfile.mkdtemp(prefix=STAGE, dir=out))
                try:
                    try:
                        yield stage
                    except OSError as exc:
                        if exc.filename is not None:
                            raise
                        said = f"{exc.strerror or exc} while writing the checkpoint"
                        raise OutputError(f"{out}: {said}; {out} is as it was") from exc
                    (stage / MARK).write_text(
                        "written by `dsv41-convert make-tiny`: its --overwrite replaces the checkpoint in this "
                        "folder\n",
                        encoding="utf-8",
                    )
                    with interrupts.deferred():
                        _move_in(stage, out, made)
                finally:
                    shutil.rmtree(stage, ignore_errors=True)
        except BaseException:
            if made:  # then made_folder removes OUT and the folders made above it, where nothing else came
                _remove_ours(out)
            raise


def _remove_ours(out: Path) -> None:
    """What make-tiny leaves in `out` (see _left_by_us) removed; anything else put there during the run stays."""
    with suppress(OSError):
        for p in [p for p in out.iterdir() if _left_by_us(p)]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _move_in(stage: Path, out: Path, made: bool) -> None:
    """The checkpoint in `stage` put in place in `out` (see the module docstring); `made`: this run made `out`
    (a failure removes it again)."""
    new = {p.name for p in stage.iterdir()}
    old = [
        p
        for p in out.iterdir()
        if p.is_file() and not p.is_symlink() and _SHARD.fullmatch(p.name.removesuffix(".partial"))
    ]
    had_one = (out / INDEX).exists() or bool(old)
    (out / INDEX).unlink(missing_ok=True)  # no checkpoint here until the new index is in
    # nor a whole set of shard names without it (a loader takes model-k-of-n files without an index): a kill
    # between the renames left old and new shards under one set of names (an audit)
    for p in old:
        p.unlink()
    fsync_path(out)  # the removals before the first new shard, also after a power loss
    try:
        for name in sorted(new - {INDEX}):
            os.replace(stage / name, out / name)
        os.replace(stage / INDEX, out / INDEX)
    except OSError as exc:  # said as the rename's error alone, OUT's state unsaid (an audit)
        failed = (
            f"{out}: moving the new checkpoint in failed at {Path(exc.filename or '?').name} ({exc.strerror or exc})"
        )
        if made:  # staged() removes the folder it made
            raise OutputError(f"{failed}; {out} is removed again: run make-tiny again") from exc
        gone = ", after the old checkpoint's index and shards were removed" if had_one else ""
        raise OutputError(
            f"{failed}{gone}: {out} holds no whole checkpoint; run make-tiny again with --overwrite"
        ) from exc
    for p in out.iterdir():  # what the old checkpoint had and this one has not; stale hidden folders
        # make-tiny's own only: a file something else put in OUT during the run is kept (an `rm -r` of a
        # folder of yours, exit 0, in a bug hunt)
        if p.name not in new and p.name != LOCK_NAME and p != stage and _left_by_us(p):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    fsync_path(out)
