"""Local checks behind `download`: hashes, records, safetensors headers, the index, error wording."""

from __future__ import annotations

import errno
import hashlib
import json
import struct
import threading

import pytest
import torch
from httpx2 import ConnectError
from safetensors.torch import save

from dsv41_convert.errors import DownloadError
from dsv41_convert.hub.download import parse_repo_ref
from dsv41_convert.hub.fetch import Stopped, _bar_class
from dsv41_convert.hub.hub_errors import hub_error, with_retries
from dsv41_convert.hub.integrity import (
    INDEX_NAME,
    Record,
    RemoteFile,
    Selection,
    check_checkpoint,
    check_files,
)
from dsv41_convert.store.file_digest import GIT_SHA1, hex_digest


def remote(path, data: bytes, lfs: bool) -> RemoteFile:
    sha = hashlib.sha256(data).hexdigest() if lfs else None
    return RemoteFile(path, len(data), sha, hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())


def test_git_blob_ids_match_git(tmp_path):
    # `git hash-object` of an empty file and of "hello\n"
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "hello").write_bytes(b"hello\n")
    assert hex_digest(tmp_path / "empty", GIT_SHA1) == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert hex_digest(tmp_path / "hello", GIT_SHA1) == "ce013625030ba8dba906f756967f9e9ca394464a"
    assert hex_digest(tmp_path / "hello") == "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"


def test_check_files_reports_each_kind(tmp_path):
    files = {"ok.safetensors": b"a" * 100, "bad.safetensors": b"b" * 100, "short.json": b"{}", "cfg.json": b"{1}"}
    records = [remote(p, d, p.endswith(".safetensors")) for p, d in files.items()]
    records.append(RemoteFile("gone.json", 3, None, "0" * 40))
    for path, data in files.items():
        (tmp_path / path).write_bytes(data)
    (tmp_path / "bad.safetensors").write_bytes(b"c" * 100)
    (tmp_path / "short.json").write_bytes(b"{")
    (tmp_path / "cfg.json").write_bytes(b"{2}")
    records.append(RemoteFile("no-hash.txt", 2, None, None))  # a record without hashes: the size only
    (tmp_path / "no-hash.txt").write_bytes(b"zz")
    found = {(p.path, p.kind) for p in check_files(tmp_path, records, workers=2)}
    assert found == {
        ("bad.safetensors", "sha256"),
        ("short.json", "size"),
        ("cfg.json", "git-sha1"),
        ("gone.json", "missing"),
    }
    assert check_files(tmp_path, records[:1]) == []


@pytest.mark.parametrize("workers", [1, 3])
def test_check_files_progress_counts_all_files_up_to_total(tmp_path, workers):
    records = []
    for i, size in enumerate([1000, (16 << 20) + 7, 0, 5000]):  # the second takes two chunks
        data = bytes([i]) * size
        (tmp_path / f"f{i}").write_bytes(data)
        records.append(remote(f"f{i}", data, lfs=i % 2 == 0))
    total = sum(r.size for r in records)
    seen = []
    assert check_files(tmp_path, records, workers=workers, progress=lambda *e: seen.append(e)) == []
    counts = [done for label, done, whole in seen if label == "verify" and whole == total]
    assert len(counts) == len(seen) and counts == sorted(counts)  # one bar, never going back
    assert total in counts[:-1]  # the files' own chunks add up to the total before the closing call


def test_record_round_trip(tmp_path):
    files = (RemoteFile("x", 1, None, "b" * 40), RemoteFile("y", 2, "c" * 64, None))
    selections = (Selection(("*.json",), ("tok*",)), Selection(("y",), ()))
    record = Record("o/n", "main", "a" * 40, files, selections)
    record.save(tmp_path / "r.json")
    assert Record.load(tmp_path / "r.json") == record
    assert [f.path for f in record.selected()] == ["y"]
    old = json.loads((tmp_path / "r.json").read_text())  # format 1: one selection as include / exclude
    del old["selections"]
    (tmp_path / "old.json").write_text(json.dumps(old | {"format": 1, "include": ["x*"], "exclude": []}))
    assert Record.load(tmp_path / "old.json").selections == (Selection(("x*",), ()),)
    assert Record.load(tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DownloadError, match=r"bad.json: unreadable download record"):
        Record.load(tmp_path / "bad.json")


def test_record_keeps_what_was_fetched_and_refuses_names_out_of_the_folder(tmp_path):
    """`fetched` and `names` round-trip (None: an older record, whose selections count); a record naming a file out of
    the folder, or whose `fetched` is not a list of names, is unreadable, not followed."""
    files = (RemoteFile("x", 1, None, "b" * 40), RemoteFile("sub/y", 2, "c" * 64, None))
    record = Record("o/n", "main", "a" * 40, files, fetched=("x",), names=("v1",))
    record.save(tmp_path / "r.json")
    assert Record.load(tmp_path / "r.json") == record and record.ours() == {"x"}
    assert Record("o/n", "main", "a" * 40, files).ours() == {"x", "sub/y"}
    data = json.loads((tmp_path / "r.json").read_text())
    for name, change, said in [
        ("abs", {"files": [{"path": "/etc/x", "size": 1}]}, "'/etc/x': not a relative path"),
        ("up", {"files": [{"path": "a/../../x", "size": 1}]}, r"'a/../../x': an empty, \. or \.\. part"),
        ("fetched", {"fetched": "x"}, "fetched is not a list of file names"),
        ("fetched_abs", {"fetched": ["x", "/etc/x"]}, "fetched '/etc/x': not a relative path"),
        ("fetched_up", {"fetched": ["../x"]}, r"fetched '\.\./x': an empty, \. or \.\. part"),
        ("names", {"names": "v1"}, "names is not a list of revision names"),
    ]:
        (tmp_path / f"{name}.json").write_text(json.dumps(data | change))
        with pytest.raises(DownloadError, match=rf"{name}.json: unreadable download record \(.*{said}"):
            Record.load(tmp_path / f"{name}.json")


def write_shard(path, tensors):
    path.write_bytes(save(tensors))


def test_broken_headers_are_problems(tmp_path):
    (tmp_path / "b.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    (tmp_path / "c.safetensors").write_bytes(struct.pack("<Q", 4) + b"{no}")
    write_shard(tmp_path / "d.safetensors", {"x": torch.zeros(3, 4)})
    (tmp_path / "d.safetensors").write_bytes((tmp_path / "d.safetensors").read_bytes()[:-1])
    problems = check_checkpoint(tmp_path, ["b.safetensors", "c.safetensors", "d.safetensors", "e.safetensors"])
    found = {p.path: p.found for p in problems if p.kind == "header"}
    assert set(found) == {"b.safetensors", "c.safetensors", "d.safetensors"}  # e does not exist: not its job
    assert "exceeds" in found["b.safetensors"] and "not valid JSON" in found["c.safetensors"]
    assert "truncated" in found["d.safetensors"] and str(tmp_path) not in found["d.safetensors"]


def test_check_checkpoint_size_and_index(tmp_path):
    write_shard(tmp_path / "s1.safetensors", {"a": torch.zeros(4), "b": torch.zeros(2)})
    write_shard(tmp_path / "s2.safetensors", {"c": torch.zeros(4)})
    index = {"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}}
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    paths = ["s1.safetensors", "s2.safetensors", INDEX_NAME]
    assert check_checkpoint(tmp_path, paths) == []

    with (tmp_path / "s2.safetensors").open("ab") as f:
        f.write(b"\0" * 8)  # trailing bytes the header does not account for
    index["weight_map"]["d"] = "s1.safetensors"
    index["weight_map"]["e"] = "s3.safetensors"
    del index["weight_map"]["b"]
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    problems = {(p.path, p.kind): p for p in check_checkpoint(tmp_path, paths)}
    assert set(problems) == {("s2.safetensors", "header"), ("s1.safetensors", "index"), ("s3.safetensors", "missing")}
    s1 = problems[("s1.safetensors", "index")]
    assert "(b)" in s1.found and "(d)" in s1.expected


@pytest.mark.parametrize(
    ("src", "want"),
    [
        ("deepseek-ai/DeepSeek-V4.1-Flash", ("deepseek-ai/DeepSeek-V4.1-Flash", None)),
        ("o/n@v1.0", ("o/n", "v1.0")),
        ("o/n@refs/pr/3", ("o/n", "refs/pr/3")),
        ("./ckpt", None),
        ("/abs/ckpt", None),
        ("a/b/c", None),
        ("name", None),
    ],
)
def test_parse_repo_ref(src, want):
    assert parse_repo_ref(src) == want


def test_hub_error_wording():
    full = hub_error(OSError(errno.ENOSPC, "No space"), repo_id="o/n", revision="main", endpoint="e", path="f")
    assert "disk full" in str(full) and "o/n@main: f" in str(full)
    net = hub_error(ConnectError("refused"), repo_id="o/n", revision="main", endpoint="http://h")
    assert "network error talking to http://h" in str(net)
    assert hub_error(ValueError("a bug"), repo_id="o/n", revision="main", endpoint="e") is None


def test_with_retries_retries_only_transient():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectError("reset")
        return "done"

    assert with_retries(flaky, retries=2, backoff_s=0, on_error=lambda e: None) == "done" and len(calls) == 3

    def broken():
        calls.append(1)
        raise ValueError("bug")

    calls.clear()
    with pytest.raises(ValueError):
        with_retries(broken, retries=5, backoff_s=0, on_error=lambda e: None)
    assert len(calls) == 1

    def down():
        raise ConnectError("refused")

    with pytest.raises(DownloadError, match=r"after 3 attempts"):
        with_retries(down, retries=2, backoff_s=0, on_error=lambda e: DownloadError("x: down"))
    with pytest.raises(DownloadError, match=r"\(after 1 attempt\)$"):  # --retries 0 said "after 1 attempts"
        with_retries(down, retries=0, backoff_s=0, on_error=lambda e: DownloadError("x: down"))


def test_progress_bar_stand_in_forwards_bytes():
    seen = []
    bar = _bar_class("f.safetensors", lambda *e: seen.append(e))(total=10, initial=4, desc="x", unit="B")
    with bar:
        bar.update(6)
    assert seen == [("f.safetensors", 4, 10), ("f.safetensors", 10, 10)]


def test_progress_bar_stand_in_stops_a_transfer_once_told():
    """http_get updates its bar before it writes each chunk: a set `stop` ends the transfer there."""
    stop = threading.Event()
    bar = _bar_class("f.safetensors", None, stop)(total=10)
    bar.update(4)
    stop.set()
    with pytest.raises(Stopped):
        bar.update(6)
    assert bar.n == 4
