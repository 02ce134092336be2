"""`download` under the faults a 510 GB download meets: Ctrl-C and SIGTERM mid-file, a nearly full disk with
partial files, a file over the 50 GB huggingface_hub fetches over plain HTTP, a file the Hub keeps serving
with other bytes than its sha256 says.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import huggingface_hub.constants as hf_constants
import pytest
from cli_run import default_sigint, run_cli
from hubserver import FakeHub, point_huggingface_hub_at, tiny_checkpoint
from huggingface_hub import HfApi

from dsv41_convert.errors import DownloadError
from dsv41_convert.hub import download as dl
from dsv41_convert.hub import fetch as hub_fetch
from dsv41_convert.hub.integrity import RemoteFile

REPO = "acme/tiny"
C1 = "1" * 40
FILES = tiny_checkpoint(1)
FIRST, SECOND = sorted(p for p in FILES if p.endswith(".safetensors"))
BIG = 60 * 10**9  # as the real 101.5 GB Engram shards: over huggingface_hub's 50 GB for plain HTTP


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with FakeHub() as server:
        server.add_repo(REPO, {C1: dict(FILES)}, {"main": C1})
        point_huggingface_hub_at(server, tmp_path / "hf-home", monkeypatch)
        yield server


def fetch(hub, tmp_path, **kw):
    kw.setdefault("local_dir", tmp_path / "local")
    return dl.download(REPO, endpoint=hub.url, retries=1, backoff_s=0.01, **kw)


def remote(hub, path):
    listing = hub_fetch.fetch_record(HfApi(endpoint=hub.url), REPO, None, retries=0, backoff_s=0)
    return next(f for f in listing.files if f.path == path)


def resolve_gets(hub):
    return [e for e in hub.log if e.method == "GET" and "/resolve/" in e.path]


# --- Ctrl-C and SIGTERM ---

# the CLI with 64-byte chunks, so that a slow file reaches the disk bit by bit
_CLI_SMALL_CHUNKS = (
    "import sys, huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 64; from dsv41_convert.cli import main; main()"
)


def _sent(hub: FakeHub, path: str, least: int, timeout: float = 30) -> None:
    """Wait until the hub has sent `least` bytes of `path`."""
    deadline = time.monotonic() + timeout
    while hub.sent.get(path, 0) < least:
        assert time.monotonic() < deadline, f"{path}: not {least} bytes sent in {timeout} s"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "sig, in_cache",
    [
        (signal.SIGINT, False),
        pytest.param(signal.SIGTERM, False, marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, True, marks=pytest.mark.slow),
    ],
)
def test_a_signal_stops_the_transfers_in_flight_at_once_and_the_rerun_resumes(hub, tmp_path, sig, in_cache):
    """A shard arriving at 256 bytes/s (~24 s) is interrupted mid-file: the run exits within about a second
    (it waited for every file in flight to finish: 10.8 s in the audit, hours on 10 GB shards), nothing wrong
    or unfinished stands at the shard's name, and the rerun continues the partial file by Range (into
    --local-dir) or starts over leaving no huggingface_hub temporary behind (the HF cache)."""
    hub.bytes_per_s[FIRST] = 256
    local, home = tmp_path / "local", tmp_path / "hf-home"
    where = [] if in_cache else ["--local-dir", str(local)]
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_DISABLE_XET="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI_SMALL_CHUNKS, "download", REPO, *where, "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=default_sigint,
    )  # fmt: skip
    try:
        _sent(hub, FIRST, 512)
        sent = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    code = 130 if sig == signal.SIGINT else 143
    assert proc.returncode == code, err
    assert took < 3, f"exited {took:.1f} s after the signal"
    assert json.loads(out)["exit_code"] == code and "download run again continues it (mid-file into --local-dir" in err
    assert not list(tmp_path.rglob(FIRST))  # neither in the folder nor linked in the cache

    del hub.bytes_per_s[FIRST]
    if in_cache:
        assert not list(home.rglob("*.incomplete"))  # its transfer ended at a chunk: huggingface_hub cleaned up
        report = fetch(hub, tmp_path, local_dir=None, cache_dir=home / "hub")
        assert all(g.range is None for g in hub.gets(FIRST))  # huggingface_hub 2.x cannot resume in its cache
    else:
        (partial,) = local.glob(f"{hub_fetch.PARTIAL_DIR}/{FIRST}.*.partial")
        kept = partial.read_bytes()
        assert 256 <= len(kept) < len(FILES[FIRST]) and FILES[FIRST].startswith(kept)
        report = fetch(hub, tmp_path)
        # the interrupted GET is logged once the server notices the client gone, maybe after this one
        assert [(g.range, g.status) for g in hub.gets(FIRST) if g.range] == [(f"bytes={len(kept)}-", 206)]
    assert report.ok and (report.folder / FIRST).read_bytes() == FILES[FIRST]


def test_an_interrupt_leaves_a_transfer_stuck_in_a_read_after_the_grace():
    """Ctrl-C while one transfer honours `stop` and another is stuck in a read that never returns: the run
    raises after GRACE_S, not when the read ends."""
    files = [RemoteFile(FIRST, 1), RemoteFile(SECOND, 1)]
    main_thread = threading.get_ident()
    reading, stuck, saw_stop = threading.Event(), threading.Event(), threading.Event()

    def one(f, stop):
        if f.path == SECOND:
            reading.set()
            stuck.wait(60)  # a socket read that ignores everything
            return None
        reading.wait(5)
        signal.pthread_kill(main_thread, signal.SIGINT)  # Ctrl-C, both transfers running
        if stop.wait(60):
            saw_stop.set()
            raise hub_fetch.Stopped
        return None

    # as in a shell: the whole suite leaves this process's SIGINT blocked or taken by an earlier test
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            dl._fetch_all(files, 2, one)
        took = time.monotonic() - start
    finally:
        stuck.set()
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        signal.signal(signal.SIGINT, handler)
    assert saw_stop.is_set() and dl.GRACE_S - 0.1 < took < dl.GRACE_S + 0.5


def test_a_signal_during_startup_stops_the_download_before_its_first_request(hub, tmp_path):
    """SIGINT while `download` imported its modules was postponed to a check the download never made: every
    file was fetched, then the run ended 130, or the 30 s watchdog cut it (an audit). Now no file is asked for."""
    from cli_run import run_cli_with_a_signal_in_an_import

    local = tmp_path / "local"
    run = run_cli_with_a_signal_in_an_import("dsv41_convert.hub.download", "download", REPO, "--local-dir", str(local))
    assert run.returncode == 143, run.stderr
    assert not resolve_gets(hub) and not [p for p in local.rglob("*") if p.is_file() and p.suffix != ".lock"]


@pytest.mark.parametrize("held_before", [False, True])
def test_a_file_stopped_in_its_check_is_not_left_in_the_hf_cache(hub, tmp_path, monkeypatch, held_before):
    """huggingface_hub names a file in the HF cache before it is checked: Ctrl-C during that hash left its
    blob (of a bad transfer: corrupt bytes under the true id) for any reader of the cache (an audit). A blob
    fetched by this call goes with its link; one held before (another revision's) stays."""
    f = remote(hub, FIRST)
    fetch_once = {"local_dir": None, "cache_dir": None, "endpoint": hub.url, "token": None, "retries": 0,
                  "backoff_s": 0, "progress": None, "stop": threading.Event()}  # fmt: skip
    blob = dl.storage_of(REPO, None) / "blobs" / f.sha256
    if held_before:
        assert hub_fetch.fetch_file(REPO, f, C1, force=False, **fetch_once) is None and blob.is_file()

    def stopped(*_args):
        raise hub_fetch.Stopped

    monkeypatch.setattr(hub_fetch, "_check", stopped)
    with pytest.raises(hub_fetch.Stopped):
        hub_fetch.fetch_file(REPO, f, C1, force=False, **fetch_once)
    link = dl.storage_of(REPO, None) / "snapshots" / C1 / FIRST
    assert blob.is_file() is held_before and (link.exists() or link.is_symlink()) is held_before


def test_a_blob_another_process_finished_is_not_removed_when_this_check_is_stopped(hub, monkeypatch):
    """Two downloads of one repo into one HF cache: the second waits on huggingface_hub's lock while the first
    transfers the blob, then finds it in place. Ctrl-C during the second's check removed the first's blob (the
    second had looked for it before its call, not found it, and took it for its own transfer)."""
    f = remote(hub, FIRST)
    fetch_once = {"local_dir": None, "cache_dir": None, "endpoint": hub.url, "token": None, "retries": 0,
                  "backoff_s": 0, "progress": None, "stop": threading.Event()}  # fmt: skip
    blob = dl.storage_of(REPO, None) / "blobs" / f.sha256
    download = hub_fetch.hf_hub_download

    def the_other_process_first(*args, **kwargs):
        assert download(*args, **{**kwargs, "tqdm_class": None}) and blob.is_file()  # the first download's
        return download(*args, **kwargs)

    def stopped(*_args):
        raise hub_fetch.Stopped

    monkeypatch.setattr(hub_fetch, "hf_hub_download", the_other_process_first)
    monkeypatch.setattr(hub_fetch, "_check", stopped)
    with pytest.raises(hub_fetch.Stopped):
        hub_fetch.fetch_file(REPO, f, C1, force=False, **fetch_once)
    assert blob.is_file() and hashlib.sha256(blob.read_bytes()).hexdigest() == f.sha256
    assert (dl.storage_of(REPO, None) / "snapshots" / C1 / FIRST).is_file()


@pytest.mark.parametrize("into", ["local_dir", "hf_cache"])
def test_a_fetched_file_that_fails_its_check_is_not_left_at_its_name(hub, tmp_path, into):
    """fetch_file's promise: a file whose bytes are not those of its listing comes back as a Problem, with
    nothing at its final name for plan or shard to take: in a --local-dir it is checked before the rename
    (and its partial file, whole and wrong, is not kept to be continued); in the HF cache huggingface_hub names
    it, and the check that fails removes the snapshot link and its blob."""
    f = remote(hub, FIRST)
    other = hashlib.sha256(b"another file's bytes").hexdigest()
    local = tmp_path / "local" if into == "local_dir" else None
    problem = hub_fetch.fetch_file(REPO, dataclasses.replace(f, sha256=other), C1, local_dir=local, cache_dir=None,
                                   endpoint=hub.url, token=None, force=False, retries=0, backoff_s=0, progress=None,
                                   stop=threading.Event())  # fmt: skip
    served = hashlib.sha256(FILES[FIRST]).hexdigest()
    assert (problem.path, problem.kind, problem.found, problem.expected) == (FIRST, "sha256", served, other)
    if local is not None:
        assert not (local / FIRST).exists() and not [p for p in local.rglob("*") if p.is_file()]
    else:
        storage = dl.storage_of(REPO, None)
        link = storage / "snapshots" / C1 / FIRST
        assert not link.exists() and not link.is_symlink() and not (storage / "blobs" / served).exists()


# --- free space ---


def test_free_space_counts_the_bytes_partial_files_hold(hub, tmp_path, monkeypatch):
    """Resuming on a nearly full disk: the bytes a killed run left in partial files are not asked for again."""
    local = tmp_path / "local"
    partial = hub_fetch.partial_path(local, remote(hub, FIRST))
    partial.parent.mkdir(parents=True)
    partial.write_bytes(FILES[FIRST][:-100])
    need = sum(len(d) for d in FILES.values()) - (len(FILES[FIRST]) - 100)
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": need + 10})())
    report = fetch(hub, tmp_path)
    assert report.ok and hub.gets(FIRST)[-1].range == f"bytes={len(FILES[FIRST]) - 100}-"

    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 10})())
    (local / FIRST).unlink()
    partial.parent.mkdir(parents=True)
    partial.write_bytes(FILES[FIRST][:-100])
    with pytest.raises(DownloadError, match=r" bytes of them already in partial files\), but only 10 bytes free"):
        fetch(hub, tmp_path)


def test_a_leftover_of_the_wrong_size_counts_in_the_space_needed(hub, tmp_path, monkeypatch):
    """A file of an earlier run grown past its size is fetched again, so its bytes count in the free-space check
    made before the first byte: on a full disk the run is refused there, not after it hashed the leftover."""
    fetch(hub, tmp_path)
    with open(tmp_path / "local" / SECOND, "ab") as f:
        f.write(b"\0")
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 10})())
    with pytest.raises(DownloadError, match=r"to download into .*, but only 10 bytes free"):
        fetch(hub, tmp_path)
    assert len(hub.gets(SECOND)) == 1


# --- files over 50 GB ---


def test_a_file_over_50_gb_without_hf_xet_is_refused_before_any_byte(hub, tmp_path, monkeypatch, capsys):
    """HF_HUB_DISABLE_XET=1 and a 60 GB shard: exit 2 naming it and what to do, with --json a document; no
    file fetched (it crashed with huggingface_hub's ValueError, naming no file, after the other files)."""
    hub.repos[REPO].announced[SECOND] = {"size": BIG}
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    code, out, err = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(tmp_path / "d"), "--json")
    assert code == 2, err
    assert f"{SECOND} (60.0 GB): over the 50 GB" in err and "HF_HUB_DISABLE_XET is set: unset it" in err
    doc = json.loads(out)
    assert doc["exit_code"] == 2 and not doc["ok"] and f"{SECOND} (60.0 GB)" in doc["error"]
    assert not resolve_gets(hub)


def test_a_file_over_50_gb_the_hub_serves_without_xet_is_an_error_naming_it(hub, tmp_path, monkeypatch):
    """hf-xet installed, but the Hub offers the 60 GB shard over plain HTTP only: a DownloadError naming it."""
    hub.repos[REPO].announced[SECOND] = {"size": BIG}
    monkeypatch.setattr(hub_fetch, "is_xet_available", lambda: True)
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 2 * BIG})())
    with pytest.raises(DownloadError, match=rf"{SECOND} \(60.0 GB\): over the 50 GB .* does not serve it"):
        fetch(hub, tmp_path)
    assert not hub.gets(SECOND)


# --- a file that stays wrong ---


@pytest.mark.parametrize("in_cache", [False, True])
def test_a_file_still_wrong_after_the_refetches_is_deleted_and_reported(hub, tmp_path, monkeypatch, capsys, in_cache):
    """The Hub announces a sha256 its bytes do not have: fetched three times, then deleted (it stayed at its
    name with the wrong bytes, so the folder looked whole to plan and shard), and the check fails: exit 1,
    the --json report naming it, as for any check that fails."""
    hub.repos[REPO].announced[SECOND] = {"sha256": "0" * 64}
    where = ["--local-dir", str(tmp_path / "local")] if not in_cache else []
    code, out, err = run_cli(monkeypatch, capsys, "download", REPO, *where, "--json")
    assert code == 1, err
    summary = json.loads(out)
    assert not summary["ok"] and [(p["path"], p["kind"]) for p in summary["problems"]] == [(SECOND, "sha256")]
    assert "after 2 re-fetches, so deleted" in summary["problems"][0]["found"]
    assert len(hub.gets(SECOND)) == 3
    assert list(tmp_path.rglob(FIRST)) and not list(tmp_path.rglob(SECOND))  # no partial file either
    assert not list(tmp_path.rglob("*.incomplete"))


def test_a_file_that_stayed_wrong_is_not_recorded_as_the_downloads_own(hub, tmp_path):
    """A file deleted as still wrong after the re-fetches was never put in the folder right, so the record does
    not count it as the download's: a file the user then puts at its name is theirs, refused unless
    --overwrite on the next run (when it was counted, the next run deleted it as a leftover of the wrong size)."""
    hub.repos[REPO].announced[SECOND] = {"sha256": "0" * 64}
    local = tmp_path / "local"
    report = fetch(hub, tmp_path)
    assert [(p.path, p.kind) for p in report.problems] == [(SECOND, "sha256")]
    saved = json.loads((local / dl.RECORD_NAME).read_text())
    assert saved["fetched"] == sorted(p for p in FILES if p != SECOND)
    hub.repos[REPO].announced.clear()
    (local / SECOND).write_bytes(b"the user's own notes")
    with pytest.raises(DownloadError, match=rf"holds 1 file that is not .*{SECOND}"):
        fetch(hub, tmp_path)
    assert (local / SECOND).read_bytes() == b"the user's own notes"


def test_a_wrong_file_found_there_and_not_refetched_is_deleted(hub, tmp_path):
    """repair_rounds=0: a corrupt file already in the folder is reported and does not keep its name."""
    fetch(hub, tmp_path)
    path = tmp_path / "local" / SECOND
    path.write_bytes(b"\0" * path.stat().st_size)
    report = fetch(hub, tmp_path, repair_rounds=0)
    assert [(p.path, p.kind) for p in report.problems] == [(SECOND, "sha256")] and not path.exists()
