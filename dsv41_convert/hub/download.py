"""Fetch a checkpoint from the Hugging Face Hub, check every byte, re-fetch only what is wrong.

Built on huggingface_hub (2.x): files go through hf-xet where the repo and the installed packages allow
it, else over HTTP, where a dropped connection resumes by Range; into --local-dir, the received bytes
also survive the process (`hub_fetch._fetch_resumable`), so a killed run continues mid-file.
Around it we add what a 510 GB download needs:

- one metadata call (`model_info(files_metadata=True)`) pins the commit and gives every file's size,
  LFS sha256 and git blob id; it is saved as a record beside the files, so the folder can be checked
  later without network (`verify_local`);
- a free-space check before the first byte;
- after the transfer every file is hashed against the record, safetensors headers and the index are
  cross-checked, and only the files found wrong are deleted and fetched again;
- Hub and network failures become `DownloadError`s that say what to do (HF_TOKEN, revision, file).

Files go to `local_dir` when given, else into the HF cache (HF_HOME / HF_HUB_CACHE), whose snapshot
folder is returned. HF_HUB_OFFLINE=1 turns `download` into a check of what is already there.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import nullcontext
from pathlib import Path

from huggingface_hub import HfApi

from dsv41_convert.errors import DownloadError
from dsv41_convert.hub.fetch import PARTIAL_DIR, fetch_file, fetch_record
from dsv41_convert.hub.integrity import Problem, Record, RemoteFile, check_files
from dsv41_convert.hub.local import (
    COMMIT,
    RECORD_NAME,
    WHOLE,
    DownloadReport,
    Progress,
    check_repo_id,
    listing,
    offline,
    place_of,
    selected,
    storage_of,
    structure_problems,
    verify_local,
)
from dsv41_convert.store.lock import hold

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
            first = download(ref[0], include=["config.json"], progress=progress, **where)
            check_config(first.folder / "config.json")
        report = download(ref[0], progress=progress, **where)
    except DownloadError as exc:
        raise DownloadError(f"{src}: no such folder; as a Hub repo id: {exc}") from exc
    if not report.ok:
        raise DownloadError(f"{ref[0]}: the downloaded checkpoint does not check out: {listing(report.problems)}")
    return report.folder


# --- download ---


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
) -> DownloadReport:
    """Download `repo_id` at `revision` (default main), verify every file, re-fetch what is wrong.

    Files whose hash is still wrong after `repair_rounds` re-fetches raise DownloadError (the Hub keeps
    serving bad bytes). Problems the Hub's own files have (an index that names a shard the repo lacks,
    or other tensors than the shard holds) come back in `report.problems`. A `local_dir` is held alone
    from the first byte written to the end (store/lock.py): a second download into it fails at once.
    """
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
        if not report.ok:
            raise DownloadError(
                f"{repo_id}: HF_HUB_OFFLINE is set and the local copy in {report.folder} is not "
                f"whole: {listing(report.problems)}; unset HF_HUB_OFFLINE to fetch the rest"
            )
        return report
    check_repo_id(repo_id)
    if local_dir is not None:
        Path(local_dir).mkdir(parents=True, exist_ok=True)
    with hold(Path(local_dir)) if local_dir is not None else nullcontext():
        return _download(
            repo_id, revision, local_dir, include, exclude, max_workers, token, endpoint, cache_dir, retries,
            backoff_s, repair_rounds, progress,
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
) -> DownloadReport:
    api = HfApi(endpoint=endpoint, token=token)
    record = fetch_record(api, repo_id, revision, retries=retries, backoff_s=backoff_s)
    place = place_of(repo_id, record.commit, local_dir, cache_dir)
    previous = Record.load(place.record)
    if previous is not None and previous.repo_id != repo_id:
        raise DownloadError(f"{place.folder}: already holds {previous.repo_id}; pick another --local-dir for {repo_id}")
    record = dataclasses.replace(record, include=tuple(include), exclude=tuple(exclude))
    record.save(place.record)  # first, so an interrupted download can still be checked offline
    if local_dir is None and not COMMIT.fullmatch(record.revision):
        # as snapshot_download does: remember what the branch or tag pointed to, for offline use
        ref = storage_of(repo_id, cache_dir) / "refs" / record.revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(record.commit)
    files = selected(record.files, include, exclude)
    if not files:
        raise DownloadError(
            f"{repo_id}@{record.revision}: no file matches --include {list(include)} "
            f"--exclude {list(exclude)} (the revision has {len(record.files)} files)"
        )

    def fetch(batch: list[RemoteFile], force: bool) -> None:
        _fetch_all(
            batch,
            max_workers,
            lambda f: fetch_file(
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
            ),
        )

    # a wrong-sized leftover would be trusted by huggingface_hub's own "already there" check: drop it
    missing, refetched = [], []
    for f in files:
        path = place.folder / f.path
        if path.exists() and path.stat().st_size != f.size:
            _remove(path)
            refetched.append(f.path)
        if not path.exists():
            missing.append(f)
    _check_space(place.folder, sum(f.size for f in missing), repo_id)
    fetch(files, force=False)

    problems = check_files(place.folder, files, workers=max_workers, progress=progress)
    for _ in range(repair_rounds):
        if not problems:
            break
        bad = [f for f in files if f.path in {p.path for p in problems}]
        for f in bad:
            _remove(place.folder / f.path)
        refetched += [f.path for f in bad if f.path not in refetched]
        missing += [f for f in bad if f not in missing]
        fetch(bad, force=True)
        problems = check_files(place.folder, bad, workers=max_workers, progress=progress)
    if problems:
        raise DownloadError(
            f"{repo_id}@{record.commit}: still wrong after {repair_rounds} re-fetches: "
            f"{listing(problems)}; the Hub may be serving a bad copy, retry later"
        )

    if local_dir is not None:  # all files are whole: what is left in the partial folder is stale
        shutil.rmtree(Path(local_dir) / PARTIAL_DIR, ignore_errors=True)
    paths = [f.path for f in files]
    listed = {f.path for f in record.files}
    structural = structure_problems(place.folder, paths, record, include, exclude)
    structural = [
        Problem(p.path, "missing", "not in the repo at this revision", p.expected)
        if p.kind == "missing" and p.path not in listed
        else p
        for p in structural
    ]
    return DownloadReport(
        repo_id,
        record.revision,
        record.commit,
        place.folder,
        len(files),
        sum(f.size for f in files),
        f"sizes, sha256 / git ids from the Hub, headers, index, {WHOLE}",
        False,
        fetched=tuple(f.path for f in missing),
        refetched=tuple(refetched),
        problems=tuple(structural),
    )


def _fetch_all(files: list[RemoteFile], workers: int, one: Callable[[RemoteFile], None]) -> None:
    """Run `one` over `files` on `workers` threads; the first failure cancels what has not started."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(one, f) for f in files]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = [fut.exception() for fut in futures if fut.done() and not fut.cancelled() and fut.exception()]
        if failed:
            pool.shutdown(wait=True, cancel_futures=True)
            raise failed[0]


def _remove(path: Path) -> None:
    """Delete a file; in the HF cache also the blob its snapshot link points to."""
    if path.is_symlink():
        target = path.resolve()
        path.unlink()
        target.unlink(missing_ok=True)
    else:
        path.unlink(missing_ok=True)


def _check_space(folder: Path, need: int, repo_id: str) -> None:
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise DownloadError(
            f"{repo_id}: {need / 1e9:.2f} GB to download into {folder}, but only {free / 1e9:.2f} GB free there; "
            "free space or pick --local-dir on a larger disk"
        )
