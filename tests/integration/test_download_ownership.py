"""`download --local-dir` into a folder that holds files it did not put there, and runs of part of a
revision: what is replaced, what is refused, what a later --verify-only checks, and which partial files and
temporaries are kept. Each test plants the situation an audit found mishandled (2026-12-04)."""

from __future__ import annotations

import json

import huggingface_hub.constants as hf_constants
import pytest
from cli_run import run_cli
from hubserver import FakeHub, point_huggingface_hub_at, tiny_checkpoint

from dsv41_convert.errors import DownloadError
from dsv41_convert.hub import download as dl
from dsv41_convert.hub import fetch as hub_fetch

REPO = "acme/tiny"
C0, C1, C2 = "0" * 40, "1" * 40, "2" * 40
FILES0, FILES1 = tiny_checkpoint(0), tiny_checkpoint(1)
FILES1["notes.md"] = b"main only\n"  # a file main has and v0 lacks
FILES2 = dict(FILES1) | {"config.json": b'{"model_type": "deepseek_v4", "fixed": true}'}  # main's shards again
SHARD1, SHARD2 = sorted(p for p in FILES1 if p.endswith(".safetensors"))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with FakeHub() as server:
        server.add_repo(REPO, {C0: dict(FILES0), C1: dict(FILES1), C2: dict(FILES2)}, {"main": C1, "v0": C0, "fix": C2})
        point_huggingface_hub_at(server, tmp_path / "hf-home", monkeypatch)
        yield server


def fetch(hub, **kw):
    return dl.download(REPO, endpoint=hub.url, retries=0, backoff_s=0.01, **kw)


def resolve_gets(hub):
    return [e for e in hub.log if e.method == "GET" and "/resolve/" in e.path]


def test_a_users_own_file_in_the_local_dir_is_refused_not_replaced(hub, tmp_path, monkeypatch, capsys):
    """`download --local-dir .` in a folder with a config.json of the user's replaced it with the Hub's, exit
    0. Now refused before any byte moves, naming the file; --overwrite replaces it. A file equal to the Hub's
    is taken as it is (hashed once)."""
    local = tmp_path / "proj"
    local.mkdir()
    (local / "config.json").write_bytes(b'{"mine": 1}')
    (local / "tokenizer.json").write_bytes(FILES1["tokenizer.json"])
    code, out, err = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(local), "--json")
    assert code == 2 and "config.json" in json.loads(out)["error"] and "--overwrite" in err
    assert "tokenizer.json" not in err.split("not acme/tiny@main")[1]
    assert (local / "config.json").read_bytes() == b'{"mine": 1}' and not resolve_gets(hub)
    assert not (local / dl.RECORD_NAME).exists()

    report = fetch(hub, local_dir=local, overwrite=True)
    assert report.ok and (local / "config.json").read_bytes() == FILES1["config.json"]
    assert "tokenizer.json" not in report.fetched


def test_another_revision_in_the_local_dir_is_refused_then_replaced_with_overwrite(hub, tmp_path):
    """A folder holding main switched silently to v0 (`--revision v0`); now refused, naming both commits.
    With --overwrite the folder becomes v0 whole: main's files v0 lacks are removed (a stale file would be
    checked against no record)."""
    local = tmp_path / "v41"
    assert fetch(hub, local_dir=local).ok
    with pytest.raises(DownloadError, match=r"holds revision main \(commit 111111111111\).*not acme/tiny@v0"):
        fetch(hub, local_dir=local, revision="v0")
    assert all((local / p).read_bytes() == d for p, d in FILES1.items())
    report = fetch(hub, local_dir=local, revision="v0", overwrite=True)
    assert report.ok and all((local / p).read_bytes() == d for p, d in FILES0.items())
    assert not (local / "notes.md").exists()
    assert dl.verify_local(REPO, local_dir=local).ok


def test_links_into_the_hf_cache_are_replaced_not_their_targets(hub, tmp_path):
    """A --local-dir of links into the HF cache (huggingface_hub's old local_dir_use_symlinks): replacing
    them deleted the cache's blobs. Now the link goes, the blob stays; the cache still checks out."""
    cache = tmp_path / "hf-home" / "hub"
    old = fetch(hub, revision="v0", cache_dir=cache)
    local = tmp_path / "linked"
    local.mkdir()
    for name in FILES0:
        (local / name).symlink_to((old.folder / name).resolve())
    assert fetch(hub, local_dir=local, overwrite=True).ok
    assert all((local / p).read_bytes() == d for p, d in FILES1.items())
    assert all(not (local / p).is_symlink() for p in FILES1 if FILES0.get(p) != FILES1[p])  # a right one stays
    assert all((old.folder / p).read_bytes() == d for p, d in FILES0.items())
    assert dl.verify_local(REPO, revision="v0", cache_dir=cache).ok


def test_a_narrower_run_never_narrows_what_verify_only_checks(hub, tmp_path, monkeypatch, capsys):
    """After a whole download, `--include 'typo*'` (refused: no file matches) and `--include config.json`
    (ok) each rewrote the record's selection, and --verify-only then checked one file or none: a deleted
    shard passed. The record keeps the union of what runs at its commit asked for."""
    local = tmp_path / "v41"
    assert fetch(hub, local_dir=local).ok
    record = (local / dl.RECORD_NAME).read_bytes()
    code, _, _ = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(local), "--include", "typo*")
    assert code == 2 and (local / dl.RECORD_NAME).read_bytes() == record
    report = fetch(hub, local_dir=local, include=["config.json"])
    assert report.ok and report.fetched == ()
    (local / SHARD2).unlink()
    code, out, _ = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(local), "--verify-only", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["files"] == len(FILES1) and [p["path"] for p in doc["problems"]] == [SHARD2]


def test_part_of_a_revision_then_more_checks_the_union(hub, tmp_path):
    """Two runs of parts (the json files, then the shards): verify checks both parts, not the last alone,
    and nothing outside them (notes.md was never asked for)."""
    local = tmp_path / "v41"
    assert fetch(hub, local_dir=local, include=["*.json"]).ok
    assert fetch(hub, local_dir=local, include=["*.safetensors"]).ok
    report = dl.verify_local(REPO, local_dir=local)
    assert report.ok and report.files == len(FILES1) - 1
    (local / "config.json").write_bytes(b"{}")
    assert [p.path for p in dl.verify_local(REPO, local_dir=local).problems] == ["config.json"]


def test_a_run_of_other_files_keeps_the_partial_files_for_their_run(hub, tmp_path):
    """A killed run's partial shard was deleted by any later run that checked out, `--include '*.json'`
    too, and the shard was fetched again from byte 0. Now only partial files of files now whole, or of no
    file of the revision (another revision's), are removed."""
    local = tmp_path / "v41"
    record = hub_fetch.fetch_record(dl.HfApi(endpoint=hub.url), REPO, None, retries=0, backoff_s=0)
    shard = next(f for f in record.files if f.path == SHARD1)
    partial = hub_fetch.partial_path(local, shard)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(FILES1[SHARD1][:1000])
    stale = partial.with_name(f"{SHARD1}.{'f' * 16}.partial")  # of a file no revision here has
    stale.write_bytes(b"x")
    assert fetch(hub, local_dir=local, include=["*.json"]).ok
    assert partial.read_bytes() == FILES1[SHARD1][:1000] and not stale.exists()
    assert fetch(hub, local_dir=local).ok
    assert hub.gets(SHARD1)[-1].range == "bytes=1000-"
    assert not (local / hub_fetch.PARTIAL_DIR).exists()


def test_stale_huggingface_hub_temporaries_in_the_local_dir_are_removed(hub, tmp_path):
    """hf-xet fetches into huggingface_hub's own temporary (`.cache/huggingface/download/*.incomplete`), which a
    killed run left for good. The next run into the folder (which it holds alone) removes them."""
    local = tmp_path / "v41"
    temporary = local / ".cache" / "huggingface" / "download" / f"abc.{'0' * 64}.1234abcd.incomplete"
    temporary.parent.mkdir(parents=True)
    temporary.write_bytes(b"\0" * 4096)
    assert fetch(hub, local_dir=local).ok
    assert not temporary.exists()


def test_blobs_another_revision_holds_need_no_free_space(hub, tmp_path, monkeypatch):
    """In the HF cache, a revision that changes config.json alone shares its shards' blobs with the cached
    one: the free-space check asked for room for every shard again (510 GB for a config fix)."""
    cache = tmp_path / "hf-home" / "hub"
    assert fetch(hub, cache_dir=cache).ok
    new_bytes = len(FILES2["config.json"])
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": new_bytes + 10})())
    report = fetch(hub, revision="fix", cache_dir=cache)
    assert report.ok and all((report.folder / p).read_bytes() == d for p, d in FILES2.items())
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": new_bytes - 1})())
    with pytest.raises(DownloadError, match="GB free"):
        fetch(hub, revision="v0", cache_dir=cache)


def test_a_page_that_is_no_json_is_an_error_naming_the_endpoint(hub, tmp_path, monkeypatch, capsys):
    """A proxy or captive portal answering the Hub API with HTML crashed with a JSONDecodeError traceback,
    exit 1 and no JSON. Now exit 2, one document naming the endpoint."""
    hub.api_body = b"<html><body>Welcome to the proxy</body></html>"
    local = tmp_path / "v41"
    code, out, err = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(local), "--json")
    doc = json.loads(out)
    assert code == 2 and "not the Hub's JSON" in doc["error"] and hub.url in doc["error"]
    assert "Traceback" not in err


def test_a_server_sending_more_bytes_than_announced_is_said_so(hub, tmp_path, monkeypatch):
    """A file longer than the Hub announced was reported as "the transfer ended short"."""
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    hub.repos[REPO].announced[SHARD1] = {"size": len(FILES1[SHARD1]) - 100}
    with pytest.raises(DownloadError, match=r"sent \d+ bytes where the Hub announced \d+"):
        fetch(hub, local_dir=tmp_path / "v41")
