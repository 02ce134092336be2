"""Hub and network failures as `DownloadError`s that say what to do next, and the bounded retries of the
ones worth another try (a network fault, 429, 5xx)."""

from __future__ import annotations

import errno
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from huggingface_hub import get_token
from huggingface_hub.errors import (
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from dsv41_convert.errors import DownloadError
from dsv41_convert.numbers import counted

try:  # huggingface_hub 2.x ships its own httpx fork; 1.x used httpx
    from httpx2 import NetworkError, RemoteProtocolError, TimeoutException, TransportError
except ImportError:  # pragma: no cover
    from httpx import NetworkError, RemoteProtocolError, TimeoutException, TransportError

# faults worth another try; other transport errors (a bad URL, a proxy refusal) will not go away
_FLAKY = (NetworkError, TimeoutException, RemoteProtocolError, ConnectionError, TimeoutError)

T = TypeVar("T")
_TOKENS_URL = "https://huggingface.co/settings/tokens"
_SIZES = re.compile(r"should be of size (?P<want>\d+) but has size (?P<got>\d+)")


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
                err = DownloadError(f"{err} (after {counted(attempt + 1, 'attempt')})")
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


class NoRoom(DownloadError):
    """Too little disk for the download, said before it starts or on ENOSPC while it writes; `where` says so
    without the advice, which depends on the command (download's --local-dir, another command's SRC: it has
    no --local-dir), as local.NotCached."""

    def __init__(self, where: str, then: str = "") -> None:
        super().__init__(f"{where}; free space or pick --local-dir on a larger disk{then}")
        self.where = where


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
            return NoRoom(
                f"{where}: disk full while writing into {folder or 'the HF cache'} (ENOSPC)",
                ", then rerun: finished files are kept",
            )
    for e in _chain(exc):
        if isinstance(e, OfflineModeIsEnabled):
            return DownloadError(
                f"{where}: HF_HUB_OFFLINE is set, so nothing can be fetched; unset it or use "
                "--verify-only on a folder you already have"
            )
        if isinstance(e, HfHubHTTPError):
            return _http_error(e, where, repo_id=repo_id, revision=revision, endpoint=endpoint, path=path)
        if isinstance(e, FileMetadataError):  # an OSError without an errno: it named no file
            return DownloadError(
                f"{where}: {endpoint} answered the file's metadata request without the Hub's headers ({e}); "
                "check HF_ENDPOINT and any proxy in between, then rerun"
            )
        if isinstance(e, TransportError | ConnectionError | TimeoutError):
            return DownloadError(
                f"{where}: network error talking to {endpoint} ({type(e).__name__}: {e}); "
                "check the connection or HF_ENDPOINT and rerun: finished files are kept"
            )
    for e in _chain(exc):
        if isinstance(e, OSError) and "Consistency check failed" in str(e):
            sizes = _SIZES.search(str(e))
            if sizes and int(sizes["got"]) > int(sizes["want"]):
                return DownloadError(
                    f"{where}: the server sent {sizes['got']} bytes where the Hub announced {sizes['want']}; "
                    "rerun (a proxy or mirror serving another file?)"
                )
            return DownloadError(f"{where}: the transfer ended short of the size the Hub announced; rerun")
    for e in _chain(exc):
        if isinstance(e, json.JSONDecodeError):
            return DownloadError(
                f"{where}: {endpoint} answered with something that is not the Hub's JSON ({e.msg}, at character "
                f"{e.pos}); check HF_ENDPOINT and any proxy in between, then rerun"
            )
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
