"""`download --local-dir` into a folder that holds files it did not put there, and runs of part of a
revision: what is replaced, what is refused, what a later --verify-only checks, and which partial files and
temporaries are kept. Each test plants the situation an audit found mishandled (2026-12-04)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import huggingface_hub.constants as hf_constants
import pytest
from cli_run import run_cli
from hubserver import FakeHub, point_huggingface_hub_at, tiny_checkpoint
from huggingface_hub._local_folder import get_local_download_paths

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


def _temporary(local, path: str, etag: str = "e" * 64):
    """Where huggingface_hub 2.x puts a process's temporary of `path` in a --local-dir."""
    paths = get_local_download_paths(local, path)
    incomplete = paths.incomplete_path(etag)
    return incomplete.with_name(f"{incomplete.stem}.1234abcd.incomplete"), paths.lock_path


_HOLD_LOCK = (
    "import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); "
    "print('held', flush=True); time.sleep(60)"
)


def test_stale_huggingface_hub_temporaries_in_the_local_dir_are_removed(hub, tmp_path):
    """hf-xet fetches into huggingface_hub's own temporary (`.cache/huggingface/download/...incomplete`), which
    a killed run left for good. The next run into the folder removes those of its files, except one whose
    huggingface_hub lock another process holds (an `hf download` into the same folder), and nothing of a
    run refused before the first byte."""
    local = tmp_path / "v41"
    stale, _ = _temporary(local, SHARD1)
    busy, lock = _temporary(local, SHARD2)
    for path in (stale, busy):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * 4096)
    (local / "config.json").write_bytes(b"{}")  # not main's: the run is refused
    with pytest.raises(DownloadError, match=r"config\.json"):
        fetch(hub, local_dir=local)
    assert stale.exists() and busy.exists()
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert fetch(hub, local_dir=local, overwrite=True).ok
    finally:
        holder.kill()
        holder.wait()
    assert not stale.exists() and busy.exists()


def test_removing_stale_temporaries_makes_no_folders(hub, tmp_path, monkeypatch):
    """The removal of huggingface_hub's temporaries asked huggingface_hub for each selected file's paths, which
    made that file's folders: a run into a --local-dir holding a temporary, refused for room, left an empty
    `encoding/deep/` in it and under .cache/huggingface/download/, and a finished run the latter (its files
    fetched here, not by huggingface_hub). A stale temporary in a subfolder is still removed."""
    hub.repos[REPO].commits[C1] = dict(FILES1) | {"encoding/deep/enc.py": b"x = 1\n", "encoding/top.py": b"y\n"}
    local = tmp_path / "v41"
    top, _ = _temporary(local, SHARD1)
    stale, _ = _temporary(local, "encoding/top.py")
    for path in (top, stale):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0" * 4096)
    (local / "encoding").rmdir()  # made by _temporary's get_local_download_paths, as the run made it

    def empty_folders() -> list[str]:
        return sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_dir() and not any(p.iterdir()))

    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 10})())
    with pytest.raises(DownloadError, match="bytes free there"):
        fetch(hub, local_dir=local)
    assert not top.exists() and not stale.exists()
    assert not (local / "encoding").exists() and empty_folders() == []
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 40})())
    assert fetch(hub, local_dir=local).ok
    assert (local / "encoding" / "deep" / "enc.py").read_bytes() == b"x = 1\n" and empty_folders() == []


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
    with pytest.raises(DownloadError, match=" bytes free there"):
        fetch(hub, revision="v0", cache_dir=cache)


def test_files_linked_to_blobs_the_cache_holds_are_not_reported_fetched(hub, tmp_path):
    """In the HF cache, a revision sharing its shards' blobs with a cached one gets them linked, not fetched
    (README), yet the report's `fetched` (and "fetched N") listed every file of the revision: a config fix
    said 510 GB fetched. It lists the files whose bytes came over the network, as the server saw them, and
    an empty file it made (huggingface_hub asks the server for no bytes of one)."""
    cache = tmp_path / "hf-home" / "hub"
    assert fetch(hub, cache_dir=cache).ok
    before = len(resolve_gets(hub))
    files = FILES2 | {"empty.txt": b""}
    hub.repos[REPO].commits["3" * 40] = files
    report = fetch(hub, revision="3" * 40, cache_dir=cache)
    new = sorted(p for p, data in files.items() if data not in FILES1.values())  # bytes no cached blob holds
    assert new == ["config.json", "empty.txt"]
    sent = sorted(e.path.rsplit("/", 1)[1] for e in resolve_gets(hub)[before:])
    assert report.ok and sorted(report.fetched) == new and sent == ["config.json"]


def test_a_page_that_is_no_json_is_an_error_naming_the_endpoint(hub, tmp_path, monkeypatch, capsys):
    """A proxy or captive portal answering the Hub API with HTML crashed with a JSONDecodeError traceback,
    exit 1 and no JSON. Now exit 2, one document naming the endpoint."""
    hub.api_body = b"<html><body>Welcome to the proxy</body></html>"
    local = tmp_path / "v41"
    code, out, err = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(local), "--json")
    doc = json.loads(out)
    assert code == 2 and "not the Hub's JSON" in doc["error"] and hub.url in doc["error"]
    assert "Traceback" not in err


@pytest.mark.parametrize("off_by", [-100, 100])
def test_a_server_serving_another_size_than_announced_is_said_so_before_any_byte(hub, tmp_path, monkeypatch, off_by):
    """The listing announces another size than the server's metadata: a file longer was reported as "the
    transfer ended short"; one shorter left its bytes in a partial file, which every rerun asked the rest of
    (416) and failed on, so "rerun" never helped (an audit). Now refused before its first byte, naming both
    sizes; a rerun once the listing is right fetches it."""
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1024)
    size = len(FILES1[SHARD1])
    hub.repos[REPO].announced[SHARD1] = {"size": size - off_by}
    local = tmp_path / "v41"
    with pytest.raises(DownloadError, match=rf"{SHARD1}: the server serves {size} bytes where the Hub's listing "
                       rf"announced {size - off_by}; rerun"):  # fmt: skip
        fetch(hub, local_dir=local)
    assert not hub.gets(SHARD1) and not list(local.rglob("*.partial"))
    hub.repos[REPO].announced.clear()
    assert fetch(hub, local_dir=local).ok and (local / SHARD1).read_bytes() == FILES1[SHARD1]


@pytest.mark.parametrize("body", [b'{"error": "proxy"}', b"[]", b'{"id": "acme/tiny", "siblings": []}'])
def test_json_that_is_not_the_hubs_is_an_error_naming_the_endpoint(hub, tmp_path, monkeypatch, capsys, body):
    """JSON without the model-info fields ended in a KeyError or TypeError traceback (or a commit "None")."""
    hub.api_body = body
    code, out, err = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(tmp_path / "v41"), "--json")
    assert code == 2 and "JSON that is not the Hub's" in json.loads(out)["error"] and "Traceback" not in err


def test_a_narrow_run_leaves_the_other_files_to_be_claimed(hub, tmp_path):
    """The ownership check ran only in a folder with no record of the commit: after `--include
    config.json`, a whole run replaced the user's own tokenizer.json. Files no earlier run at the commit
    fetched are checked as in a new folder."""
    local = tmp_path / "proj"
    local.mkdir()
    (local / "tokenizer.json").write_bytes(b'{"mine": 1}')
    assert fetch(hub, local_dir=local, include=["config.json"]).ok
    with pytest.raises(DownloadError, match=r"holds 1 file that is not acme/tiny@main.*tokenizer.json"):
        fetch(hub, local_dir=local)
    assert (local / "tokenizer.json").read_bytes() == b'{"mine": 1}'


def test_a_stray_shard_is_found_under_a_partial_selection(hub, tmp_path):
    """Keeping the runs' selections as globs (not the paths they matched): a *.safetensors beside a download
    of `--exclude '*.md'` is a stray `shard` would read, and is reported."""
    local = tmp_path / "v41"
    assert fetch(hub, local_dir=local, exclude=["*.md"]).ok
    (local / "model-extra.safetensors").write_bytes((local / SHARD2).read_bytes())
    problems = dl.verify_local(REPO, local_dir=local).problems
    assert any(p.path == "model-extra.safetensors" for p in problems), problems


def test_overwrite_with_another_revision_leaves_none_of_the_old_ones_files(hub, tmp_path):
    """--overwrite to v0 with `--include config.json` kept main's shards beside v0's config.json and
    --verify-only passed the mix. The files the old revision's runs fetched that this run does not ask for
    are removed; a file of the user's at a path no run fetched stays."""
    local = tmp_path / "v41"
    assert fetch(hub, local_dir=local, exclude=["notes.md"]).ok
    (local / "notes.md").write_bytes(b"my notes")  # a path main has; no run fetched it
    report = fetch(hub, local_dir=local, revision="v0", include=["config.json"], overwrite=True)
    assert report.ok and (local / "config.json").read_bytes() == FILES0["config.json"]
    assert not list(local.glob("*.safetensors")) and not (local / "model.safetensors.index.json").exists()
    assert (local / "notes.md").read_bytes() == b"my notes"


def test_offline_source_without_its_config_is_named(hub, tmp_path, monkeypatch):
    """resolve_source (plan owner/name) offline on a cached copy without config.json read the missing file
    (a bare FileNotFoundError) once download returned the failing report instead of raising."""
    cache = tmp_path / "hf-home" / "hub"
    report = fetch(hub, cache_dir=cache)
    (report.folder / "config.json").unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    seen = []
    with pytest.raises(DownloadError, match=r"config.json: missing.*HF_HUB_OFFLINE is set"):
        dl.resolve_source(REPO, cache_dir=cache, check_config=seen.append)
    assert not seen


@pytest.mark.parametrize("what", [{"repo": "acme/none"}, {"include": ["typo*"]}])
def test_a_run_refused_before_its_first_byte_leaves_no_folder(hub, tmp_path, what):
    """An unknown repo, or no file matching --include, left an empty --local-dir behind (an audit)."""
    local = tmp_path / "new" / "v41"
    with pytest.raises(DownloadError):
        dl.download(
            what.get("repo", REPO), local_dir=local, include=what.get("include", ()), endpoint=hub.url, retries=0
        )
    assert not local.exists()


@pytest.mark.parametrize("where", ["a file", "under a file", "a dangling link"])
def test_a_local_dir_that_cannot_be_a_folder_is_named_before_any_request(hub, tmp_path, where):
    """`--local-dir` at a file, under one, or at a link to nothing: download said only "afile: File exists"
    or "Not a directory" (what mkdir said), where `shard` and `make-tiny` say what is wrong with the path."""
    afile = tmp_path / "afile"
    afile.write_bytes(b"mine")
    local = {"a file": afile, "under a file": afile / "v41", "a dangling link": tmp_path / "link"}[where]
    if where == "a dangling link":
        local.symlink_to(tmp_path / "gone")
    said = {
        "a file": "exists and is not a folder",
        "under a file": "cannot be made",
        "a dangling link": "does not exist",
    }
    with pytest.raises(DownloadError, match=said[where]):
        dl.download(REPO, local_dir=local, endpoint=hub.url, retries=0)
    assert afile.read_bytes() == b"mine" and not resolve_gets(hub) and not hub.log


@pytest.mark.parametrize("name", ["ABSOLUTE", "../outside.txt", "sub/../../outside.txt", "sub//x.txt"])
def test_a_file_name_out_of_the_folder_is_refused_before_any_byte(hub, tmp_path, name):
    """A listing (a broken or hostile HF_ENDPOINT) naming an absolute path: `--local-dir` / path was that
    path, a plain run wrote outside the folder and --overwrite replaced a file there (an audit)."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    name = str(victim) if name == "ABSOLUTE" else name
    hub.add_repo("acme/evil", {C1: dict(FILES1) | {name: b"replaced by the download"}}, {"main": C1})
    local = tmp_path / "inside" / "dl"
    for overwrite in (False, True):
        with pytest.raises(DownloadError, match=r"answered the model-info call with JSON that is not the Hub's"):
            dl.download("acme/evil", endpoint=hub.url, retries=0, backoff_s=0.01, local_dir=local, overwrite=overwrite)
    assert victim.read_bytes() == b"precious" and not (tmp_path / "outside.txt").exists()
    assert not resolve_gets(hub) and not local.exists()


def test_a_file_asked_for_but_never_fetched_stays_the_users(hub, tmp_path):
    """A run that stopped before fetching tokenizer.json (a shard's 404 first, one worker) had recorded it as
    the download's: the user's own tokenizer.json put there afterwards was replaced by the next plain run,
    exit 0 (an audit). Only files a run put there right are the download's; the rest are refused unless
    --overwrite."""
    local = tmp_path / "v41"
    hub.repos[REPO].hidden.add(SHARD1)
    with pytest.raises(DownloadError):
        fetch(hub, local_dir=local, max_workers=1)
    assert (local / "config.json").exists() and not (local / "tokenizer.json").exists()
    hub.repos[REPO].hidden.discard(SHARD1)
    (local / "tokenizer.json").write_bytes(b'{"mine": true}')
    with pytest.raises(
        DownloadError, match=r"holds 1 file that is not acme/tiny@main \(commit 1+\)'s: tokenizer.json: size"
    ):
        fetch(hub, local_dir=local)
    assert (local / "tokenizer.json").read_bytes() == b'{"mine": true}'
    report = fetch(hub, local_dir=local, overwrite=True)
    assert report.ok and (local / "tokenizer.json").read_bytes() == FILES1["tokenizer.json"]
    assert fetch(hub, local_dir=local).ok  # now every file is the download's


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_at_a_files_path_is_named_and_never_replaced(hub, tmp_path, overwrite):
    """A folder at tokenizer.json's path was reported "missing: found no file", and with --overwrite the run
    saved its record and then failed on it, "Is a directory" (an audit): named as a folder, before any byte."""
    local = tmp_path / "v41"
    (local / "tokenizer.json").mkdir(parents=True)
    (local / "tokenizer.json" / "mine.txt").write_text("mine")
    with pytest.raises(DownloadError, match=r"tokenizer.json: (missing: found )?a folder"):
        fetch(hub, local_dir=local, overwrite=overwrite)
    assert (local / "tokenizer.json" / "mine.txt").read_text() == "mine" and not resolve_gets(hub)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_at_a_folders_path_is_named_before_any_byte(hub, tmp_path, overwrite):
    """The user's file `inference` where the revision has `inference/...`: every other file was fetched, and
    that folder's first file whole into its partial, before the run failed "File exists" (an audit): now
    named before the first byte, and kept."""
    hub.add_repo("acme/nested", {C1: dict(FILES1) | {"inference/model.py": b"print(1)\n"}}, {"main": C1})
    local = tmp_path / "v41"
    local.mkdir()
    (local / "inference").write_text("mine")
    with pytest.raises(DownloadError, match=r"inference: a file where acme/nested@main .* has a folder; move it away"):
        dl.download("acme/nested", endpoint=hub.url, retries=0, local_dir=local, overwrite=overwrite)
    assert (local / "inference").read_text() == "mine" and not resolve_gets(hub)


def test_another_revisions_file_where_this_one_has_a_folder_is_replaced_with_overwrite(hub, tmp_path):
    """The check for a file where the revision has a folder came before --overwrite removed the old revision's
    own files, so switching a folder from a revision with `docs` to one with `docs/readme.md` was refused (a
    review of the check): the old revision's file goes (a user's stays refused: the test above)."""
    revisions = {C0: dict(FILES0) | {"docs": b"a file\n"}, C1: dict(FILES1) | {"docs/readme.md": b"a folder\n"}}
    hub.add_repo("acme/switch", revisions, {"main": C1, "v0": C0})
    local = tmp_path / "v41"
    assert dl.download("acme/switch", endpoint=hub.url, retries=0, local_dir=local, revision="v0").ok
    report = dl.download("acme/switch", endpoint=hub.url, retries=0, local_dir=local, overwrite=True)
    assert report.ok and (local / "docs" / "readme.md").read_bytes() == b"a folder\n"


@pytest.mark.parametrize(
    "name", [".dsv41-download.json", ".dsv41-convert.lock", ".cache/dsv41-partial/x.partial", ".cache"]
)
def test_a_file_at_the_downloads_own_paths_is_refused_unless_left_out(hub, tmp_path, name):
    """A revision holding the download's own files (a folder it wrote, uploaded as a mirror): its record was
    kept at that name instead of the Hub's bytes, or the file removed as a stale partial, and the run said ok
    (an audit). Refused before any byte, naming it; `--exclude` leaves it out; the HF cache holds it."""
    hub.add_repo("acme/mirror", {C1: dict(FILES1) | {name: b'{"mirrored": true}'}}, {"main": C1})
    local = tmp_path / "v41"
    with pytest.raises(DownloadError, match=rf"{name}: the download keeps its own files at these paths"):
        dl.download("acme/mirror", endpoint=hub.url, retries=0, local_dir=local)
    assert not resolve_gets(hub) and not local.exists()
    left_out = ".cache/*" if name.startswith(".cache/") else name  # the pattern the message gives
    assert dl.download("acme/mirror", endpoint=hub.url, retries=0, local_dir=local, exclude=(left_out,)).ok
    assert dl.download("acme/mirror", endpoint=hub.url, retries=0).ok  # the HF cache: no such files of ours


@pytest.mark.parametrize("link", [".cache", ".cache/dsv41-partial"])
def test_a_link_where_the_download_keeps_its_partial_files_is_not_written_through(hub, tmp_path, link):
    """DIR/.cache a link to the user's folder: the partial files were made there and the stale-partial sweep
    deleted the user's own files under it (an audit). Refused; --overwrite replaces the link, never its target."""
    outside = tmp_path / "outside"
    (outside / "dsv41-partial" / "sub").mkdir(parents=True)
    (outside / "dsv41-partial" / "sub" / "keep.partial").write_text("mine")
    local = tmp_path / "v41"
    (local / link).parent.mkdir(parents=True)
    (local / link).symlink_to(outside if link == ".cache" else outside / "dsv41-partial")
    with pytest.raises(DownloadError, match=rf"{link}: a link to a folder where the revision has files or"):
        fetch(hub, local_dir=local)
    assert (outside / "dsv41-partial" / "sub" / "keep.partial").read_text() == "mine" and not resolve_gets(hub)
    assert fetch(hub, local_dir=local, overwrite=True).ok
    assert (outside / "dsv41-partial" / "sub" / "keep.partial").read_text() == "mine"
    assert not (local / link).is_symlink()


@pytest.mark.parametrize("name", ["ABSOLUTE", "../victim.txt"])
def test_a_record_naming_a_fetched_file_out_of_the_folder_removes_nothing_there(hub, tmp_path, name):
    """A record (copied, edited, a mirror's) whose `fetched` named a path out of the --local-dir: --overwrite
    at another revision removed that file as one of the old revision's (--local-dir / an absolute path is
    that path). The record is unreadable instead, and the file stays."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    local = tmp_path / "v41"
    assert fetch(hub, local_dir=local, include=["config.json"]).ok
    record = json.loads((local / dl.RECORD_NAME).read_text())
    record["fetched"].append(str(victim) if name == "ABSOLUTE" else name)
    (local / dl.RECORD_NAME).write_text(json.dumps(record))
    with pytest.raises(DownloadError, match=r"unreadable download record .*fetched '.*victim.txt'"):
        fetch(hub, local_dir=local, revision="v0", include=["config.json"], overwrite=True)
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("refused", ["a file", "held", "verify-only, no folder", "offline --overwrite"])
def test_a_refused_download_is_said_before_the_banner(tmp_path, monkeypatch, capsys, refused):
    """`download REPO --local-dir FILE` (and a folder another run holds, `--verify-only` of no folder, offline with
    --overwrite) printed the banner (`downloading REPO`) and an empty line before `error: ...`, as if the download
    had started (a helper's survey). Now the refusal is the first thing said; nothing is requested or written."""
    from dsv41_convert.store.lock import hold

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would fail, not hang
    local, options, held = tmp_path / "v41", [], None
    if refused == "a file":
        local.write_bytes(b"mine")
        said = f"error: {local}: exists and is not a folder"
    elif refused == "held":
        local.mkdir()
        held, said = hold(local), f"error: {local.resolve()}: in use by pid"
    elif refused == "verify-only, no folder":
        options, said = ["--verify-only"], f"error: {local}: no such folder; download {REPO} first"
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        options, said = ["--overwrite"], f"error: {REPO}: HF_HUB_OFFLINE is set"
    with held or contextlib.nullcontext():
        code, out, err = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(local), *options)
    assert code == 2 and err.startswith(said) and out == "", err
    assert not (local / ".dsv41-convert").exists() or refused == "held"
