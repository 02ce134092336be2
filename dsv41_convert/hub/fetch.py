"""The Hub calls behind `download`: one metadata call, one file fetch and its check, with the bounded retries
and error messages of hub_errors.py.

huggingface_hub already resumes a dropped HTTP transfer by Range (a few times, while bytes keep
coming); the retries here cover what it gives up on (refused connections, a Hub that stays down).
A fetch stops at the next chunk once its `stop` event is set (`Stopped`): Ctrl-C must not wait for a
10 GB file to finish.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from huggingface_hub import HfApi, constants, hf_hub_download, hf_hub_url
from huggingface_hub.file_download import HfFileMetadata, get_hf_file_metadata, http_get
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils._runtime import is_xet_available  # same test hf_hub_download makes

from dsv41_convert.errors import DownloadError
from dsv41_convert.hub.hub_errors import hub_error, with_retries
from dsv41_convert.hub.integrity import Problem, Record, RemoteFile, repo_path_problem
from dsv41_convert.hub.local import COMMIT
from dsv41_convert.progress import Progress
from dsv41_convert.store.file_digest import Recorded, difference
from dsv41_convert.store.own_files import open_own


def fetch_record(api: HfApi, repo_id: str, revision: str | None, *, retries: int, backoff_s: float) -> Record:
    """Resolve `revision` to a commit and list every file with size, LFS sha256 and git blob id."""
    rev = revision or "main"
    try:
        info = with_retries(
            lambda: api.model_info(repo_id, revision=revision, files_metadata=True),
            retries=retries,
            backoff_s=backoff_s,
            on_error=lambda exc: hub_error(exc, repo_id=repo_id, revision=rev, endpoint=api.endpoint),
        )
    except (KeyError, TypeError, AttributeError) as exc:  # ModelInfo of JSON that is not the Hub's
        raise _not_the_hub(repo_id, rev, api.endpoint, f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(info.sha, str) or not COMMIT.fullmatch(info.sha):
        raise _not_the_hub(repo_id, rev, api.endpoint, f"commit {info.sha!r}")
    files = []
    for s in info.siblings or ():
        why = repo_path_problem(s.rfilename)
        if why is not None:
            raise _not_the_hub(repo_id, rev, api.endpoint, f"a file named {s.rfilename!r}: {why}")
        if s.size is None and s.lfs is None:
            raise DownloadError(f"{repo_id}@{rev}: the Hub gave no size for {s.rfilename}; retry later")
        if s.lfs is None and s.blob_id is None:  # then nothing but its size could be checked, silently
            raise _not_the_hub(repo_id, rev, api.endpoint, f"no blobId (git blob id) for {s.rfilename}")
        size = s.lfs.size if s.lfs is not None else s.size
        files.append(RemoteFile(s.rfilename, int(size), s.lfs.sha256 if s.lfs is not None else None, s.blob_id))
    return Record(repo_id, rev, str(info.sha), tuple(sorted(files, key=lambda f: f.path)))


def _not_the_hub(repo_id: str, revision: str, endpoint: str, what: str) -> DownloadError:
    return DownloadError(
        f"{repo_id}@{revision}: {endpoint} answered the model-info call with JSON that is not the Hub's ({what}); "
        "check HF_ENDPOINT and any proxy in between, then rerun"
    )


_OVER_HTTP_LIMIT = (
    f"over the {constants.MAX_HTTP_DOWNLOAD_SIZE / 1e9:.0f} GB huggingface_hub fetches over plain HTTP: "
    "only hf-xet fetches a file that large"
)


class Stopped(Exception):
    """Raised inside a fetch whose `stop` event is set (the run was interrupted), at a chunk boundary: it
    unwinds the transfer, and a partial file keeps the bytes written so far."""


def xet_refusal(repo_id: str, revision: str, files: list[RemoteFile]) -> DownloadError | None:
    """Without hf-xet, huggingface_hub refuses any file over MAX_HTTP_DOWNLOAD_SIZE (50 GB): the error naming
    those of `files`, or None if hf-xet is usable or none is that large. Known before the first byte."""
    big = [f for f in files if f.size > constants.MAX_HTTP_DOWNLOAD_SIZE]
    if not big or is_xet_available():
        return None
    why = "HF_HUB_DISABLE_XET is set: unset it" if constants.HF_HUB_DISABLE_XET else "install it (pip install hf_xet)"
    sizes = ", ".join(f"{f.path} ({f.size / 1e9:.1f} GB)" for f in big)
    return DownloadError(f"{repo_id}@{revision}: {sizes}: {_OVER_HTTP_LIMIT}; {why}, then rerun")


def fetch_file(
    repo_id: str,
    file: RemoteFile,
    commit: str,
    *,
    local_dir: Path | None,
    cache_dir: Path | None,
    endpoint: str,
    token: str | None,
    force: bool,
    retries: int,
    backoff_s: float,
    progress: Progress | None,
    stop: threading.Event,
    on_transfer: Callable[[], None] | None = None,
) -> Problem | None:
    """Download one file of the pinned commit and check it against `file` (size, then sha256 or git blob id).

    -> None when the file is at its final name and checks out; else what differs, and nothing is left at
    its final name. Into `local_dir`, a file served over plain HTTP goes through `_fetch_resumable`: it is
    checked before it gets its name, and a run killed mid-file continues where it stopped. Everything else
    (the HF cache, files hf-xet fetches) goes through `hf_hub_download`, which names the file itself: it is
    checked right after, and deleted if wrong. Once `stop` is set, raises Stopped at the next chunk.
    `on_transfer` is called where bytes were transferred (or an empty file made): not for a file or blob
    huggingface_hub found in place (another cached revision's, or one another process fetched meanwhile).
    """
    url = hf_hub_url(repo_id, file.path, revision=commit, endpoint=endpoint)

    def attempt() -> Problem | None:
        meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
        by_xet = meta.xet_file_data is not None and is_xet_available()
        if not by_xet and file.size > constants.MAX_HTTP_DOWNLOAD_SIZE:
            raise DownloadError(
                f"{repo_id}@{commit}: {file.path} ({file.size / 1e9:.1f} GB): {_OVER_HTTP_LIMIT}, and the Hub "
                "does not serve it through hf-xet; retry later, or ask the repo's owner"
            )
        if meta.size is not None and meta.size != file.size:  # no bytes it serves can check out
            raise DownloadError(
                f"{repo_id}@{commit}: {file.path}: the server serves {meta.size} bytes where the Hub's listing "
                f"announced {file.size}; rerun (a proxy or mirror serving another file? HF_ENDPOINT?)"
            )
        if local_dir is not None and not by_xet:
            problem = _fetch_resumable(file, url, meta, Path(local_dir), token=token, progress=progress, stop=stop)
            if on_transfer is not None:
                on_transfer()
            return problem
        bar = _bar_class(file.path, progress, stop)
        path = hf_hub_download(
            repo_id,
            file.path,
            revision=commit,
            local_dir=local_dir,
            cache_dir=cache_dir,
            endpoint=endpoint,
            token=token,
            force_download=force,
            tqdm_class=bar,
        )
        if (bar.transfers or file.size == 0) and on_transfer is not None:  # an empty one is made, without a bar
            on_transfer()
        try:
            problem = _check(Path(path), file, stop)
        except Stopped:
            # named by huggingface_hub, not checked: any other reader of the HF cache took a corrupt blob as the
            # Hub's file (an audit: Ctrl-C during the hash of a bad transfer). Bytes this call did not transfer
            # (held before, or finished by another process while this one waited on huggingface_hub's lock)
            # are left as they were.
            if bar.transfers:
                remove_file(Path(path))
            raise
        if problem is not None:
            remove_file(Path(path))
        return problem

    return with_retries(
        attempt,
        retries=retries,
        backoff_s=backoff_s,
        on_error=lambda exc: hub_error(
            exc, repo_id=repo_id, revision=commit, path=file.path, endpoint=endpoint, folder=local_dir or cache_dir
        ),
    )


def remove_file(path: Path) -> None:
    """Delete a file; for an HF-cache snapshot link (`STORAGE/snapshots/COMMIT/...` -> `STORAGE/blobs/ID`)
    also the blob it points to. Any other link is removed alone: what it points to is not ours (a
    --local-dir of links into the HF cache or shared storage)."""
    if path.is_symlink():
        target = path.resolve()
        path.unlink()
        if _is_snapshot_link_target(path, target):
            target.unlink(missing_ok=True)
    else:
        path.unlink(missing_ok=True)


def _is_snapshot_link_target(link: Path, target: Path) -> bool:
    """Whether `link` lies in the snapshots of the HF-cache storage whose blobs hold `target`."""
    storage = target.parent.parent
    return target.parent.name == "blobs" and any(
        p.name == "snapshots" and p.parent.resolve() == storage for p in link.absolute().parents
    )


def _check(path: Path, file: RemoteFile, stop: threading.Event) -> Problem | None:
    """What differs between the file at `path` and `file` (size, then digest), or None; Stopped between
    chunks once `stop` is set."""

    def on_bytes(done: int) -> None:
        if stop.is_set():
            raise Stopped

    return difference(path, file.path, Recorded(file.size, file.sha256, "Hub", git_sha1=file.git_sha1), on_bytes)


PARTIAL_DIR = Path(".cache") / "dsv41-partial"


def partial_path(local_dir: Path, file: RemoteFile) -> Path:
    """Where `_fetch_resumable` keeps the bytes of `file` received so far; named by the file's hash, so a
    partial file of another revision is never continued with this one's bytes."""
    tag = (file.sha256 or file.git_sha1 or "unknown")[:16]
    return local_dir / PARTIAL_DIR / f"{file.path}.{tag}.partial"


def partial_bytes(local_dir: Path, file: RemoteFile) -> int:
    """Bytes of `file` a partial file already holds (0 if none, or if it is longer than the file: not a prefix)."""
    path = partial_path(local_dir, file)
    held = path.stat().st_size if path.is_file() else 0
    return held if held <= file.size else 0


def _fetch_resumable(
    file: RemoteFile,
    url: str,
    meta: HfFileMetadata,
    local_dir: Path,
    *,
    token: str | None,
    progress: Progress | None,
    stop: threading.Event,
) -> Problem | None:
    """HTTP download into a partial file that outlives the process, renamed into place once it checks out.

    huggingface_hub (2.4) writes each download to a temporary file of its own process and deletes it on
    failure, so a killed run restarts every unfinished file from byte 0. Here the bytes go to
    `partial_path(...)` and the next run asks only for the rest (Range), which matters on a 10 GB shard.
    A whole partial file that fails its check is deleted (never continued) and its problem returned.
    """
    headers = build_hf_headers(token=token)
    source = url
    if meta.xet_file_data is None and meta.location != url:
        source = meta.location  # the CDN: a signed URL, so our token stays on the Hub
        if urlsplit(source)[:2] != urlsplit(url)[:2]:
            headers.pop("authorization", None)
    partial = partial_path(local_dir, file)
    partial.parent.mkdir(parents=True, exist_ok=True)
    with open(open_own(partial, os.O_WRONLY | os.O_APPEND), "ab") as out:
        have = out.tell()
        if have > file.size:  # not a prefix of this file: start over
            out.truncate(0)
            have = 0
        http_get(
            source,
            out,
            resume_size=have,
            headers=headers,
            expected_size=file.size,
            displayed_filename=file.path,
            tqdm_class=_bar_class(file.path, progress, stop),
        )
    problem = _check(partial, file, stop)
    if problem is not None:
        partial.unlink()
        return problem
    dest = local_dir / file.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial.replace(dest)
    return None


def _bar_class(label: str, progress: Progress | None, stop: threading.Event | None = None) -> type:
    """A tqdm stand-in for huggingface_hub that forwards (label, done, total) bytes to `progress`, and raises
    Stopped once `stop` is set: http_get updates its bar before it writes each chunk, so a stopped transfer
    ends at a chunk boundary (its temporary or partial file a prefix of the file) and never completes.

    The class's `transfers` counts the bars made from it: huggingface_hub makes one only where it transfers
    bytes, never for a file or blob it finds in place."""

    class _Bar:
        transfers = 0

        def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **kwargs: Any) -> None:
            type(self).transfers += 1
            self.total = int(total or 0)
            self.n = int(initial or 0)
            self._emit()

        def _emit(self) -> None:
            if progress is not None:
                progress(label, self.n, self.total)

        def update(self, n: float | None = 1) -> None:
            if stop is not None and stop.is_set():
                raise Stopped
            self.n += int(n or 0)
            self._emit()

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def close(self) -> None:
            pass

        def refresh(self) -> None:
            pass

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

        def set_description(self, *args: Any, **kwargs: Any) -> None:
            pass

        def update_transfer(self, n: float | None = 1) -> None:
            pass

        def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

    return _Bar
