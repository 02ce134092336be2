"""The Hub calls behind `download`: one metadata call, one file fetch and its check, bounded retries, and
the translation of Hub and network failures into `DownloadError`s that say what to do next.

huggingface_hub already resumes a dropped HTTP transfer by Range (a few times, while bytes keep
coming); the retries here cover what it gives up on (refused connections, a Hub that stays down).
A fetch stops at the next chunk once its `stop` event is set (`Stopped`): Ctrl-C must not wait for a
10 GB file to finish.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from huggingface_hub import HfApi, constants, get_token, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import HfFileMetadata, get_hf_file_metadata, http_get
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils._runtime import is_xet_available  # same test hf_hub_download makes

from dsv41_convert.errors import DownloadError
from dsv41_convert.hub.integrity import Problem, Record, RemoteFile
from dsv41_convert.progress import Progress
from dsv41_convert.store.file_digest import Recorded, difference

try:  # huggingface_hub 2.x ships its own httpx fork; 1.x used httpx
    from httpx2 import NetworkError, RemoteProtocolError, TimeoutException, TransportError
except ImportError:  # pragma: no cover
    from httpx import NetworkError, RemoteProtocolError, TimeoutException, TransportError

# faults worth another try; other transport errors (a bad URL, a proxy refusal) will not go away
_FLAKY = (NetworkError, TimeoutException, RemoteProtocolError, ConnectionError, TimeoutError)

T = TypeVar("T")
_TOKENS_URL = "https://huggingface.co/settings/tokens"


def fetch_record(api: HfApi, repo_id: str, revision: str | None, *, retries: int, backoff_s: float) -> Record:
    """Resolve `revision` to a commit and list every file with size, LFS sha256 and git blob id."""
    rev = revision or "main"
    info = with_retries(
        lambda: api.model_info(repo_id, revision=revision, files_metadata=True),
        retries=retries,
        backoff_s=backoff_s,
        on_error=lambda exc: hub_error(exc, repo_id=repo_id, revision=rev, endpoint=api.endpoint),
    )
    files = []
    for s in info.siblings or ():
        if s.size is None and s.lfs is None:
            raise DownloadError(f"{repo_id}@{rev}: the Hub gave no size for {s.rfilename}; retry later")
        size = s.lfs.size if s.lfs is not None else s.size
        files.append(RemoteFile(s.rfilename, int(size), s.lfs.sha256 if s.lfs is not None else None, s.blob_id))
    return Record(repo_id, rev, str(info.sha), tuple(sorted(files, key=lambda f: f.path)))


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
) -> Problem | None:
    """Download one file of the pinned commit and check it against `file` (size, then sha256 or git blob id).

    -> None when the file is at its final name and checks out; else what differs, and nothing is left at
    its final name. Into `local_dir`, a file served over plain HTTP goes through `_fetch_resumable`: it is
    checked before it gets its name, and a run killed mid-file continues where it stopped. Everything else
    (the HF cache, files hf-xet fetches) goes through `hf_hub_download`, which names the file itself: it is
    checked right after, and deleted if wrong. Once `stop` is set, raises Stopped at the next chunk.
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
        if local_dir is not None and not by_xet:
            return _fetch_resumable(file, url, meta, Path(local_dir), token=token, progress=progress, stop=stop)
        path = hf_hub_download(
            repo_id,
            file.path,
            revision=commit,
            local_dir=local_dir,
            cache_dir=cache_dir,
            endpoint=endpoint,
            token=token,
            force_download=force,
            tqdm_class=_bar_class(file.path, progress, stop),
        )
        problem = _check(Path(path), file, stop)
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
    """Delete a file; in the HF cache also the blob its snapshot link points to."""
    if path.is_symlink():
        target = path.resolve()
        path.unlink()
        target.unlink(missing_ok=True)
    else:
        path.unlink(missing_ok=True)


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
    with partial.open("ab") as out:
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


def with_retries(
    call: Callable[[], T], *, retries: int, backoff_s: float, on_error: Callable[[BaseException], DownloadError | None]
) -> T:
    """`call()`, again up to `retries` times after a network fault or a 429/5xx, waiting backoff_s * 2**k.

    Other failures are not retried. A failure `on_error` can explain becomes that DownloadError; anything
    else propagates unchanged, since it is a bug.
    """
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as exc:
            if attempt < retries and is_transient(exc):
                time.sleep(backoff_s * 2**attempt)
                continue
            err = on_error(exc)
            if err is None:
                raise
            if is_transient(exc):
                err = DownloadError(f"{err} (after {attempt + 1} attempts)")
            raise err from exc
    raise AssertionError("unreachable")  # the loop returns or raises


def _chain(exc: BaseException) -> list[BaseException]:
    out, cur = [], exc
    while cur is not None and len(out) < 16:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def is_transient(exc: BaseException) -> bool:
    """A network fault or a Hub hiccup (429, 5xx): worth another try."""
    for e in _chain(exc):
        if isinstance(e, OfflineModeIsEnabled):
            return False
        if isinstance(e, _FLAKY):
            return True
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            code = e.response.status_code
            return code == 429 or code >= 500
    return False


def hub_error(
    exc: BaseException,
    *,
    repo_id: str,
    revision: str,
    endpoint: str,
    path: str | None = None,
    folder: Path | None = None,
) -> DownloadError | None:
    """A DownloadError explaining `exc` with a next step, or None if `exc` is not a Hub, network or disk failure."""
    where = f"{repo_id}@{revision}" + (f": {path}" if path else "")
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return DownloadError(
                f"{where}: disk full while writing into {folder or 'the HF cache'} (ENOSPC); "
                "free space or pick --local-dir on a larger disk, then rerun: finished files are kept"
            )
    for e in _chain(exc):
        if isinstance(e, OfflineModeIsEnabled):
            return DownloadError(
                f"{where}: HF_HUB_OFFLINE is set, so nothing can be fetched; unset it or use "
                "--verify-only on a folder you already have"
            )
        if isinstance(e, HfHubHTTPError):
            return _http_error(e, where, repo_id=repo_id, revision=revision, endpoint=endpoint, path=path)
        if isinstance(e, TransportError | ConnectionError | TimeoutError):
            return DownloadError(
                f"{where}: network error talking to {endpoint} ({type(e).__name__}: {e}); "
                "check the connection or HF_ENDPOINT and rerun: finished files are kept"
            )
    for e in _chain(exc):
        if isinstance(e, OSError) and "Consistency check failed" in str(e):
            return DownloadError(f"{where}: the transfer ended short of the size the Hub announced; rerun")
        if isinstance(e, OSError) and e.errno is not None:
            return DownloadError(f"{where}: {e.strerror} ({e.filename or folder}); check the target folder")
    return None


def _http_error(
    e: HfHubHTTPError, where: str, *, repo_id: str, revision: str, endpoint: str, path: str | None
) -> DownloadError:
    code = e.response.status_code if e.response is not None else None
    message = (e.response.headers.get("X-Error-Message") if e.response is not None else None) or ""
    token = get_token()
    token_hint = (
        f"HF_TOKEN is not set: set it to a read token from {_TOKENS_URL}"
        if token is None
        else "your token (HF_TOKEN or `hf auth login`) has no access to it: check the token and its account"
    )
    if isinstance(e, GatedRepoError):
        return DownloadError(
            f"{where}: gated repo, access not granted ({code}); accept its conditions at "
            f"{endpoint}/{repo_id} while logged in, then set HF_TOKEN to a read token of that account"
        )
    if code == 401 and "Invalid credentials" in message:
        return DownloadError(
            f"{where}: the Hub refused the token (401 invalid credentials); HF_TOKEN holds an "
            f"invalid or expired token: make a new one at {_TOKENS_URL}"
        )
    if isinstance(e, RevisionNotFoundError):
        return DownloadError(
            f"{repo_id}: revision {revision!r} not found (404); give a branch, tag or full "
            "commit hash of the repo with --revision"
        )
    if isinstance(e, RemoteEntryNotFoundError) or (code == 404 and path is not None):
        return DownloadError(
            f"{where}: file not found on the Hub (404) although the revision lists it; the repo "
            "may be mid-upload: retry later, or pin --revision to an earlier commit"
        )
    if isinstance(e, RepositoryNotFoundError) or code in (401, 404):
        if code == 401:
            return DownloadError(
                f"{where}: unauthorized (401): the repo is private, gated or does not exist; {token_hint}"
            )
        return DownloadError(
            f"{where}: repository not found (404) on {endpoint}; check the name (owner/name)"
            + ("; if it is private, set HF_TOKEN" if token is None else "")
        )
    if code == 403:
        return DownloadError(f"{where}: forbidden (403{': ' + message if message else ''}); {token_hint}")
    if code == 429:
        return DownloadError(
            f"{where}: rate-limited by the Hub (429); wait and rerun, or set HF_TOKEN for a higher limit"
        )
    if code is not None and code >= 500:
        return DownloadError(f"{where}: the Hub answered {code}; it may be down, rerun later")
    return DownloadError(f"{where}: the Hub answered {code}: {message or e}")


def _bar_class(label: str, progress: Progress | None, stop: threading.Event | None = None) -> type:
    """A tqdm stand-in for huggingface_hub that forwards (label, done, total) bytes to `progress`, and raises
    Stopped once `stop` is set: http_get updates its bar before it writes each chunk, so a stopped transfer
    ends at a chunk boundary (its temporary or partial file a prefix of the file) and never completes."""

    class _Bar:
        def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **kwargs: Any) -> None:
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
