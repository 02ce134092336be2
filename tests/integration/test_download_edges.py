"""`download` at its edges, against the fake Hub: a partial file left whole, a run that fails after some files,
a listing without git blob ids, links to folders in a --local-dir, records written by several processes at
once, an unreadable record, a metadata answer without the Hub's headers."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import hubserver
import pytest
from hubserver import FakeHub, is_lfs, point_huggingface_hub_at, tiny_checkpoint
from huggingface_hub import HfApi
from huggingface_hub.errors import FileMetadataError

from dsv41_convert.errors import DownloadError
from dsv41_convert.hub import download as dl
from dsv41_convert.hub import fetch as hub_fetch
from dsv41_convert.hub.integrity import Record, RemoteFile

REPO = "acme/tiny"
C0, C1 = "0" * 40, "1" * 40
FILES1 = tiny_checkpoint(1)
SHARD1, SHARD2 = sorted(p for p in FILES1 if p.endswith(".safetensors"))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with FakeHub() as server:
        server.add_repo(REPO, {C0: dict(tiny_checkpoint(0)), C1: dict(FILES1)}, {"main": C1, "v0": C0})
        point_huggingface_hub_at(server, tmp_path / "hf-home", monkeypatch)
        yield server


def fetch(hub, **kw):
    return dl.download(REPO, endpoint=hub.url, retries=0, backoff_s=0.01, **kw)


def test_a_whole_partial_file_is_checked_not_asked_for_again(hub, tmp_path):
    """A run stopped while it hashed a finished transfer leaves the whole file in its partial: the next run
    checks it where it lies, with no request for bytes past its end."""
    local = tmp_path / "local"
    listing = {f.path: f for f in hub_fetch.fetch_record(HfApi(endpoint=hub.url), REPO, None, retries=0,
                                                          backoff_s=0).files}  # fmt: skip
    partial = hub_fetch.partial_path(local, listing[SHARD1])
    partial.parent.mkdir(parents=True)
    partial.write_bytes(FILES1[SHARD1])
    report = fetch(hub, local_dir=local)
    assert report.ok and (local / SHARD1).read_bytes() == FILES1[SHARD1] and not partial.exists()
    assert not hub.gets(SHARD1)  # checked where it lay, renamed into place


def test_a_whole_partial_file_with_wrong_bytes_is_fetched_again(hub, tmp_path):
    local = tmp_path / "local"
    listing = {f.path: f for f in hub_fetch.fetch_record(HfApi(endpoint=hub.url), REPO, None, retries=0,
                                                          backoff_s=0).files}  # fmt: skip
    partial = hub_fetch.partial_path(local, listing[SHARD1])
    partial.parent.mkdir(parents=True)
    partial.write_bytes(bytes(len(FILES1[SHARD1])))
    report = fetch(hub, local_dir=local)
    assert report.ok and (local / SHARD1).read_bytes() == FILES1[SHARD1] and report.refetched == (SHARD1,)


def test_a_partial_file_of_another_revision_is_not_continued(hub, tmp_path):
    """A killed run at v0 left half of v0's shard in a partial file; a run at main (another shard of the same
    name) fetches main's shard from byte 0, not v0's half plus the rest of main's (which fails its check and
    costs a re-fetch), and removes v0's partial file."""
    local = tmp_path / "local"
    v0 = hub_fetch.fetch_record(HfApi(endpoint=hub.url), REPO, "v0", retries=0, backoff_s=0)
    old = next(f for f in v0.files if f.path == SHARD1)
    half = tiny_checkpoint(0)[SHARD1][: old.size // 2]
    partial = hub_fetch.partial_path(local, old)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(half)
    report = fetch(hub, local_dir=local)
    assert report.ok and (local / SHARD1).read_bytes() == FILES1[SHARD1] and report.refetched == ()
    assert [g.range for g in hub.gets(SHARD1)] == [None] and not partial.exists()


@pytest.mark.parametrize("failure", ["404", "interrupt"])
def test_files_a_failed_run_put_in_place_are_the_downloads_own(hub, tmp_path, monkeypatch, failure):
    """A run that fails (a 404) or is stopped after some files recorded none of them as its own, so a later
    `--overwrite` at another revision left them beside that revision's files (an audit: v0's lone
    model.safetensors beside main's shards)."""
    import numpy as np
    from safetensors.numpy import save

    old = {"model.safetensors": save({"w": np.ones(4, np.float32)}), "config.json": b'{"a": 0}', "z.json": b"{}"}
    repo = hub.repos[REPO]
    repo.commits[C0] = old
    local = tmp_path / "local"
    if failure == "404":
        repo.hidden.add("z.json")
    else:
        real = hub_fetch.fetch_file

        def stopped_at_z(repo_id, file, *args, **kw):
            if file.path == "z.json":
                raise KeyboardInterrupt
            return real(repo_id, file, *args, **kw)

        monkeypatch.setattr(dl, "fetch_file", stopped_at_z)
    with pytest.raises(DownloadError if failure == "404" else KeyboardInterrupt):
        fetch(hub, revision="v0", local_dir=local, max_workers=1)
    fetched = json.loads((local / dl.RECORD_NAME).read_text())["fetched"]
    assert fetched == ["config.json", "model.safetensors"]
    monkeypatch.undo()
    point_huggingface_hub_at(hub, tmp_path / "hf-home", monkeypatch)
    repo.hidden.clear()
    report = fetch(hub, revision="main", local_dir=local, overwrite=True)
    assert report.ok, report.problems
    assert not (local / "model.safetensors").exists() and (local / SHARD1).read_bytes() == FILES1[SHARD1]


def test_a_failed_run_does_not_count_a_file_that_failed_its_check_as_its_own(hub, tmp_path):
    """A run that fails (a 404 on z.json) after a file that failed its check (the Hub announces another
    sha256 for model.safetensors): the record it leaves counts only the file it put in place right, so a file
    the user then puts at model.safetensors is not the download's to replace."""
    import numpy as np
    from safetensors.numpy import save

    repo = hub.repos[REPO]
    repo.commits[C0] = {"model.safetensors": save({"w": np.ones(4, np.float32)}), "config.json": b"{}", "z.json": b"{}"}
    repo.announced["model.safetensors"] = {"sha256": "0" * 64}
    repo.hidden.add("z.json")
    local = tmp_path / "local"
    with pytest.raises(DownloadError, match=r"z\.json"):
        fetch(hub, revision="v0", local_dir=local, max_workers=1, repair_rounds=0)
    assert json.loads((local / dl.RECORD_NAME).read_text())["fetched"] == ["config.json"]
    assert not (local / "model.safetensors").exists()


def test_a_listing_without_git_blob_ids_is_not_the_hubs(hub, tmp_path, monkeypatch):
    """Without a non-LFS file's blobId only its size could be checked, and the run said it had checked
    "sizes, sha256 / git ids" (an audit: a flipped byte in config.json passed download and --verify-only)."""
    real = hubserver._file_entry

    def without_blob_ids(path, data, *, tree, announced=None):
        entry = real(path, data, tree=tree, announced=announced)
        if not tree and not is_lfs(path):
            entry.pop("blobId", None)
        return entry

    monkeypatch.setattr(hubserver, "_file_entry", without_blob_ids)
    with pytest.raises(DownloadError, match=r"JSON that is not the Hub's \(no blobId \(git blob id\) for [\w.]+\)"):
        fetch(hub, local_dir=tmp_path / "local")


def _with_folder_of_the_users(tmp_path: Path, hub) -> tuple[Path, Path]:
    """A --local-dir whose `inference` is a link to the user's own folder, and a revision with a file there."""
    hub.repos[REPO].commits[C1] = dict(FILES1) | {"inference/model.py": b"print('hub')\n"}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "model.py").write_text("print('mine')\n")
    local = tmp_path / "local"
    local.mkdir()
    os.symlink(mine, local / "inference")
    return local, mine


def test_a_link_to_a_folder_is_not_written_through(hub, tmp_path):
    """The user's own model.py behind the link was replaced with --overwrite, and a file missing there was
    created inside the user's folder without it (an audit)."""
    local, mine = _with_folder_of_the_users(tmp_path, hub)
    with pytest.raises(DownloadError, match=r"inference: a link to a folder where the revision has files"):
        fetch(hub, local_dir=local)
    assert (mine / "model.py").read_text() == "print('mine')\n" and not (local / SHARD1).exists()
    report = fetch(hub, local_dir=local, overwrite=True)
    assert report.ok and not (local / "inference").is_symlink()
    assert (local / "inference" / "model.py").read_bytes() == b"print('hub')\n"
    assert (
        sorted(p.name for p in mine.iterdir()) == ["model.py"] and (mine / "model.py").read_text() == "print('mine')\n"
    )


def _save_records(path: str, rounds: int, start) -> None:
    start.wait()
    files = tuple(RemoteFile(f"f{i}.json", i, None, "0" * 40) for i in range(200))
    for k in range(rounds):
        Record(REPO, "main", C1, files, fetched=(f"f{k}.json",)).save(Path(path))


def test_records_saved_by_several_processes_at_once_stay_whole(tmp_path):
    """The ranks of a torchrun launch resolve one repo into one HF cache at once: with one temporary name
    their record saves renamed it from under each other (FileNotFoundError) or installed it empty."""
    path = tmp_path / "record.json"
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_save_records, args=(str(path), 150, start)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert Record.load(path).commit == C1 and not list(tmp_path.glob("*.partial"))


def test_an_unreadable_record_says_to_delete_it_and_deleting_it_works(hub, tmp_path):
    local = tmp_path / "local"
    assert fetch(hub, local_dir=local).ok
    (local / dl.RECORD_NAME).write_text("{")
    with pytest.raises(DownloadError, match=r"unreadable download record .*; delete it: the next `download` checks"):
        fetch(hub, local_dir=local)
    (local / dl.RECORD_NAME).unlink()
    report = fetch(hub, local_dir=local)
    assert report.ok and report.fetched == ()  # every file there checked against the Hub and claimed


def test_a_metadata_answer_without_the_hubs_headers_names_the_file(hub, tmp_path, monkeypatch):
    """huggingface_hub's FileMetadataError (no ETag: a proxy's answer) is an OSError without an errno: it
    reached the user as its bare text, naming no file."""

    def no_etag(*args, **kw):
        raise FileMetadataError("Distant resource does not seem to be on huggingface.co. It is possible that ...")

    monkeypatch.setattr(hub_fetch, "get_hf_file_metadata", no_etag)
    with pytest.raises(DownloadError, match=r"acme/tiny@\w+: .*: .* answered the file's metadata request without"):
        fetch(hub, local_dir=tmp_path / "local")


def test_a_link_at_a_partial_files_name_is_not_appended_to(hub, tmp_path):
    """The partial file was opened for appending through a link planted at its name: the transfer went into
    the link's target (a review, by reading)."""
    local = tmp_path / "local"
    listing = {f.path: f for f in hub_fetch.fetch_record(HfApi(endpoint=hub.url), REPO, None, retries=0,
                                                          backoff_s=0).files}  # fmt: skip
    partial = hub_fetch.partial_path(local, listing[SHARD1])
    partial.parent.mkdir(parents=True)
    victim = tmp_path / "precious.bin"
    victim.write_bytes(b"mine")
    partial.symlink_to(victim)
    report = fetch(hub, local_dir=local)
    assert report.ok and (local / SHARD1).read_bytes() == FILES1[SHARD1] and victim.read_bytes() == b"mine"


def test_verify_only_with_a_glob_that_matches_nothing_is_refused(hub, tmp_path):
    """`--verify-only --include 'x*'` (a typo) checked no file and said ok, exit 0 (an audit)."""
    local = tmp_path / "local"
    assert fetch(hub, local_dir=local).ok
    with pytest.raises(
        DownloadError,
        match=r"no file matches --include \['x\*'\] --exclude \[\] \(the revision has 5 files\); nothing to check",
    ):
        dl.verify_local(REPO, local_dir=local, include=["x*"])
    (local / dl.RECORD_NAME).unlink()  # a folder without our record: checked from its files
    with pytest.raises(DownloadError, match=r"no file matches --include \['x\*'\]"):
        dl.verify_local(REPO, local_dir=local, include=["x*"])
    assert dl.verify_local(REPO, local_dir=local, include=["*.json"]).files > 0
