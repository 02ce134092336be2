"""`download` against a fake Hub on 127.0.0.1: full fetch, resume, repair, 404, revision pins, auth, offline.

huggingface_hub reads HF_ENDPOINT and HF_HOME once, at import; the fixture therefore patches its
`constants` module as well as the environment (hubserver.point_huggingface_hub_at), and the library calls
get the endpoint and cache explicitly. Interrupts, free space, files over 50 GB and files the Hub keeps
serving wrong: test_download_faults.py.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
from hubserver import FakeHub, point_huggingface_hub_at, published_checkpoint, tiny_checkpoint
from huggingface_hub import HfApi
from typer.testing import CliRunner

from dsv41_convert.cli import app
from dsv41_convert.errors import DownloadError
from dsv41_convert.hub import download as dl
from dsv41_convert.hub import fetch as hub_fetch

REPO = "acme/tiny"
C0, C1 = "0" * 40, "1" * 40  # commits: C0 is tag v0 (seed 0), C1 is main (seed 1)


@pytest.fixture(scope="module")
def checkpoints():
    # small synthetic shards keep the quick suite quick; test_make_tiny_checkpoint hosts the real layout
    return {C0: tiny_checkpoint(0), C1: tiny_checkpoint(1)}


@pytest.fixture
def hub(checkpoints, tmp_path, monkeypatch):
    with FakeHub() as server:
        server.add_repo(REPO, {C0: dict(checkpoints[C0]), C1: dict(checkpoints[C1])}, {"main": C1, "v0": C0})
        point_huggingface_hub_at(server, tmp_path / "hf-home", monkeypatch)
        yield server


def fetch(hub, tmp_path, **kw):
    kw.setdefault("local_dir", tmp_path / "local")
    return dl.download(REPO, endpoint=hub.url, retries=1, backoff_s=0.01, **kw)


def shards(files):
    return sorted(p for p in files if p.endswith(".safetensors"))


def test_full_download_matches_hub_and_writes_record(hub, tmp_path, checkpoints):
    report = fetch(hub, tmp_path)
    want = checkpoints[C1]
    assert report.ok and report.commit == C1 and report.files == len(want)
    assert sorted(report.fetched) == sorted(want)
    for path, data in want.items():
        assert (tmp_path / "local" / path).read_bytes() == data
    record = json.loads((tmp_path / "local" / dl.RECORD_NAME).read_text())
    assert record["commit"] == C1 and {f["path"] for f in record["files"]} == set(want)
    assert all(len(hub.gets(p)) == 1 for p in want)  # each file sent once


def test_second_run_fetches_nothing(hub, tmp_path):
    fetch(hub, tmp_path)
    before = len([e for e in hub.log if e.method == "GET" and "/resolve/" in e.path])
    report = fetch(hub, tmp_path)
    after = len([e for e in hub.log if e.method == "GET" and "/resolve/" in e.path])
    assert report.ok and report.fetched == () and after == before


def test_second_run_of_a_complete_download_in_the_hf_cache_writes_nothing(hub, tmp_path):
    """A shared HF cache that holds the download whole, mounted read-only: a second `download` checks it and
    writes nothing; it rewrote the record and the branch's ref, and on a read-only cache failed with
    "...json.PID.partial: Read-only file system" where --verify-only passed."""
    kw = {"local_dir": None, "cache_dir": tmp_path / "cache"}
    fetch(hub, tmp_path, **kw)
    folder = tmp_path / "cache"

    def files() -> dict[str, tuple[int, int]]:
        return {str(p): (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in folder.rglob("*")}

    before = files()
    assert fetch(hub, tmp_path, **kw).ok
    assert files() == before


@pytest.mark.parametrize("in_cache", [False, True])
def test_interrupted_transfer_resumes_by_range(hub, tmp_path, checkpoints, monkeypatch, in_cache):
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1024)  # so bytes reach the disk before the cut
    target = shards(checkpoints[C1])[0]
    size = len(checkpoints[C1][target])
    assert size > 4096
    hub.drop_after[target] = 3000
    kw = {"local_dir": None, "cache_dir": tmp_path / "cache"} if in_cache else {}
    report = fetch(hub, tmp_path, **kw)
    assert report.ok and (report.folder / target).read_bytes() == checkpoints[C1][target]
    first, second = hub.gets(target)
    assert first.range is None and first.body_bytes == 3000
    start = int(second.range.removeprefix("bytes=").rstrip("-"))
    assert second.status == 206 and 0 < start <= 3000
    assert second.body_bytes == size - start  # the rest only, not the whole file again


def test_rerun_resumes_a_partial_file_left_by_a_killed_run(hub, tmp_path, checkpoints):
    target, other = shards(checkpoints[C1])
    data = checkpoints[C1][target]
    local = tmp_path / "local"
    listing = hub_fetch.fetch_record(HfApi(endpoint=hub.url), REPO, None, retries=0, backoff_s=0)
    record = {f.path: f for f in listing.files}
    hub_fetch.partial_path(local, record[target]).parent.mkdir(parents=True)
    hub_fetch.partial_path(local, record[target]).write_bytes(data[:2500])  # what a killed run left behind
    too_long = b"x" * (len(checkpoints[C1][other]) + 1)  # cannot be a prefix: start over
    hub_fetch.partial_path(local, record[other]).write_bytes(too_long)
    report = fetch(hub, tmp_path)
    assert report.ok and (local / target).read_bytes() == data
    (get,) = hub.gets(target)
    assert get.range == "bytes=2500-" and get.status == 206 and get.body_bytes == len(data) - 2500
    (restart,) = hub.gets(other)
    assert restart.range is None and (local / other).read_bytes() == checkpoints[C1][other]
    assert not (local / hub_fetch.PARTIAL_DIR).exists()  # renamed into place, the folder cleaned up


@pytest.mark.parametrize("in_cache", [False, True])
def test_corruption_found_by_verify_only_and_refetched(hub, tmp_path, checkpoints, in_cache):
    kw = {"local_dir": None, "cache_dir": tmp_path / "cache"} if in_cache else {}
    first = fetch(hub, tmp_path, **kw)
    bad, good = shards(checkpoints[C1])[-1], shards(checkpoints[C1])[0]
    path = first.folder / bad
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte off: only the hash can tell
    path.resolve().write_bytes(bytes(data))

    verdict = dl.verify_local(REPO, local_dir=kw.get("local_dir", tmp_path / "local"), cache_dir=kw.get("cache_dir"))
    assert [(p.path, p.kind) for p in verdict.problems] == [(bad, "sha256")]

    report = fetch(hub, tmp_path, **kw)
    assert report.ok and report.refetched == (bad,) and report.fetched == (bad,)
    assert path.read_bytes() == checkpoints[C1][bad]
    assert len(hub.gets(bad)) == 2 and len(hub.gets(good)) == 1  # only the bad file came again


def test_missing_file_on_server_names_the_file(hub, tmp_path, checkpoints):
    target = shards(checkpoints[C1])[-1]
    hub.repos[REPO].hidden.add(target)
    with pytest.raises(DownloadError, match=rf"{target}: file not found on the Hub \(404\)"):
        fetch(hub, tmp_path)


@pytest.mark.parametrize("revision", ["v0", C0])
def test_revision_pin_gets_that_revisions_bytes(hub, tmp_path, checkpoints, revision):
    report = fetch(hub, tmp_path, local_dir=None, cache_dir=tmp_path / "cache", revision=revision)
    assert report.ok and report.commit == C0 and report.folder.name == C0
    for path, data in checkpoints[C0].items():
        assert (report.folder / path).read_bytes() == data
    differ = [p for p in shards(checkpoints[C0]) if checkpoints[C0][p] != checkpoints[C1][p]]
    assert differ  # the two revisions really are different bytes
    assert all("/resolve/" + C0 + "/" in e.path for e in hub.log if "/resolve/" in e.path)


def test_verify_only_of_another_revision_than_the_folder_holds_is_refused(hub, tmp_path, checkpoints):
    """--verify-only --revision main of a folder holding v0 checked v0's files against v0's record and said ok:
    the folder is not the revision asked for."""
    local = tmp_path / "local"
    assert fetch(hub, tmp_path, local_dir=local, revision="v0").ok
    assert (
        dl.verify_local(REPO, local_dir=local, revision="v0").ok
        and dl.verify_local(REPO, local_dir=local, revision=C0).ok
    )
    with pytest.raises(DownloadError, match=rf"holds revision v0 \(commit {C0}\), not main"):
        dl.verify_local(REPO, local_dir=local, revision="main")


def test_verify_only_by_a_name_an_earlier_run_used_for_the_same_commit(hub, tmp_path):
    """`--revision v0` into a folder, then `--revision <v0's commit> --include config.json` (the same commit):
    `--verify-only --revision v0` said the folder "holds revision <hash> ..., not v0; download that revision
    into another folder" (exit 2), though every run into it was of v0's commit."""
    local = tmp_path / "v41"
    assert fetch(hub, tmp_path, local_dir=local, revision="v0").ok
    assert fetch(hub, tmp_path, local_dir=local, revision=C0, include=["config.json"]).ok
    assert dl.verify_local(REPO, local_dir=local, revision=C0).ok
    assert dl.verify_local(REPO, local_dir=local, revision="v0").ok
    with pytest.raises(DownloadError, match=r"not main"):  # a name no run used stays refused
        dl.verify_local(REPO, local_dir=local, revision="main")


def test_verify_only_in_the_hf_cache_by_a_name_huggingface_hub_gave_the_commit(hub, tmp_path, monkeypatch):
    """`download` of main into the HF cache, then huggingface_hub itself (`hf download --revision v1`, a
    transformers load) fetched a file by a tag of the same commit, writing refs/v1: `--verify-only --revision
    v1` (and `plan acme/tiny@v1` offline) said the snapshot "holds revision main (commit C), not v1; download
    that revision into another folder", although refs/v1 is how it found that snapshot."""
    from huggingface_hub import hf_hub_download

    hub.repos[REPO].refs["v1"] = C1
    cache = tmp_path / "cache"
    assert fetch(hub, tmp_path, local_dir=None, cache_dir=cache).ok
    hf_hub_download(REPO, "config.json", revision="v1", cache_dir=cache, endpoint=hub.url)
    report = dl.verify_local(REPO, revision="v1", cache_dir=cache)
    assert report.ok and report.commit == C1
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert dl.resolve_source(f"{REPO}@v1", cache_dir=cache) == report.folder


def test_unknown_revision_is_a_clear_error(hub, tmp_path):
    with pytest.raises(DownloadError, match=r"revision 'nope' not found \(404\)"):
        fetch(hub, tmp_path, revision="nope")


def test_private_repo_without_token_mentions_hf_token(hub, tmp_path, monkeypatch):
    hub.repos[REPO].token = "sesame"
    with pytest.raises(DownloadError, match=r"401.*HF_TOKEN is not set"):
        fetch(hub, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "wrong")
    with pytest.raises(DownloadError, match=r"invalid credentials.*HF_TOKEN"):
        fetch(hub, tmp_path)
    monkeypatch.setenv("HF_TOKEN", "sesame")
    assert fetch(hub, tmp_path).ok


def test_gated_repo_says_accept_conditions(hub, tmp_path):
    hub.repos[REPO].gated = True
    with pytest.raises(DownloadError, match=r"gated repo.*HF_TOKEN"):
        fetch(hub, tmp_path)


def test_unknown_repo_is_404(hub, tmp_path):
    with pytest.raises(DownloadError, match=r"acme/nothing.*repository not found \(404\)"):
        dl.download("acme/nothing", local_dir=tmp_path / "x", endpoint=hub.url, retries=0)


def test_network_down_after_retries(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(DownloadError, match=r"network error talking to .*after 2 attempts"):
        dl.download(REPO, local_dir=tmp_path / "x", endpoint=dead, retries=1, backoff_s=0.01)


def test_disk_full_before_start(hub, tmp_path, monkeypatch):
    """Refused before the first byte; a folder the run made is gone again (it was left holding the download
    record, which a later run took as its own: an audit)."""
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 100})())
    said = r" bytes to download into .*only 100 bytes free there, [0-9,]+ bytes short"  # 0.00 GB each (an audit)
    with pytest.raises(DownloadError, match=said):
        fetch(hub, tmp_path)
    assert not [e for e in hub.log if e.method == "GET" and "/resolve/" in e.path]
    assert not (tmp_path / "local").exists()


def test_disk_full_before_start_of_a_source_advises_what_the_command_takes(hub, tmp_path, monkeypatch):
    """`plan owner/name` (shard, export) with too little disk for the download advised "pick --local-dir on a
    larger disk", an option of `download` that these commands do not have (a usage error): they are told to
    download it onto a larger disk and give that folder as SRC; `download` keeps its advice."""
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 100})())
    with pytest.raises(DownloadError) as raised:
        dl.resolve_source(REPO, endpoint=hub.url)
    said = str(raised.value)
    assert "only 100 bytes free there" in said and "pick --local-dir" not in said, said
    assert f"`dsv41-convert download {REPO} --local-dir DIR`" in said and "give DIR as SRC" in said, said
    with pytest.raises(DownloadError, match="short; free space or pick --local-dir on a larger disk"):
        fetch(hub, tmp_path)


def test_the_checks_said_are_the_checks_made(hub, tmp_path):
    """`--include "*.safetensors"` reported the index and whole-checkpoint checks, which need config.json and
    the index (an audit)."""
    report = fetch(hub, tmp_path, include=["*.safetensors"])
    assert report.ok and "not checked: the index, and whether the checkpoint is whole" in report.checks
    assert "config.json and model.safetensors.index.json not selected" in report.checks
    report = fetch(hub, tmp_path)
    assert report.ok and "not checked" not in report.checks and "whole checkpoint" in report.checks
    assert "left out by --include/--exclude" not in report.checks  # every file asked for


def test_a_whole_checkpoint_is_said_of_the_files_asked_for(hub, checkpoints, tmp_path):
    """`--exclude "*.safetensors"` (and --verify-only of it) said "whole checkpoint (... every shard the index
    names ...)" of a folder without a shard (an audit): the report says which files it looked for."""
    report = fetch(hub, tmp_path, exclude=["*.safetensors"])
    shards = sum(p.endswith(".safetensors") for p in checkpoints[C1])
    said = "left out by --include/--exclude are not looked for"
    assert report.ok and f"{shards} {said}" in report.checks, report.checks
    verdict = dl.verify_local(REPO, local_dir=tmp_path / "local", exclude=["*.safetensors"])
    assert verdict.ok and f"{shards} {said}" in verdict.checks, verdict.checks
    (tmp_path / "local" / dl.RECORD_NAME).unlink()  # a folder without our record: the files alone
    blind = dl.verify_local(REPO, local_dir=tmp_path / "local", exclude=["*.safetensors"])
    assert blind.ok and "let through: others are not looked for" in blind.checks, blind.checks


@pytest.mark.parametrize("in_cache", [False, True])
def test_disk_full_during_transfer(hub, tmp_path, monkeypatch, in_cache):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub_fetch, "http_get", full)  # our resumable path (local dir)
    monkeypatch.setattr(hub_fetch, "hf_hub_download", full)  # huggingface_hub's (HF cache)
    kw = {"local_dir": None, "cache_dir": tmp_path / "cache"} if in_cache else {}
    with pytest.raises(DownloadError, match=r"disk full .*ENOSPC"):
        fetch(hub, tmp_path, **kw)


def test_disk_full_during_the_download_of_a_source_advises_what_the_command_takes(hub, tmp_path, monkeypatch):
    """As before the start (above): a disk that fills while `plan owner/name` (shard, export) downloads into the
    HF cache advised "pick --local-dir on a larger disk", an option these commands lack (an audit)."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub_fetch, "hf_hub_download", full)
    with pytest.raises(DownloadError) as raised:
        dl.resolve_source(REPO, endpoint=hub.url, cache_dir=tmp_path / "cache")
    said = str(raised.value)
    assert "disk full while writing into" in said and "(ENOSPC)" in said and "pick --local-dir" not in said, said
    assert f"`dsv41-convert download {REPO} --local-dir DIR`" in said and "give DIR as SRC" in said, said


@pytest.mark.parametrize("in_cache", [False, True])
def test_disk_full_mid_download_is_said_so_when_the_record_cannot_be_saved_either(hub, tmp_path, monkeypatch, in_cache):
    """A disk that fills up after some files were placed: the record naming them could not be saved either
    (same disk), and that failure hid the one that stopped the download ("…/.dsv41-download.json: No space
    left on device", without the advice): the error says disk full, and the files placed are kept."""
    full = threading.Event()
    real_http_get, real_hub_download, real_save = hub_fetch.http_get, hub_fetch.hf_hub_download, dl._save_record
    shard = "model-00002-of-00002.safetensors"

    def filling(real):
        def call(*args, **kwargs):
            if shard in str(args[0]) + str(args[1:2]):
                full.set()
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args, **kwargs)

        return call

    def save(*args, **kwargs):
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device", "record")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(hub_fetch, "http_get", filling(real_http_get))
    monkeypatch.setattr(hub_fetch, "hf_hub_download", filling(real_hub_download))
    monkeypatch.setattr(dl, "_save_record", save)
    kw = {"local_dir": None, "cache_dir": tmp_path / "cache"} if in_cache else {}
    with pytest.raises(DownloadError, match=r"disk full .*ENOSPC.*free space"):
        fetch(hub, tmp_path, max_workers=1, **kw)
    folder = tmp_path / "local" if not in_cache else next((tmp_path / "cache").glob("models--*/snapshots/*"))
    assert (folder / "config.json").is_file()  # placed before the disk filled, kept


def test_offline_download_checks_local_copy_without_network(hub, tmp_path, monkeypatch):
    fetch(hub, tmp_path)
    n = len(hub.log)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = fetch(hub, tmp_path)
    assert report.ok and report.offline and len(hub.log) == n
    (tmp_path / "local" / "config.json").unlink()
    report = fetch(hub, tmp_path)  # a check that fails, as --verify-only's (exit 1 with the report), no error
    assert report.offline and [(p.path, p.kind) for p in report.problems] == [("config.json", "missing")]
    assert len(hub.log) == n
    with pytest.raises(DownloadError, match=r"config.json: missing.*HF_HUB_OFFLINE is set: unset it"):
        dl.resolve_source(REPO, local_dir=tmp_path / "local", endpoint=hub.url)


def test_offline_source_not_cached_advises_what_the_command_takes(tmp_path, monkeypatch):
    """`plan owner/name` offline with the repo not in the HF cache advised "give the folder with --local-dir",
    an option of `download` that plan, shard and export do not have; `download` keeps that advice."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hf"
    with pytest.raises(DownloadError) as raised:
        dl.resolve_source(REPO, cache_dir=cache)
    said = str(raised.value)
    assert f"{REPO}: no such folder; as a Hub repo id: {REPO}@main: not in the HF cache" in said
    assert f"`dsv41-convert download {REPO}`" in said and "as SRC" in said and "--local-dir" not in said
    with pytest.raises(DownloadError, match=r"not in the HF cache .*; download it first, or give the folder with"):
        dl.download(REPO, cache_dir=cache)
    # owner/name@rev: the advised download is of that revision (it named none: `download` fetched main, and the
    # folder it advised giving as SRC was main's, not the revision asked for)
    with pytest.raises(DownloadError) as raised:
        dl.resolve_source(f"{REPO}@v2", cache_dir=cache)
    assert f"`dsv41-convert download {REPO} --revision v2`" in str(raised.value)


def test_offline_download_refuses_overwrite_it_would_ignore(hub, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE turns download into a check: `--overwrite` was ignored silently (the check ran, exit 0,
    nothing replaced), where --verify-only --overwrite is refused. Now refused the same way, before any read."""
    fetch(hub, tmp_path)
    config = tmp_path / "local" / "config.json"
    config.write_text("{}")  # a file of the user's that --overwrite would have replaced online
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match=r"HF_HUB_OFFLINE is set.*replaces nothing.*drop --overwrite"):
        fetch(hub, tmp_path, overwrite=True)
    assert config.read_text() == "{}"


def test_verify_without_record_checks_headers_and_says_so(hub, tmp_path, checkpoints):
    fetch(hub, tmp_path)
    (tmp_path / "local" / dl.RECORD_NAME).unlink()
    target = tmp_path / "local" / shards(checkpoints[C1])[0]
    target.write_bytes(target.read_bytes()[:-10])
    report = dl.verify_local(REPO, local_dir=tmp_path / "local")
    assert "no download record" in report.checks
    assert [(p.path, p.kind) for p in report.problems] == [(target.name, "header")]


def test_index_naming_other_tensors_is_reported(hub, tmp_path):
    files = tiny_checkpoint(2)
    index = json.loads(files["model.safetensors.index.json"])
    index["weight_map"]["layers.0.attn.extra.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["mtp.0.norm.weight"] = "model-00003-of-00003.safetensors"
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    hub.add_repo("acme/broken", {C0: files}, {"main": C0})
    report = dl.download("acme/broken", local_dir=tmp_path / "b", endpoint=hub.url, retries=0)
    found = {(p.path, p.kind, p.found) for p in report.problems}
    assert ("model-00003-of-00003.safetensors", "missing", "not in the repo at this revision") in found
    assert any(p == "model-00001-of-00002.safetensors" and k == "index" for p, k, _ in found)


def test_folder_of_another_repo_is_refused(hub, tmp_path):
    fetch(hub, tmp_path)
    hub.add_repo("acme/other", {C0: tiny_checkpoint(0)}, {"main": C0})
    with pytest.raises(DownloadError, match=r"already holds acme/tiny"):
        dl.download("acme/other", local_dir=tmp_path / "local", endpoint=hub.url, retries=0)


def test_include_exclude_select_files(hub, tmp_path, checkpoints):
    report = fetch(hub, tmp_path, include=["*.json"], exclude=["tokenizer*"])
    want = {p for p in checkpoints[C1] if p.endswith(".json") and not p.startswith("tokenizer")}
    assert set(report.fetched) == want and report.ok  # the index's shards were filtered out: not "missing"
    verdict = dl.verify_local(REPO, local_dir=tmp_path / "local")  # the record remembers the selection
    assert verdict.ok and verdict.files == len(want)
    everything = dl.verify_local(REPO, local_dir=tmp_path / "local", include=["*"])
    assert {p.kind for p in everything.problems} == {"missing"}


def test_resolve_source_path_or_repo_id(hub, tmp_path, checkpoints):
    assert dl.resolve_source(tmp_path) == tmp_path
    folder = dl.resolve_source(f"{REPO}@v0", endpoint=hub.url, cache_dir=tmp_path / "cache")
    assert folder.name == C0
    assert all((folder / p).read_bytes() == d for p, d in checkpoints[C0].items())
    with pytest.raises(DownloadError, match=r"not a Hub repo id"):
        dl.resolve_source(str(tmp_path / "no" / "such" / "dir"))


def test_cli_json_verify_only_and_errors(hub, tmp_path, checkpoints):
    runner = CliRunner()
    local = str(tmp_path / "cli")
    ok = runner.invoke(app, ["download", REPO, "--local-dir", local, "--json"])
    assert ok.exit_code == 0, ok.output
    summary = json.loads(ok.stdout)
    assert summary["ok"] and summary["commit"] == C1 and summary["files"] == len(checkpoints[C1])
    assert summary["exit_code"] == 0  # as check's and verify's: a torchrun launch's reader reads it

    target = tmp_path / "cli" / shards(checkpoints[C1])[0]
    target.write_bytes(b"\0" * target.stat().st_size)
    bad = runner.invoke(app, ["download", REPO, "--local-dir", local, "--verify-only", "--json"])
    assert bad.exit_code == 1 and json.loads(bad.stdout)["exit_code"] == 1
    problems = json.loads(bad.stdout)["problems"]
    assert {p["path"] for p in problems} == {target.name}
    assert {p["kind"] for p in problems} == {"sha256", "header"}  # zeroed: wrong hash, and no header either

    hub.repos[REPO].token = "sesame"
    denied = runner.invoke(app, ["download", REPO, "--local-dir", str(tmp_path / "cli2")])
    assert isinstance(denied.exception, DownloadError) and "HF_TOKEN" in str(denied.exception)


@pytest.mark.slow
def test_make_tiny_checkpoint_downloads_and_checks(hub, tmp_path):
    files = published_checkpoint(3, tmp_path)  # make-tiny output (falls back to the synthetic one without it)
    hub.add_repo("acme/made", {C0: files}, {"main": C0})
    report = dl.download("acme/made", cache_dir=tmp_path / "cache", endpoint=hub.url, retries=0)
    assert report.ok and report.files == len(files) and sorted(report.fetched) == sorted(files)
    assert all((report.folder / p).read_bytes() == d for p, d in files.items())
    shard = shards(files)[len(shards(files)) // 2]
    blob = (report.folder / shard).resolve()
    blob.write_bytes(blob.read_bytes()[:-1])  # truncated: both the record and the header notice
    verdict = dl.verify_local("acme/made", cache_dir=tmp_path / "cache")
    assert {(p.path, p.kind) for p in verdict.problems} == {(shard, "size"), (shard, "header")}
    assert dl.download("acme/made", cache_dir=tmp_path / "cache", endpoint=hub.url).refetched == (shard,)


def test_local_dir_has_one_writer(hub, tmp_path):
    """A download into a --local-dir another process is writing exits at once, naming it, and writes nothing;
    once that writer is gone the download runs, and leaves no lock file behind."""
    from dsv41_convert.errors import LockedError
    from dsv41_convert.store.lock import LOCK_NAME, hold

    local = tmp_path / "local"
    local.mkdir()
    with hold(local):
        with pytest.raises(LockedError, match=rf"{local.resolve()}: in use by pid \d+ on "):
            fetch(hub, tmp_path)
        assert [p.name for p in local.iterdir()] == [LOCK_NAME]
    assert not [e for e in hub.log if "/resolve/" in e.path]
    report = fetch(hub, tmp_path)
    assert report.ok and not (local / LOCK_NAME).exists()
    assert dl.verify_local(REPO, local_dir=local).ok


def test_plan_of_a_repo_checks_tp_on_config_json_before_the_shards(hub, tmp_path, monkeypatch, capsys):
    """`plan owner/name --tp 16` of the published config: refused on config.json alone, no shard fetched."""
    from cli_run import run_cli
    from tiny_ckpt import REAL_CONFIG

    shard = tiny_checkpoint(0)["model-00001-of-00002.safetensors"]
    files = {"config.json": REAL_CONFIG.read_bytes(), "model-00001-of-00001.safetensors": shard}
    hub.add_repo("acme/v41", {C0: files}, {"main": C0})
    home = tmp_path / "hf-home"
    code, _, err = run_cli(monkeypatch, capsys, "plan", "acme/v41", "--tp", "16")
    assert code == 2 and "cannot run at tp 16" in err and "o_groups = 8" in err
    assert list(home.rglob("config.json")) and not list(home.rglob("*.safetensors"))
    code, _, err = run_cli(monkeypatch, capsys, "plan", "acme/v41", "--tp", "8")
    assert code == 2 and "cannot run at tp" not in err, err  # the fake shard is no V4.1 checkpoint, but it came
    assert list(home.rglob("model-00001-of-00001.safetensors"))


@pytest.mark.parametrize("in_cache", [False, True])
def test_verify_only_of_a_folder_huggingface_hub_downloaded_checks_its_hashes(hub, tmp_path, checkpoints, in_cache):
    """A folder fetched by huggingface_hub alone (no record of ours) is checked against the ETags it kept:
    a flipped byte is found; without that metadata only the headers are checked, and the report says so."""
    from huggingface_hub import snapshot_download

    kw = {"cache_dir": tmp_path / "cache"} if in_cache else {"local_dir": tmp_path / "hf"}
    folder = Path(snapshot_download(REPO, endpoint=hub.url, **kw))
    assert not (folder / dl.RECORD_NAME).exists()
    where = {"cache_dir": tmp_path / "cache"} if in_cache else {"local_dir": folder}
    clean = dl.verify_local(REPO, **where)
    assert clean.ok and clean.commit == C1 and clean.files == len(checkpoints[C1])
    assert f"sha256 / git ids of {len(checkpoints[C1])} files" in clean.checks

    bad = shards(checkpoints[C1])[-1]
    data = bytearray((folder / bad).read_bytes())
    data[-1] ^= 0x01  # in the last tensor's bytes: the header stays valid, only the hash can tell
    (folder / bad).resolve().write_bytes(bytes(data))
    (folder / "config.json").resolve().write_text("{}\n")  # a plain git blob: its git id tells
    verdict = dl.verify_local(REPO, **where)
    assert sorted((p.path, p.kind) for p in verdict.problems) == [("config.json", "git-sha1"), (bad, "sha256")]
    assert ("HF cache's blob names" if in_cache else ".cache/huggingface/download") in verdict.checks
    other_commit = rf"snapshots/{C0}: no such folder" if in_cache else rf"downloaded at commit {C1}.*not {C0}"
    with pytest.raises(DownloadError, match=other_commit):
        dl.verify_local(REPO, revision=C0, **where)

    if not in_cache:  # the metadata gone: headers only, said so, and the flipped byte goes unseen
        import shutil

        shutil.rmtree(folder / ".cache")
        blind = dl.verify_local(REPO, local_dir=folder)
        assert "no download record, so no hashes" in blind.checks and blind.ok


def test_verify_only_of_a_folder_huggingface_hub_filled_from_two_commits_is_no_one_revision(hub, tmp_path, checkpoints):
    """`hf download` of main into a folder, then `hf download --revision v0 --include <a shard>` into it: each
    file matched the ETag huggingface_hub kept of it, so `--verify-only` said ok (commit unknown, exit 0) of a
    folder holding one shard of v0 among main's, and `shard` converted it. Each file of the fewer commit is a
    problem naming both commits."""
    from huggingface_hub import snapshot_download

    folder = tmp_path / "hf"
    snapshot_download(REPO, endpoint=hub.url, local_dir=folder)
    odd = shards(checkpoints[C0])[0]
    snapshot_download(REPO, revision="v0", endpoint=hub.url, local_dir=folder, allow_patterns=[odd])
    assert (folder / odd).read_bytes() == checkpoints[C0][odd]
    report = dl.verify_local(REPO, local_dir=folder)
    assert [(p.path, p.kind) for p in report.problems] == [(odd, "commit")]
    assert C0[:12] in report.problems[0].found and C1[:12] in report.problems[0].expected
    assert report.commit is None and not report.ok


def test_verify_only_of_a_folder_without_record_reports_no_revision_it_does_not_know(hub, tmp_path):
    """A --local-dir `hf download --revision v0` filled (no record of ours), checked without --revision: the
    report said "revision": "main", a name nothing in the folder gives; it is null, beside the commit the
    metadata names. In the HF cache, found through refs/main, it stays "main"."""
    from huggingface_hub import snapshot_download

    folder = tmp_path / "hf"
    snapshot_download(REPO, revision="v0", endpoint=hub.url, local_dir=folder)
    report = dl.verify_local(REPO, local_dir=folder)
    assert report.ok and report.commit == C0 and report.revision is None
    assert report.to_json()["revision"] is None
    snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path / "cache")
    assert dl.verify_local(REPO, cache_dir=tmp_path / "cache").revision == "main"


def test_verify_only_of_a_folder_without_record_by_a_revision_it_cannot_check_is_refused(hub, tmp_path):
    """A --local-dir `hf download` filled at main (no record of ours): `--verify-only --revision v0` said "all
    checks passed" with "revision": "v0" in its report, though v0 is another commit: huggingface_hub's
    metadata names commits only, so a branch or tag cannot be checked offline. Refused, saying to give the
    commit hash; the hash of the folder's commit still passes, without --revision too."""
    from huggingface_hub import snapshot_download

    folder = tmp_path / "hf"
    snapshot_download(REPO, endpoint=hub.url, local_dir=folder)
    for name in ("v0", "main"):  # "main" happens to be right: the check cannot tell either
        with pytest.raises(DownloadError, match=rf"revision {name} cannot be checked offline.*commit hash"):
            dl.verify_local(REPO, local_dir=folder, revision=name)
    assert dl.verify_local(REPO, local_dir=folder, revision=C1).ok
    assert dl.verify_local(REPO, local_dir=folder).ok
    import shutil

    shutil.rmtree(folder / ".cache")  # no metadata: not even a commit hash can be checked
    with pytest.raises(DownloadError, match=rf"revision {C1}.*drop --revision"):
        dl.verify_local(REPO, local_dir=folder, revision=C1)


@pytest.mark.parametrize("in_cache", [False, True])
def test_verify_only_with_huggingface_hub_metadata_still_needs_a_whole_folder(hub, tmp_path, checkpoints, in_cache):
    """huggingface_hub's digests cover the files still there: a config.json deleted, or a shard copied in
    under another name, is found by the whole-checkpoint check, and `checks` says what none can see."""
    from huggingface_hub import snapshot_download

    kw = {"cache_dir": tmp_path / "cache"} if in_cache else {"local_dir": tmp_path / "hf"}
    folder = Path(snapshot_download(REPO, endpoint=hub.url, **kw))
    where = {"cache_dir": tmp_path / "cache"} if in_cache else {"local_dir": folder}
    first = shards(checkpoints[C1])[0]
    stray = first.replace("-of-00002", "-of-00003")
    (folder / "config.json").unlink()
    (folder / stray).write_bytes((folder / first).read_bytes())
    verdict = dl.verify_local(REPO, **where)
    assert sorted((p.path, p.kind) for p in verdict.problems) == [
        ("config.json", "missing"),
        (stray, "duplicate"),
        (stray, "extra"),
    ]
    assert "whole checkpoint" in verdict.checks
    assert "not checked: whether files besides config.json and the weights are missing" in verdict.checks


def test_a_local_dir_the_shell_left_unexpanded_is_refused_before_any_byte(hub, tmp_path, monkeypatch):
    """`--local-dir=~/models/tiny`: a shell expands ~ at a word's start only, not after `=`, and the checkpoint
    went into a folder named `~` under the current one (for V4.1-Flash, 510 GB beside the user's files, where
    `rm -rf ~` then takes their home). Refused as a usage error naming the path; nothing is made."""
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    said = CliRunner().invoke(app, ["download", REPO, "--local-dir=~/models/tiny"])
    assert said.exit_code == 2 and "'~/models/tiny': ~ is not expanded here" in said.output, said.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    (tmp_path / "~").mkdir()  # a folder of that name, as given: the path is taken
    assert CliRunner().invoke(app, ["download", REPO, "--local-dir=~/t"]).exit_code == 0
    assert (tmp_path / "~" / "t" / "config.json").is_file()
