"""Done records and manifest.json: what a run finished, so --resume can skip it and anyone can check it.

Each finished rank file gets a done record (OUT/.dsv41-convert/<file>.done.json: size, sha256, the plan
digest). manifest.json is written last, once every rank file of the plan has one: sha256 and size of
every output file, the source index digest and revision, and the options used.

A run that finishes only some rank files (--ranks, a torchrun share on one machine of several) leaves a
manifest fragment instead; `dsv41-convert manifest OUT` merges the gathered fragments (manifest_merge.py).
Unfinished files have a resume journal beside their done records (journal.py).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsv41_convert.progress import Progress
from dsv41_convert.store.file_digest import Recorded, mismatches, sha256_file
from dsv41_convert.store.own_files import open_own

DONE_DIR = ".dsv41-convert"
MANIFEST = "manifest.json"
FRAGMENT_GLOB = "manifest-fragment-*.json"  # what a share of the ranks leaves instead (manifest_merge.py)
FORMAT = "dsv41-convert manifest v1"
SIDECARS = ("tokenizer.json", "tokenizer_config.json")
HF_CONFIG = "hf_config.json"  # the source's HF config.json, as shard copies it beside the rank files
REQUIRED_SIDECARS = ("config.json", HF_CONFIG)  # beside every shard conversion's rank files
SIDE_FILES = (*REQUIRED_SIDECARS, *SIDECARS)


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary name, fsync, rename: the file is either absent, old or complete. An OSError
    names `path` (a full disk said only "No space left on device", a read-only folder named the temporary
    NAME.PID.partial: audits), and the temporary is removed."""
    tmp = temporary_of(path)
    try:
        with open(open_own(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # named as the file it writes: its temporary's name meant nothing to a user
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def atomic_write_changed(path: Path, data: bytes) -> None:
    """atomic_write, unless `path` already holds `data`: a file that is right is left as it is (a download's
    record and ref in an HF cache that holds the download whole, mounted read-only: its second run failed)."""
    try:
        if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
            return
    except OSError:
        pass  # unreadable: written, and atomic_write's error names it
    atomic_write(path, data)


_TEMPORARY = re.compile(r"(.+)\.\d+\.partial")  # temporary_of's NAME.PID.partial
NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, tmpfs)
_SUFFIX_ROOM = len(".4194304.partial")  # the longest .PID.partial: Linux's pid_max is at most 2**22


def temporary_stem(name: str) -> str:
    """`name` as its temporary NAME.PID.partial holds it: whole, or cut at a character so that the temporary
    fits NAME_MAX bytes whatever the PID (a reference file named with 252 bytes was computed, then refused at
    the save: "...safetensors.27654.partial: File name too long")."""
    while len(os.fsencode(name)) + _SUFFIX_ROOM > NAME_MAX:
        name = name[:-1]
    return name


def temporary_of(path: Path) -> Path:
    """This process's temporary for `path` (atomic_write's, the reference file's): NAME.PID.partial beside it,
    since the processes of a torchrun launch write the same files; NAME is temporary_stem's."""
    return path.with_name(f"{temporary_stem(path.name)}.{os.getpid()}.partial")


def temporary_target(name: str) -> str | None:
    """NAME when `name` is a temporary NAME.PID.partial (temporary_of's; NAME is the target's temporary_stem),
    else None."""
    found = _TEMPORARY.fullmatch(name)
    return found.group(1) if found else None


def remove_stale_temporaries(folder: Path, ours: Callable[[str], bool]) -> list[str]:
    """Delete atomic_write's temporaries left by a run that died while writing a small file: in the record
    folder all of them, in `folder` those whose target's temporary_stem `ours` names (anything else of that shape is a
    user's: `thesis.2024.partial`). A rank file's own NAME.partial is resume state: kept. Only for a writer
    that holds the folder alone (store/lock.py), so none is another writer's. -> the names deleted"""
    gone = []
    for where, mine in ((Path(folder), ours), (Path(folder) / DONE_DIR, lambda name: True)):
        for path in where.iterdir() if where.is_dir() else ():
            target = temporary_target(path.name)
            if target is not None and mine(target) and path.is_file():
                path.unlink()
                gone.append(path.name)
    return gone


def fsync_path(path: Path) -> None:
    """Put `path` on the disk: a file's data, or a folder's entries (a rename, a new file), so that it
    survives power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def done_path(out: Path, file: str) -> Path:
    return out / DONE_DIR / f"{file}.done.json"


def write_done(out: Path, file: str, size: int, sha256: str, plan_digest: str, source: str | None = None) -> None:
    """`file` is finished: its size, sha256 and plan digest; `source`: the stamps digest of the source it was written
    from (source_stamps.stamps_digest), where known (not for records a merge imports from another machine)."""
    (out / DONE_DIR).mkdir(exist_ok=True)
    record = {"file": file, "size": size, "sha256": sha256, "plan_digest": plan_digest}
    if source is not None:
        record["source"] = source
    atomic_write(done_path(out, file), json.dumps(record, indent=1).encode())


def read_done(out: Path, file: str) -> dict[str, Any] | None:
    """`file`'s done record, or None where there is none or it is not one (damaged, edited: the file is then
    written again, as if unfinished)."""
    try:
        rec = json.loads(done_path(out, file).read_bytes())
    except (FileNotFoundError, ValueError):  # ValueError: not JSON, not UTF-8
        return None
    fields = {"size": int, "sha256": str, "plan_digest": str}
    if not isinstance(rec, dict) or not all(type(rec.get(k)) is t for k, t in fields.items()):
        return None
    return rec


def finished(out: Path, files: list[str], plan_digest: str, progress: Progress | None = None) -> set[str]:
    """The files of `files` that are finished: a done record names this plan, and their size and sha256
    still match it (files hashed in parallel: file_digest.mismatches; progress(file, bytes hashed, size))."""
    recorded = {}
    for file in files:
        rec = read_done(out, file)
        if rec is not None and rec.get("plan_digest") == plan_digest:
            recorded[file] = (out / file, Recorded(rec["size"], rec["sha256"], "its done record"))
    return {file for file, problem in mismatches(recorded, progress=progress).items() if problem is None}


def source_revision(src: Path) -> str | None:
    """The Hub revision when the source is a huggingface_hub snapshot folder (.../snapshots/<sha>/)."""
    m = re.search(r"/snapshots/([0-9a-f]{40})(/|$)", str(src))
    return m.group(1) if m else None


def source_info(plan) -> dict[str, Any]:
    """What the manifest says about the source: folder, index digest, Hub revision, format."""
    return {
        "path": plan.src,
        "index_sha256": plan.index_sha256,
        "revision": source_revision(Path(plan.src)),
        "format": plan.source_format,
    }


def write_manifest(out: Path, plan, options: dict[str, Any], extra_files: list[str]) -> Path:
    """manifest.json from the done records of every rank file and the hashes of `extra_files`."""
    files = {}
    for f in plan.files:
        rec = read_done(out, f.file)
        files[f.file] = {"size": rec["size"], "sha256": rec["sha256"]}
    return write_manifest_from(out, source_info(plan), options, plan.digest(), files, extra_files)


def write_manifest_from(
    out: Path,
    source: dict[str, Any],
    options: dict[str, Any],
    plan_digest: str,
    rank_files: dict[str, dict[str, Any]],
    extra_files: list[str],
) -> Path:
    """manifest.json from known rank file records ({file: {size, sha256}}) and the hashes of `extra_files`."""
    files = {name: {"size": rec["size"], "sha256": rec["sha256"]} for name, rec in rank_files.items()}
    for name in sorted(extra_files):  # one order whoever writes it (a merge listed config.json first: an audit)
        path = out / name
        files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {
        "format": FORMAT,
        "source": source,
        "options": options,
        "plan_digest": plan_digest,
        "files": files,
    }
    path = out / MANIFEST
    atomic_write(path, (json.dumps(manifest, indent=2) + "\n").encode())
    return path
