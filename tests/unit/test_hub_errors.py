"""hub/hub_errors.py: which Hub and network failures are retried, how long the retries wait, and the next
step each DownloadError names. The errors are built as huggingface_hub raises them, on an httpx2 response."""

from __future__ import annotations

import errno

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

from dsv41_convert.errors import DownloadError
from dsv41_convert.hub import hub_errors
from dsv41_convert.hub.hub_errors import hub_error, is_transient, with_retries

WHERE = dict(repo_id="o/n", revision="main", endpoint="https://hub.example")


def http_error(code: int, cls: type[HfHubHTTPError] = HfHubHTTPError, headers: dict | None = None) -> HfHubHTTPError:
    request = httpx2.Request("GET", "https://hub.example/api/models/o/n")
    return cls(f"{code} from the Hub", response=httpx2.Response(code, headers=headers or {}, request=request))


@pytest.fixture
def token(monkeypatch):
    """Set the token hub_errors sees: `token("hf_x")`, or `token(None)` for none."""

    def set_token(value: str | None) -> None:
        monkeypatch.setattr(hub_errors, "get_token", lambda: value)

    return set_token


@pytest.mark.parametrize(("code", "transient"), [(429, True), (500, True), (503, True), (404, False), (403, False)])
def test_rate_limits_and_server_errors_are_retried_client_errors_not(code: int, transient: bool):
    """429 and every 5xx (500 included) are worth another try; a 4xx other than 429 will not go away. Catches
    429 left out of the transient codes and 500 left out (code > 500)."""
    assert is_transient(http_error(code)) is transient


def test_offline_mode_is_not_retried():
    """HF_HUB_OFFLINE raises OfflineModeIsEnabled, a ConnectionError: retrying it only repeats the refusal.
    Catches the offline check dropped from is_transient (it would count as a network fault)."""
    calls = []

    def offline():
        calls.append(1)
        raise OfflineModeIsEnabled("offline")

    assert not is_transient(OfflineModeIsEnabled("offline"))
    with pytest.raises(OfflineModeIsEnabled):
        with_retries(offline, retries=3, backoff_s=0, on_error=lambda e: None)
    assert len(calls) == 1


def test_a_network_fault_behind_another_error_is_found(token):
    """An error raised while handling a network fault (no `from`: only __context__ links them) is still that
    fault: retried, and explained as a network error. Catches the chain following __cause__ alone."""
    token(None)
    try:
        try:
            raise httpx2.ConnectError("connection reset")
        except httpx2.ConnectError:
            raise RuntimeError("while reading the answer")  # noqa: B904 (no `from`: only __context__ links them)
    except RuntimeError as exc:
        wrapped = exc
    assert wrapped.__cause__ is None and isinstance(wrapped.__context__, httpx2.ConnectError)
    assert is_transient(wrapped)
    err = hub_error(wrapped, **WHERE)
    assert err is not None and "network error talking to https://hub.example" in str(err)


def test_retries_wait_twice_as_long_each_time(monkeypatch):
    """Waits backoff_s, 2 backoff_s, 4 backoff_s between the tries: a rate-limited run backs off instead of
    asking again at the same pace. Catches a constant wait."""
    waits: list[float] = []
    monkeypatch.setattr(hub_errors.time, "sleep", waits.append)

    def rate_limited():
        raise http_error(429)

    with pytest.raises(DownloadError, match=r"after 4 attempts"):
        with_retries(rate_limited, retries=3, backoff_s=0.5, on_error=lambda e: DownloadError("o/n: 429"))
    assert waits == [0.5, 1.0, 2.0]


def test_offline_mode_is_said_as_such():
    """Catches HF_HUB_OFFLINE reported as a network error (OfflineModeIsEnabled is a ConnectionError)."""
    err = hub_error(OfflineModeIsEnabled("offline"), **WHERE)
    assert err is not None and "HF_HUB_OFFLINE is set" in str(err) and "network error" not in str(err)


def test_a_transfer_that_got_more_bytes_than_announced_is_told_from_a_short_one():
    """huggingface_hub's consistency check says "should be of size W but has size G". More bytes than
    announced is another file served (a proxy or mirror); fewer, a transfer that ended short. Catches the two
    confused (the comparison inverted)."""
    longer = OSError("Consistency check failed: file should be of size 100 but has size 150 (f.safetensors).")
    shorter = OSError("Consistency check failed: file should be of size 100 but has size 60 (f.safetensors).")
    said_longer = str(hub_error(longer, **WHERE, path="f.safetensors"))
    said_shorter = str(hub_error(shorter, **WHERE, path="f.safetensors"))
    assert "the server sent 150 bytes where the Hub announced 100" in said_longer
    assert "ended short" in said_shorter and "server sent" not in said_shorter


def test_a_disk_error_names_the_file_and_its_reason(tmp_path):
    """A permission error while writing is the user's to fix, not a bug: a DownloadError with the reason and
    the file, not a traceback. Catches the OSError-with-errno branch dropped (hub_error returns None)."""
    target = tmp_path / "local" / "config.json"
    err = hub_error(PermissionError(errno.EACCES, "Permission denied", str(target)), **WHERE, folder=tmp_path)
    assert err is not None and f"Permission denied ({target}); check the target folder" in str(err)


def test_forbidden_says_the_servers_reason_and_the_token_hint(token):
    """Catches 403 falling through to the generic "the Hub answered" message."""
    token("hf_x")
    err = str(hub_error(http_error(403, headers={"X-Error-Message": "no access"}), **WHERE))
    assert "forbidden (403: no access)" in err and "has no access to it" in err


def test_rate_limited_and_server_down_say_what_to_do(token):
    """Catches 429 and 500 falling through to the generic "the Hub answered" message."""
    token(None)
    assert "rate-limited by the Hub (429); wait and rerun" in str(hub_error(http_error(429), **WHERE))
    assert "the Hub answered 500; it may be down, rerun later" in str(hub_error(http_error(500), **WHERE))


def test_a_missing_repo_suggests_a_token_only_when_none_is_set(token):
    """Catches the HF_TOKEN hint of a 404 inverted (told to set a token one has set)."""
    token(None)
    assert "if it is private, set HF_TOKEN" in str(hub_error(http_error(404, RepositoryNotFoundError), **WHERE))
    token("hf_x")
    said = str(hub_error(http_error(404, RepositoryNotFoundError), **WHERE))
    assert "repository not found (404)" in said and "HF_TOKEN" not in said
