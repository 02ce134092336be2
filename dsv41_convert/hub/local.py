"""Where a download lives on disk, and checking it there without network.

A download goes to `local_dir` (our record at `local_dir/.dsv41-download.json`) or to the HF cache
(`models--owner--name/snapshots/{commit}`, our record at `models--owner--name/.dsv41-download/{commit}.json`,
outside snapshots/ so huggingface_hub's cache scans never meet a file it did not write).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import constants
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import HFValidationError, validate_repo_id

from dsv41_convert.errors import CHECK_FAILED, DownloadError
from dsv41_convert.hub.hf_metadata import METADATA_DIR, HubMetadata, hub_metadata
from dsv41_convert.hub.integrity import (
    CONFIG_NAME,
    EVERY_FILE,
    Problem,
    Record,
    Selection,
    check_checkpoint,
    check_files,
    selected,
    wanted,
)
from dsv41_convert.numbers import counted
from dsv41_convert.progress import Progress
from dsv41_convert.store.index import INDEX_NAME
from dsv41_convert.store.lock import LOCK_NAME

RECORD_NAME = ".dsv41-download.json"
COMMIT = re.compile(r"[0-9a-f]{40}")
WHOLE = (  # integrity._check_whole, for the report's `checks`
    "whole checkpoint (config.json; every shard the index names, or without one the k-of-n its names count; "
    "no other *.safetensors; no tensor in two files)"
)


def checks_made(record: Record, selections: tuple[Selection, ...], said: str) -> str:
    """A report's `checks` for the files of `record` that `selections` ask for: the index and whole-checkpoint
    checks need config.json and the index among them (`--include "*.safetensors"` was said to have checked
    both), and a whole checkpoint is one of the files asked for (`--exclude "*.safetensors"` was said to have
    checked every shard the index names: an audit)."""
    asked = {f.path for f in selected(record.files, selections)}
    listed = {f.path for f in record.files}
    left = [name for name in (CONFIG_NAME, INDEX_NAME) if name not in asked and name in listed]
    if left:
        return (
            f"{said}; not checked: the index, and whether the checkpoint is whole ({' and '.join(left)} not selected)"
        )
    out = len(listed - asked)
    scope = (
        f" (of the {counted(len(asked), 'file')} asked for; {out} left out by --include/--exclude are not looked for)"
    )
    return f"{said}, index, {WHOLE}{scope if out else ''}"


@dataclass(frozen=True)
class DownloadReport:
    """What `download` or `verify_local` did and found. `problems` empty means every check passed."""

    repo_id: str
    revision: str | None  # as asked, or as recorded; None: not known (a --local-dir without our record)
    commit: str | None
    folder: Path
    files: int
    nbytes: int
    checks: str  # which checks ran, in words
    offline: bool = False
    fetched: tuple[str, ...] = ()  # every file transferred in this run
    refetched: tuple[str, ...] = ()  # of those, the ones that were on disk but wrong (size or hash)
    problems: tuple[Problem, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        """`download --json`'s document; its `exit_code` as check's."""
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "folder": str(self.folder),
            "files": self.files,
            "bytes": self.nbytes,
            "checks": self.checks,
            "offline": self.offline,
            "fetched": list(self.fetched),
            "refetched": list(self.refetched),
            "ok": self.ok,
            "exit_code": 0 if self.ok else CHECK_FAILED,
            "problems": [vars(p) for p in self.problems],
        }


# --- where things live ---


@dataclass(frozen=True)
class Place:
    folder: Path  # the checkpoint files
    record: Path  # our record of the revision


def place_of(repo_id: str, commit: str, local_dir: Path | None, cache_dir: Path | None) -> Place:
    if local_dir is not None:
        return Place(Path(local_dir), Path(local_dir) / RECORD_NAME)
    storage = storage_of(repo_id, cache_dir)
    return Place(storage / "snapshots" / commit, storage / ".dsv41-download" / f"{commit}.json")


def check_repo_id(repo_id: str) -> None:
    """DownloadError unless `repo_id` is a Hub repo id (owner/name; a revision goes in --revision)."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        repo, at, rev = repo_id.partition("@")
        if at and rev and _valid_repo_id(repo):  # plan/shard/export's SRC takes owner/name@rev; download does not
            raise DownloadError(
                f"{repo_id}: a revision goes in --revision here: `download {repo} --revision {rev}`"
            ) from None
        raise DownloadError(f"{repo_id}: not a Hub repo id ({exc})") from None


def _valid_repo_id(repo_id: str) -> bool:
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def storage_of(repo_id: str, cache_dir: Path | None) -> Path:
    return Path(cache_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def _cached_commit(repo_id: str, revision: str, cache_dir: Path | None) -> str | None:
    if COMMIT.fullmatch(revision):
        return revision
    ref = storage_of(repo_id, cache_dir) / "refs" / revision
    return ref.read_text(encoding="utf-8").strip() if ref.is_file() else None


class NotCached(DownloadError):
    """A revision the HF cache does not hold, checked offline; `where` says which, without the advice, which
    depends on the command (download's --local-dir, another command's SRC)."""

    def __init__(self, where: str) -> None:
        super().__init__(f"{where}; download it first, or give the folder with --local-dir")
        self.where = where


def offline() -> bool:
    env = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    return env or constants.HF_HUB_OFFLINE


# --- offline check ---


def local_place(repo_id: str, revision: str | None, local_dir: Path | None, cache_dir: Path | None) -> Place:
    """The folder (and record) verify_local checks: `local_dir`, else `revision`'s snapshot in the HF cache.
    Raises DownloadError (NotCached) where there is none: asked before any output (cli), as verify_local does."""
    check_repo_id(repo_id)
    if local_dir is not None:
        place = Place(Path(local_dir), Path(local_dir) / RECORD_NAME)
    else:
        rev = revision or constants.DEFAULT_REVISION
        commit = _cached_commit(repo_id, rev, cache_dir)
        if commit is None:
            raise NotCached(f"{repo_id}@{rev}: not in the HF cache ({storage_of(repo_id, cache_dir)})")
        place = place_of(repo_id, commit, None, cache_dir)
    if not place.folder.is_dir():
        what = "not a folder" if place.folder.exists() else "no such folder"
        raise DownloadError(f"{place.folder}: {what}; download {repo_id} first")
    return place


def verify_local(
    repo_id: str,
    *,
    revision: str | None = None,
    local_dir: Path | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    cache_dir: Path | None = None,
    workers: int = 4,
    progress: Progress | None = None,
) -> DownloadReport:
    """Check a downloaded folder without network: against our record when there is one (sizes and hashes),
    else from the files alone (safetensors headers, sizes implied by them, the index); either way, that the
    folder is a whole checkpoint (integrity._check_whole: config.json, every shard, no stray *.safetensors
    beside them, which the record does not list, no tensor in two files)."""
    place = local_place(repo_id, revision, local_dir, cache_dir)
    record = Record.load(place.record)
    if record is not None and record.repo_id != repo_id:
        raise DownloadError(f"{place.folder}: holds {record.repo_id} (per {place.record.name}), not {repo_id}")
    # in the HF cache `revision` found the snapshot through refs/ (huggingface_hub's too: `hf download --revision
    # v1` of the same commit) or is its hash: only a --local-dir's record says which names its files are of
    named = local_dir is not None and revision is not None
    if record is not None and named and revision not in (record.revision, record.commit, *record.names):
        raise DownloadError(
            f"{place.folder}: holds revision {record.revision} (commit {record.commit}), not {revision}; "
            "download that revision into another folder"
        )
    asked = Selection(tuple(include), tuple(exclude))
    if record is None:
        return _verify_without_record(repo_id, revision, place.folder, asked, workers, progress, local_dir is None)
    selections = (asked,) if include or exclude else record.selections  # by default, what was downloaded
    files = selected(record.files, selections)
    if not files:  # a glob that matches nothing checked nothing: it said ok (an audit), as a typo would
        raise asked.matches_nothing(
            f"{repo_id}@{record.revision}",
            f"the revision has {counted(len(record.files), 'file')}",
            "; nothing to check",
        )
    problems = check_files(place.folder, files, workers=workers, progress=progress)
    problems += structure_problems(place.folder, [f.path for f in files], record, selections)
    return DownloadReport(
        repo_id,
        record.revision,
        record.commit,
        place.folder,
        len(files),
        sum(f.size for f in files),
        checks_made(record, selections, "sizes, sha256 / git ids from the download record, headers"),
        True,
        problems=tuple(_dedup(problems)),
    )


def _verify_without_record(
    repo_id: str,
    revision: str | None,
    folder: Path,
    asked: Selection,
    workers: int,
    progress: Progress | None,
    resolved: bool,
) -> DownloadReport:
    """A folder we did not download: the digests huggingface_hub left where it has them (hf_metadata.py),
    the headers, the index and that the folder is a whole checkpoint always (no list of files says what
    should be there: the index and the shard names do). Which ran, and what none can see, is said in
    `checks`.

    resolved: `folder` was found by `revision` (the HF cache's refs/ or snapshot hash). Else (a --local-dir) a
    `revision` is checked against the commits huggingface_hub's metadata names, so only a commit hash can be,
    and only where there is such metadata: DownloadError otherwise (it said ok of a folder of another revision)."""
    paths = [p for p in _local_paths(folder) if asked.wants(p)]
    if not paths and (asked.include or asked.exclude):
        raise asked.matches_nothing(str(folder), then="; nothing to check")
    hub = hub_metadata(folder, paths)
    if revision is not None and not resolved and not (COMMIT.fullmatch(revision) and hub.commits):
        why = (
            f"{hub.where} name commits, not branches or tags: give the commit hash"
            if hub.commits
            else f"nor any digest of huggingface_hub's (no {METADATA_DIR.as_posix()}/*.metadata): drop --revision"
        )
        raise DownloadError(
            f"{folder}: no download record of ours, so whether it holds revision {revision} cannot be checked "
            f"offline; {why}"
        )
    if revision is not None and COMMIT.fullmatch(revision) and hub.commits - {revision}:
        raise DownloadError(
            f"{folder}: downloaded at commit {', '.join(sorted(hub.commits - {revision}))} (per {hub.where}), "
            f"not {revision}"
        )
    problems = check_files(folder, hub.files, workers=workers, progress=progress, where=hub.where)
    problems += _other_commits(hub)
    problems += drop_unwanted(check_checkpoint(folder, paths, whole=True), (asked,))
    nbytes = sum((folder / p).stat().st_size for p in paths)
    # without a record the revision's files are unknown: a whole checkpoint of the files the globs let through
    scope = " (of the files --include/--exclude let through: others are not looked for)"
    whole = WHOLE + (scope if asked != EVERY_FILE else "")
    if not hub.files:
        checks = (
            f"headers, the sizes they imply, index, {whole}: no download record, so no hashes; not checked: "
            f"the tensor bytes, that the folder is {repo_id}'s, and whether files besides config.json and the weights "
            "are missing"
        )
    else:
        unhashed = len(paths) - len(hub.files)
        headers_only = f"; headers only for {counted(unhashed, 'file')} it has no digest of" if unhashed else ""
        checks = (
            f"sha256 / git ids of {counted(len(hub.files), 'file')} from {hub.where} (no record of ours, so the repo "
            f"id is not checked){headers_only}; "
            f"headers, index, {whole}; not checked: whether files besides config.json and the weights are missing"
        )
    commit = next(iter(hub.commits)) if len(hub.commits) == 1 else None
    return DownloadReport(
        repo_id, revision or (constants.DEFAULT_REVISION if resolved else None), commit, folder, len(paths), nbytes,
        checks, True,
        problems=tuple(_dedup(problems)),
    )  # fmt: skip


def _other_commits(hub: HubMetadata) -> list[Problem]:
    """A folder huggingface_hub filled at several commits (`hf download --revision v1 --include <a shard>` into
    a folder of main) is no one revision, though each file matches its own ETag: one problem for each file
    not of the commit most files were downloaded at (a tie: the greater hash)."""
    if len(hub.commits) < 2:
        return []
    counts = Counter(hub.commit_of.values())
    main, n = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
    return [
        Problem(
            path,
            "commit",
            f"downloaded at commit {commit[:12]} (per {hub.where})",
            f"commit {main[:12]}, as {n} other files: one revision",
        )
        for path, commit in sorted(hub.commit_of.items())
        if commit != main
    ]


def own_path(rel: str) -> bool:
    """Whether `rel` (a path in a --local-dir) is the download's own: its record, the folder's lock, anything
    under .cache/ (its partial files, huggingface_hub's)."""
    return rel in (RECORD_NAME, LOCK_NAME) or rel.startswith(".cache/")


def _local_paths(folder: Path) -> list[str]:
    out = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not own_path(rel):
            out.append(rel)
    return out


def structure_problems(
    folder: Path, paths: list[str], record: Record, selections: Sequence[Selection]
) -> list[Problem]:
    """check_checkpoint(whole=True) of `paths` and of the top-level *.safetensors the record does not list
    (a stray copy `shard` would read), leaving out what `selections` filtered away."""
    listed = {f.path for f in record.files}
    strays = [p for p in _top_safetensors(folder) if p not in listed and wanted(p, selections)]
    return drop_unwanted(check_checkpoint(folder, paths + strays, whole=True), selections)


def _top_safetensors(folder: Path) -> list[str]:
    """The *.safetensors files at the top of `folder`: what `shard` reads, whoever put them there."""
    return sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())


def drop_unwanted(problems: list[Problem], selections: Sequence[Selection]) -> list[Problem]:
    """A shard the index names but the user filtered out is not missing."""
    return [p for p in problems if p.kind != "missing" or wanted(p.path, selections)]


def _dedup(problems: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for p in problems:
        if (p.path, p.kind) not in seen:
            seen.add((p.path, p.kind))
            out.append(p)
    return out


def listing(problems: Sequence[Problem], limit: int = 5) -> str:
    shown = "; ".join(str(p) for p in problems[:limit])
    return shown + (f"; and {len(problems) - limit} more" if len(problems) > limit else "")
