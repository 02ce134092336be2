"""Fetch a checkpoint from the Hugging Face Hub, check every byte, re-fetch only what is wrong.

Built on huggingface_hub (2.x): files go through hf-xet where the repo and the installed packages allow
it, else over HTTP, where a dropped connection resumes by Range; into --local-dir, the bytes an HTTP
transfer received also survive the process (`hub_fetch._fetch_resumable`), so a killed run continues
mid-file. In the HF cache, and for files hf-xet fetches, they do not: huggingface_hub 2.x writes each file
to a temporary of its own process, so a killed run fetches those files again from byte 0. Around it we add
what a 510 GB download needs:

- a --local-dir is ours to write only where it holds nothing else: files at the revision's paths that are
  not its bytes (the user's, another revision's) are refused before the first byte unless `overwrite`;

- one metadata call (`model_info(files_metadata=True)`) pins the commit and gives every file's size,
  LFS sha256 and git blob id; it is saved as a record beside the files, so the folder can be checked
  later without network (`verify_local`);
- a free-space check before the first byte (bytes already in partial files count as there), and a file
  over 50 GB refused up front when hf-xet is not there to fetch it;
- every fetched file is hashed against the record by its worker, files already there after the
  transfers; safetensors headers and the index are cross-checked, and only the files found wrong are
  deleted and fetched again. One still wrong after `repair_rounds` re-fetches is deleted and reported
  (exit 1 in the CLI): no file with wrong bytes keeps a shard's name;
- Ctrl-C stops the transfers at their next chunk (at most GRACE_S later the run leaves them), keeping
  partial files for the next run;
- Hub and network failures become `DownloadError`s that say what to do (HF_TOKEN, revision, file).

Files go to `local_dir` when given, else into the HF cache (HF_HOME / HF_HUB_CACHE), whose snapshot
folder is returned. HF_HUB_OFFLINE=1 turns `download` into a check of what is already there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import re
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath

from huggingface_hub import HfApi
from huggingface_hub._local_folder import LocalDownloadFilePaths
from huggingface_hub.utils import WeakFileLock

from dsv41_convert import interrupts
from dsv41_convert.errors import DownloadError, first_few
from dsv41_convert.file_kinds import nearest_existing, refuse_non_folder
from dsv41_convert.hub.fetch import (
    PARTIAL_DIR,
    fetch_file,
    fetch_record,
    partial_bytes,
    partial_path,
    remove_file,
    xet_refusal,
)
from dsv41_convert.hub.hf_metadata import METADATA_DIR
from dsv41_convert.hub.hub_errors import NoRoom
from dsv41_convert.hub.integrity import (
    EVERY_FILE,
    Problem,
    Record,
    RemoteFile,
    Selection,
    check_files,
    selected,
    wanted,
)
from dsv41_convert.hub.local import (
    COMMIT,
    RECORD_NAME,
    DownloadReport,
    NotCached,
    Place,
    Progress,
    check_repo_id,
    checks_made,
    listing,
    local_place,
    offline,
    own_path,
    place_of,
    storage_of,
    structure_problems,
    verify_local,
)
from dsv41_convert.numbers import byte_amounts, counted
from dsv41_convert.store.lock import hold, refuse_held
from dsv41_convert.store.made_folder import made_folder
from dsv41_convert.store.manifest import atomic_write_changed

GRACE_S = 1.0  # after Ctrl-C, how long the transfers get to reach a chunk boundary before the run leaves them
REPO_REF = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[^\s@]+))?")

__all__ = ["RECORD_NAME", "DownloadReport", "download", "parse_repo_ref", "resolve_source", "verify_local"]


def parse_repo_ref(src: str) -> tuple[str, str | None] | None:
    """Split a Hub reference `owner/name[@rev]` into (repo_id, rev or None); None if `src` is not one."""
    m = REPO_REF.fullmatch(src)
    return (m["repo"], m["rev"]) if m else None


def source_repo_ref(src: str | Path) -> tuple[str, str | None]:
    """(repo_id, rev or None) of a `src` that is no existing path; DownloadError if it is no repo id either."""
    ref = parse_repo_ref(str(src))
    if ref is None:
        raise DownloadError(f"{src}: no such folder, and not a Hub repo id (owner/name or owner/name@revision)")
    return ref


def download_command(repo_id: str, revision: str | None, *options: str) -> str:
    """The `dsv41-convert download` command line that fetches `repo_id` at `revision` (None: main), as advice:
    an owner/name@rev SRC advised a download without --revision, which fetched main."""
    pinned = ("--revision", revision) if revision else ()
    return " ".join(("dsv41-convert download", repo_id, *pinned, *options))


def resolve_source(
    src: str | Path,
    *,
    local_dir: Path | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    check_config: Callable[[Path], None] | None = None,
) -> Path:
    """A local checkpoint folder for `src`: an existing path as is, or a repo id "owner/name[@rev]" downloaded
    (into `local_dir`, else the HF cache) and verified first. For `plan` and `shard`.

    check_config: called with the repo's config.json, fetched alone before anything else, so that a run
    the config already rules out (a tp the model cannot run) stops before the shards are downloaded.
    """
    path = Path(src)
    if path.exists():
        return path
    ref = source_repo_ref(src)
    where = {"revision": ref[1], "local_dir": local_dir, "token": token, "endpoint": endpoint, "cache_dir": cache_dir}
    try:
        if check_config is not None:
            first = _checked_out(ref[0], download(ref[0], include=["config.json"], progress=progress, **where))
            check_config(first.folder / "config.json")
        report = download(ref[0], progress=progress, **where)
    except NotCached as exc:  # download's advice names its --local-dir, which this command has not
        raise DownloadError(
            f"{src}: no such folder; as a Hub repo id: {exc.where}; download it first "
            f"(`{download_command(*ref)}`), or give the downloaded folder as SRC"
        ) from exc
    except NoRoom as exc:  # the same: "pick --local-dir" was a usage error here
        raise DownloadError(
            f"{src}: no such folder; as a Hub repo id: {exc.where}; free space, or download it onto a larger disk "
            f"(`{download_command(*ref, '--local-dir', 'DIR')}`) and give DIR as SRC"
        ) from exc
    except DownloadError as exc:
        raise DownloadError(f"{src}: no such folder; as a Hub repo id: {exc}") from exc
    return _checked_out(ref[0], report).folder


def _checked_out(repo_id: str, report: DownloadReport) -> DownloadReport:
    """`report`, or a DownloadError listing its problems."""
    if not report.ok:
        offline_note = "; HF_HUB_OFFLINE is set: unset it to fetch what is missing or wrong" if report.offline else ""
        raise DownloadError(
            f"{repo_id}: the downloaded checkpoint does not check out: {listing(report.problems)}{offline_note}"
        )
    return report


# --- download ---


def check_download(
    repo_id: str,
    *,
    revision: str | None = None,
    local_dir: Path | None = None,
    cache_dir: Path | None = None,
    verify_only: bool = False,
    overwrite: bool = False,
) -> None:
    """What `download` (`verify_only`, or HF_HUB_OFFLINE: verify_local) refuses before its first request or byte:
    a bad repo id; offline, --overwrite, and no folder to check; online, a --local-dir that is no folder (mkdir
    said only "File exists" of a file there) or that another run holds. Nothing is made or locked: the CLI asks
    before its progress display (a refusal after the banner read as if the download had started), and
    `download` asks again (it then holds the folder)."""
    if verify_only or offline():
        if overwrite and not verify_only:  # the check writes nothing: the option was ignored, silently (an audit)
            raise DownloadError(
                f"{repo_id}: HF_HUB_OFFLINE is set, so download only checks what is there and replaces nothing: "
                "unset it to replace files, or drop --overwrite"
            )
        local_place(repo_id, revision, local_dir, cache_dir)
        return
    check_repo_id(repo_id)
    if local_dir is not None:
        refuse_non_folder(Path(local_dir), DownloadError)
        if Path(local_dir).is_dir():
            refuse_held(Path(local_dir))


def download(
    repo_id: str,
    *,
    revision: str | None = None,
    local_dir: Path | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    max_workers: int = 8,
    token: str | None = None,
    endpoint: str | None = None,
    cache_dir: Path | None = None,
    retries: int = 3,
    backoff_s: float = 2.0,
    repair_rounds: int = 2,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> DownloadReport:
    """Download `repo_id` at `revision` (default main), verify every file, re-fetch what is wrong.

    A file still wrong after `repair_rounds` re-fetches (the Hub keeps serving bad bytes) is deleted and
    comes back in `report.problems`, as do problems the Hub's own files have (an index that names a shard
    the repo lacks, or other tensors than the shard holds). A file over 50 GB without hf-xet to fetch it is
    a DownloadError before the first byte. A `local_dir` is held alone from the first byte written to the
    end (store/lock.py): a second download into it fails at once. Files there that this download did not
    put there (another revision's, the user's own) are replaced only with `overwrite`: DownloadError before
    the first byte otherwise.
    """
    check_download(repo_id, revision=revision, local_dir=local_dir, cache_dir=cache_dir, overwrite=overwrite)
    if offline():
        report = verify_local(
            repo_id,
            revision=revision,
            local_dir=local_dir,
            include=include,
            exclude=exclude,
            cache_dir=cache_dir,
            workers=max_workers,
            progress=progress,
        )
        return report  # with its problems, as --verify-only: a check that fails, not an error
    with contextlib.ExitStack() as held:
        if local_dir is not None:  # a run refused before its first byte (no such repo) leaves no folder it made
            held.enter_context(made_folder(Path(local_dir)))
            held.enter_context(hold(Path(local_dir)))
        return _download(
            repo_id, revision, local_dir, include, exclude, max_workers, token, endpoint, cache_dir, retries,
            backoff_s, repair_rounds, progress, overwrite,
        )  # fmt: skip


def _download(
    repo_id: str,
    revision: str | None,
    local_dir: Path | None,
    include: Sequence[str],
    exclude: Sequence[str],
    max_workers: int,
    token: str | None,
    endpoint: str | None,
    cache_dir: Path | None,
    retries: int,
    backoff_s: float,
    repair_rounds: int,
    progress: Progress | None,
    overwrite: bool,
) -> DownloadReport:
    interrupts.check()  # one postponed since an import: before the listing, the removals and the transfers
    api = HfApi(endpoint=endpoint, token=token)
    record = fetch_record(api, repo_id, revision, retries=retries, backoff_s=backoff_s)
    asked = Selection(tuple(include), tuple(exclude))
    files = selected(record.files, (asked,))
    if not files:
        raise asked.matches_nothing(
            f"{repo_id}@{record.revision}", f"the revision has {counted(len(record.files), 'file')}"
        )
    place = place_of(record.repo_id, record.commit, local_dir, cache_dir)
    previous = _previous_record(place, record)
    ours = previous if previous is not None and previous.commit == record.commit else None
    checked: set[str] = set()
    fetched_before = ours.ours() if ours is not None else set()
    if local_dir is not None:
        _no_own_names(files, f"{repo_id}@{record.revision}")
        other = previous if ours is None else None
        _no_linked_folders(place.folder, files, overwrite)
        unclaimed = [f for f in files if f.path not in fetched_before]
        checked = _claim(place.folder, other, record, unclaimed, overwrite, max_workers, progress)
        _remove_stale_temporaries(Path(local_dir), files)
    selections = _union(record, ours.selections if ours else (), asked)
    names = _other_names(record.revision, ours)
    record = dataclasses.replace(
        record, selections=selections, fetched=tuple(sorted(fetched_before | checked)), names=names
    )

    placed: set[str] = set()  # files this run put at their names, checked
    moved: set[str] = set()  # files whose bytes this run transferred (the HF cache links a blob it holds)

    def fetch(batch: list[RemoteFile], force: bool) -> list[Problem]:
        def one(f: RemoteFile, stop: threading.Event) -> Problem | None:
            problem = fetch_file(
                repo_id,
                f,
                record.commit,
                local_dir=local_dir,
                cache_dir=cache_dir,
                endpoint=api.endpoint,
                token=token,
                force=force,
                retries=retries,
                backoff_s=backoff_s,
                progress=progress,
                stop=stop,
                on_transfer=lambda: moved.add(f.path),
            )
            if problem is None:
                placed.add(f.path)
            return problem

        return _fetch_all(batch, max_workers, one)

    missing, refetched = _to_fetch(place.folder, files)
    refusal = xet_refusal(repo_id, record.revision, missing)
    if refusal is not None:
        raise refusal
    held = sum(partial_bytes(Path(local_dir), f) for f in missing) if local_dir is not None else 0
    need = sum(f.size for f in missing if local_dir is not None or not _blob_held(place, f))
    _check_space(place.folder, need, held, repo_id)
    # saved before any file moves (an interrupted run is checked offline), naming only the files found right;
    # not before the refusals above: a refused run into a new folder left it holding a record (an audit)
    _save_record(record, place, local_dir, cache_dir)
    present = [f for f in files if f not in missing and f.path not in checked]
    try:
        problems = fetch(missing, False) + check_files(place.folder, present, workers=max_workers, progress=progress)
        problems, again = _repair(problems, files, place.folder, fetch, repair_rounds)
    except BaseException:
        # the files it did put there are the download's (a later --overwrite at another revision removes
        # them): recorded only at the end, a run that failed or was stopped left them unowned (an audit)
        if placed:
            fetched_now = tuple(sorted(record.ours() | placed))
            # unsaved where the disk that stopped the run is full: its error ("disk full", what to do) is
            # the one to raise, and the next run claims those files by their hashes
            with contextlib.suppress(OSError):
                _save_record(dataclasses.replace(record, fetched=fetched_now), place, local_dir, cache_dir)
        raise
    refetched += [f.path for f in again if f.path not in refetched]
    missing += [f for f in again if f not in missing]
    wrong = {p.path for p in problems}  # deleted after the re-fetches: not in the folder
    if local_dir is not None:
        _remove_stale_partials(Path(local_dir), record, [f for f in files if f.path not in wrong])
    # a file is the download's to replace once a run put it there right; asked for is not enough: a run that
    # stopped before fetching it left the user's own file at that path replaceable without --overwrite (an audit)
    fetched = (record.ours() | {f.path for f in files}) - wrong
    _save_record(dataclasses.replace(record, fetched=tuple(sorted(fetched))), place, local_dir, cache_dir)
    problems = _given_up(problems, repair_rounds) + _structure(place.folder, record, problems)
    return DownloadReport(
        repo_id,
        record.revision,
        record.commit,
        place.folder,
        len(files),
        sum(f.size for f in files),
        checks_made(record, record.selections, "sizes, sha256 / git ids from the Hub, headers"),
        False,
        fetched=tuple(f.path for f in missing if f.path in moved),
        refetched=tuple(refetched),
        problems=tuple(problems),
    )


def _previous_record(place: Place, record: Record) -> Record | None:
    """The record already where `record`'s files go; DownloadError if it is another repo's."""
    previous = Record.load(place.record)
    if previous is not None and previous.repo_id != record.repo_id:
        raise DownloadError(
            f"{place.folder}: already holds {previous.repo_id}; pick another --local-dir for {record.repo_id}"
        )
    return previous


def _claim(
    folder: Path,
    other: Record | None,
    record: Record,
    files: list[RemoteFile],
    overwrite: bool,
    workers: int,
    progress: Progress | None,
) -> set[str]:
    """The files of `files` a --local-dir already holds are not ours to replace (the user's own, another
    revision's: no earlier run at this commit fetched them) unless `overwrite`, nor is a folder that holds
    `other` commit's download. With `overwrite`, the files `other`'s runs fetched that this run does not ask
    for are removed (a shard of the old revision would be read beside the new ones).
    -> the paths of `files` already there and found right (hashed here, not again)."""
    where = f"{record.repo_id}@{record.revision} (commit {record.commit[:12]})"
    if other is not None and not overwrite:
        raise DownloadError(
            f"{folder}: holds revision {other.revision} (commit {other.commit[:12]}) of {other.repo_id}, "
            f"not {where}; --overwrite replaces its files with this revision's, or pick another --local-dir"
        )
    folders = [f.path for f in files if (folder / f.path).is_dir() and not (folder / f.path).is_symlink()]
    if folders:  # --overwrite replaces files, never a folder of the user's (the fetch failed on it, "Is a directory")
        raise DownloadError(f"{folder}: {first_few(folders)}: a folder where {where} has a file; move it away")
    # and the other way round: a file of the user's where the revision has a folder failed only once that
    # folder's first file was fetched whole ("File exists", maybe hours in: an audit)
    replaced = other.ours() if other is not None and overwrite else set()  # removed below, the old revision's
    in_the_way = sorted({str(p) for p in _folders_of(files) if str(p) not in replaced and _a_file_at(folder / p)})
    if in_the_way:
        raise DownloadError(f"{folder}: {first_few(in_the_way)}: a file where {where} has a folder; move it away")
    if overwrite:
        asked = {f.path for f in files}
        for path in replaced:  # what its runs put there, not the user's
            if path not in asked:
                remove_file(folder / path)
        return set()
    present = [f for f in files if (folder / f.path).exists() or (folder / f.path).is_symlink()]
    differ = check_files(folder, present, workers=workers, progress=progress)
    if differ:
        raise DownloadError(
            f"{folder}: holds {counted(len(differ), 'file', ('that is', 'that are'))} not {where}'s: "
            f"{listing(differ)}; "
            "--overwrite replaces them with the Hub's, or pick another --local-dir"
        )
    return {f.path for f in present}


OWN_FOLDERS = (".cache", str(PARTIAL_DIR), ".cache/huggingface", ".cache/huggingface/download")  # in a --local-dir


def _a_file_at(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _folders_of(files: list[RemoteFile]) -> set[str]:
    """The folders the files' paths go through, relative to the download's folder."""
    return {str(parent) for f in files for parent in PurePosixPath(f.path).parents if str(parent) != "."}


def _no_own_names(files: list[RemoteFile], where: str) -> None:
    """DownloadError naming the selected files whose paths are the --local-dir download's own: its record, the
    folder's lock and anything under .cache/ (its partial files, huggingface_hub's). Fetched, such a file was
    our record rather than the Hub's bytes, or was removed as a stale partial, and the run said ok (an audit:
    a mirror uploaded with its record)."""
    own = [f.path for f in files if own_path(f.path) or f.path == ".cache"]  # .cache: where its folder goes
    if own:
        raise DownloadError(
            f"{where}: {first_few(own)}: the download keeps its own files at these paths of a --local-dir (its "
            "record, its lock, .cache/); leave them out with --exclude (a path, or '.cache/*' for those under "
            ".cache), or download into the HF cache"
        )


def _no_linked_folders(folder: Path, files: list[RemoteFile], overwrite: bool) -> None:
    """A link to a folder in the --local-dir with files of the revision under it (`inference/` -> the user's
    own folder): the files would be written into what it points to (an audit saw the user's model.py
    replaced). DownloadError naming the links, or with `overwrite` each link replaced by a folder of the
    download's own; what a link points to is left as it is, as for a link to a file (fetch.remove_file)."""
    under = {*_folders_of(files), *OWN_FOLDERS}  # also where the download keeps its partial files (fetch.py)
    links = sorted(name for name in under if (folder / name).is_symlink())
    if not links:
        return
    if not overwrite:
        raise DownloadError(
            f"{folder}: {first_few(links)}: a link to a folder where the revision has files or the download keeps "
            "its partial ones: they would be written (and removed) in what it points to; --overwrite replaces the "
            "link with a folder of the download's own (what it points to stays as it is), or pick another --local-dir"
        )
    for name in links:  # the shallowest first: a link under a removed one is gone with it
        if (folder / name).is_symlink():
            (folder / name).unlink()


def _union(record: Record, before: tuple[Selection, ...], asked: Selection) -> tuple[Selection, ...]:
    """What the record keeps for --verify-only: this run's selection and the earlier runs' at its commit
    (`before`), so a narrower run (--include config.json) never narrows what the folder is checked for.
    Once they ask for every file of the revision together, the folder is checked as the whole revision
    (then any stray *.safetensors is one)."""
    selections = (*before, asked) if asked not in before else before
    if all(wanted(f.path, selections) for f in record.files):
        return (EVERY_FILE,)
    return selections


def _other_names(revision: str, ours: Record | None) -> tuple[str, ...]:
    """The names other than `revision` that earlier runs into the folder gave the same commit."""
    earlier = () if ours is None else (*ours.names, ours.revision)
    return tuple(sorted(set(earlier) - {revision}))


def _save_record(record: Record, place: Place, local_dir: Path | None, cache_dir: Path | None) -> None:
    """Save `record` where its files go, before any file moves, so an interrupted download can still be
    checked offline."""
    record.save(place.record)
    if local_dir is None and not COMMIT.fullmatch(record.revision):
        # the HF cache, as snapshot_download does: remember what the branch or tag pointed to, for offline use
        ref = storage_of(record.repo_id, cache_dir) / "refs" / record.revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_changed(ref, record.commit.encode())


def _blob_held(place: Place, file: RemoteFile) -> bool:
    """In the HF cache: whether `file`'s blob is already there (another revision's snapshot links it), so
    fetching it moves no bytes."""
    blob = place.folder.parent.parent / "blobs" / str(file.sha256 or file.git_sha1)
    return blob.is_file() and blob.stat().st_size == file.size


def _remove_stale_temporaries(local_dir: Path, files: list[RemoteFile]) -> None:
    """huggingface_hub's temporaries of `files` in a --local-dir (`.cache/huggingface/download/...incomplete`,
    of files hf-xet fetches) that a killed run left: huggingface_hub never continues them. Those of a file
    whose huggingface_hub lock another process holds (an `hf download` into the same folder) stay. The paths
    are get_local_download_paths's, made without its mkdir of each file's folders: called for every selected
    file, it left an empty folder in the --local-dir and under .cache/ for each folder of the revision, there
    for good where the run was then refused (no room) or the file held no temporary."""
    root = local_dir / METADATA_DIR
    if not root.is_dir():
        return
    for f in files:
        metadata = root / f"{f.path}.metadata"
        if not metadata.parent.is_dir():
            continue
        paths = LocalDownloadFilePaths(local_dir / f.path, metadata.with_suffix(".lock"), metadata)
        stem = paths.incomplete_path("E").name.removesuffix(".E.incomplete")
        found = list(paths.metadata_path.parent.glob(f"{glob.escape(stem)}.*.incomplete"))
        if not found:
            continue
        try:
            with WeakFileLock(paths.lock_path, timeout=0.1):
                for path in found:
                    path.unlink(missing_ok=True)
        except TimeoutError:  # filelock.Timeout: a download of the file runs now
            continue


def _remove_stale_partials(local_dir: Path, record: Record, done: list[RemoteFile]) -> None:
    """Partial files nobody will continue: those of files now whole (`done`), and those of no file of
    `record` (another revision's). Those of files outside this run's selection stay for their run."""
    keep = {partial_path(local_dir, f) for f in record.files} - {partial_path(local_dir, f) for f in done}
    root = local_dir / PARTIAL_DIR
    for path in root.rglob("*.partial"):
        if path not in keep:
            path.unlink(missing_ok=True)
    for folder in [*sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True), root]:
        with contextlib.suppress(OSError):  # not empty, or gone
            folder.rmdir()


def _repair(
    problems: list[Problem],
    files: list[RemoteFile],
    folder: Path,
    fetch: Callable[[list[RemoteFile], bool], list[Problem]],
    rounds: int,
) -> tuple[list[Problem], list[RemoteFile]]:
    """Delete each file with a problem and fetch it again, up to `rounds` times. -> (the problems left, whose
    files are deleted too: no wrong file keeps its name for plan or shard to take, every file re-fetched)."""
    again: list[RemoteFile] = []
    for _ in range(rounds):
        if not problems:
            break
        bad = [f for f in files if f.path in {p.path for p in problems}]
        for f in bad:
            remove_file(folder / f.path)
        again += [f for f in bad if f not in again]
        problems = fetch(bad, True)
    for p in problems:  # one fetched is gone already; one that was there and no round fetched again is not
        remove_file(folder / p.path)
    return problems, again


def _structure(folder: Path, record: Record, deleted: list[Problem]) -> list[Problem]:
    """structure_problems of the record's selection (this run's and the earlier runs' at its commit: a run
    of config.json alone into a whole download is still a whole checkpoint), saying which missing shards the
    revision lacks; a file deleted as wrong is reported by its problem, not again as missing."""
    gone = {p.path for p in deleted}
    listed = {f.path for f in record.files}
    paths = [f.path for f in record.selected()]
    found = structure_problems(folder, paths, record, record.selections)
    return [
        Problem(p.path, "missing", "not in the repo at this revision", p.expected)
        if p.kind == "missing" and p.path not in listed
        else p
        for p in found
        if p.path not in gone
    ]


def _to_fetch(folder: Path, files: list[RemoteFile]) -> tuple[list[RemoteFile], list[str]]:
    """-> (the files not in `folder`, the paths of those deleted for a wrong size). huggingface_hub's own
    "already there" check would trust a wrong-sized leftover: it is deleted and fetched again."""
    missing, wrong_size = [], []
    for f in files:
        path = folder / f.path
        if path.exists() and path.stat().st_size != f.size:
            remove_file(path)
            wrong_size.append(f.path)
        if not path.exists():
            missing.append(f)
    return missing, wrong_size


def _given_up(problems: list[Problem], rounds: int) -> list[Problem]:
    """The problems of files still wrong after `rounds` re-fetches, saying that they were deleted."""
    note = f"after {rounds} re-fetches, so deleted (the Hub may be serving a bad copy: rerun later)"
    return [dataclasses.replace(p, found=f"{p.found} {note}") for p in problems]


def _fetch_all(
    files: list[RemoteFile], workers: int, one: Callable[[RemoteFile, threading.Event], Problem | None]
) -> list[Problem]:
    """Run `one(file, stop)` over `files` on `workers` threads; -> the problems it returned, in file order.

    The first exception stops files from starting and is raised once those in flight end. An interrupt
    (KeyboardInterrupt here, from Ctrl-C or the CLI's SIGTERM handler) sets `stop`, which ends each transfer
    at its next chunk (hub_fetch.Stopped), waits at most GRACE_S for them and is raised. A thread still
    blocked in a read then is left behind: the threads are daemons, so the process exits without it, and
    what it wrote is a prefix of its file in a partial file (or huggingface_hub's temporary), which the
    next run continues (or discards). Once `stop` is set no transfer completes; a file huggingface_hub had
    already named (the HF cache, hf-xet) and that was still being hashed is removed unchecked (fetch.fetch_file;
    one it held before stays, for the next run to check).
    """
    todo = list(reversed(files))
    found: dict[str, Problem] = {}
    failed: list[BaseException] = []
    stop = threading.Event()

    def work() -> None:
        while not failed and not stop.is_set():
            try:
                f = todo.pop()
            except IndexError:
                return
            try:
                problem = one(f, stop)
            except BaseException as exc:  # for the main thread to raise
                failed.append(exc)
                return
            if problem is not None:
                found[f.path] = problem

    count = min(max(1, workers), len(files))
    threads = [threading.Thread(target=work, name=f"fetch-{i}", daemon=True) for i in range(count)]
    try:
        for t in threads:
            t.start()
        _wait(threads)
    except BaseException:
        stop.set()
        _wait(threads, GRACE_S)
        raise
    if failed:
        raise failed[0]
    return [found[f.path] for f in files if f.path in found]


def _wait(threads: list[threading.Thread], timeout: float | None = None) -> None:
    """Return once every thread has ended, or after `timeout` s. Polls is_alive(), since on Python 3.11 a
    Thread.join() that Ctrl-C interrupts marks its thread ended while it still runs (bpo-45274's cleanup
    releases the lock the running thread holds), and a later join() returns at once."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while any(t.is_alive() for t in threads) and (deadline is None or time.monotonic() < deadline):
        if deadline is None:
            interrupts.check()  # one that landed in an import of a fetch thread, or was dropped: the stop
        time.sleep(0.05)


def _check_space(folder: Path, need: int, held: int, repo_id: str) -> None:
    """DownloadError unless `folder`'s disk has room for `need` bytes less the `held` bytes partial files
    there already hold."""
    free = shutil.disk_usage(nearest_existing(folder)).free
    if need - held > free:
        counts = [need, free, need - held - free] + ([held] if held else [])
        need_said, free_said, short_said, *held_said = byte_amounts(*counts)
        have = f" ({held_said[0]} of them already in partial files)" if held else ""
        raise NoRoom(f"{repo_id}: {need_said} to download into {folder}{have}, but only {free_said} free there, "
                     f"{short_said} short")  # fmt: skip
