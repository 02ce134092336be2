"""`download --verify-only` proves a folder is a whole checkpoint, with or without our download record.

Without the record (and without huggingface_hub's metadata) nothing lists the files that should be there:
the index and the shard names do. Each fault below is planted in a tiny published-layout checkpoint and
must exit 1 naming the file; the whole folder must still pass. With the record the same faults fail too,
a stray *.safetensors (which the record does not list) included.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from cli_run import run_cli
from safetensors.torch import load_file, save_file
from tiny_ckpt import make_tiny

from dsv41_convert.hub.integrity import INDEX_NAME, Record, RemoteFile, check_checkpoint
from dsv41_convert.hub.local import RECORD_NAME

REPO = "acme/tiny"
S1, S2, S3 = (f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3))


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    src = make_tiny(tmp_path_factory.mktemp("ckpt") / "src")
    assert sorted(p.name for p in src.glob("*.safetensors")) == [S1, S2, S3]
    return src


def _copy(whole: Path, tmp_path: Path, record: bool) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(whole, folder)
    if record:
        files = tuple(
            RemoteFile(p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir())
        )
        Record(REPO, "main", "0" * 40, files).save(folder / RECORD_NAME)
    return folder


def _verify(monkeypatch, capsys, folder: Path) -> tuple[int, dict, str]:
    """-> (exit code, the --json report, stderr)"""
    code, out, err = run_cli(monkeypatch, capsys, "download", REPO, "--local-dir", str(folder), "--verify-only",
                             "--json")  # fmt: skip
    return code, json.loads(out), err


def _remove(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).unlink()


def _no_weights(folder: Path) -> None:
    _remove(folder, S1, S2, S3, INDEX_NAME)


def _stray_copy(folder: Path) -> None:  # the one `shard` refuses as "duplicated"
    shutil.copyfile(folder / S2, folder / "model-00002-of-00004.safetensors")


def _tensor_twice(folder: Path) -> None:  # a tensor of S1 also in S3, the index unchanged
    one = next(iter(load_file(folder / S1).items()))
    save_file({**load_file(folder / S3), one[0]: one[1]}, folder / S3, metadata={"format": "pt"})


def _unindexed(folder: Path) -> None:  # a shard the index does not name, holding tensors nobody else has
    name = next(iter(load_file(folder / S3)))
    save_file({"extra.weight": load_file(folder / S3)[name]}, folder / "extra.safetensors", metadata={"format": "pt"})


FAULTS = {  # fault -> (plant it, (file, kind) it must report)
    "empty folder": (lambda f: [p.unlink() for p in f.iterdir() if p.name != RECORD_NAME], ("config.json", "missing")),
    "no config.json": (lambda f: _remove(f, "config.json"), ("config.json", "missing")),
    "no weight shards": (_no_weights, ("model.safetensors", "missing")),
    "no index, several shards": (lambda f: _remove(f, INDEX_NAME), (INDEX_NAME, "missing")),
    "no index, a shard gone": (lambda f: _remove(f, INDEX_NAME, S2), (S2, "missing")),
    "a shard the index names gone": (lambda f: _remove(f, S3), (S3, "missing")),
    "a *.safetensors the index does not name": (_unindexed, ("extra.safetensors", "extra")),
    "a copy of a shard under another name": (_stray_copy, ("model-00002-of-00004.safetensors", "duplicate")),
    "one tensor in two shards": (_tensor_twice, (S3, "duplicate")),
    # not files, which `shard` lists among the *.safetensors and refuses: the files' lists left them out (exit 0)
    "a folder named *.safetensors": (lambda f: (f / "extra.safetensors").mkdir(), ("extra.safetensors", "extra")),
    "a link to no file named *.safetensors": (
        lambda f: (f / "extra.safetensors").symlink_to(f / "gone.safetensors"),
        ("extra.safetensors", "extra"),
    ),
    "a link loop named *.safetensors": (
        lambda f: (f / "extra.safetensors").symlink_to(f / "extra.safetensors"),
        ("extra.safetensors", "extra"),
    ),
    "a FIFO named *.safetensors": (lambda f: os.mkfifo(f / "extra.safetensors"), ("extra.safetensors", "extra")),
}


@pytest.mark.parametrize("record", [False, True], ids=["no record", "record"])
def test_a_whole_folder_passes_and_says_what_it_checked(whole, tmp_path, monkeypatch, capsys, record):
    code, report, err = _verify(monkeypatch, capsys, _copy(whole, tmp_path, record))
    assert (code, report["ok"], report["problems"]) == (0, True, []), err
    assert "whole checkpoint (config.json; every shard the index names" in report["checks"]
    if record:
        assert report["checks"].startswith("sizes, sha256 / git ids from the download record")
    else:
        assert "no download record, so no hashes; not checked: the tensor bytes, that the folder is" in report["checks"]


def test_a_single_file_checkpoint_needs_no_index(whole, tmp_path, monkeypatch, capsys):
    folder = _copy(whole, tmp_path, record=False)
    tensors = {}
    for shard in (S1, S2, S3):
        tensors.update(load_file(folder / shard))
    _remove(folder, S1, S2, S3, INDEX_NAME)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    code, report, err = _verify(monkeypatch, capsys, folder)
    assert (code, report["problems"]) == (0, []), err


@pytest.mark.parametrize("record", [False, True], ids=["no record", "record"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_planted_fault_fails_naming_the_file(whole, tmp_path, monkeypatch, capsys, fault, record):
    folder = _copy(whole, tmp_path, record)
    plant, (path, kind) = FAULTS[fault]
    plant(folder)
    code, report, err = _verify(monkeypatch, capsys, folder)
    found = {(p["path"], p["kind"]) for p in report["problems"]}
    assert code == 1 and not report["ok"], (fault, report)
    assert (path, kind) in found, found
    assert f"error: {path}: " in err  # and on stderr, one line per problem


def test_without_an_index_the_shard_names_count_the_shards(whole, tmp_path):
    folder = _copy(whole, tmp_path, record=False)
    _remove(folder, INDEX_NAME, S1)
    shutil.copyfile(folder / S2, folder / "model-00002-of-00005.safetensors")  # of another count
    problems = {(p.path, p.kind): p for p in check_checkpoint(folder, [p.name for p in folder.iterdir()], whole=True)}
    assert set(problems) == {
        (S1, "missing"),
        ("model-00002-of-00005.safetensors", "extra"),
        ("model-00002-of-00005.safetensors", "duplicate"),
        (INDEX_NAME, "missing"),
    }
    assert str(problems[(S1, "missing")]) == f"{S1}: missing: found no file, expected shard 1 of the 3 the other " \
        "shards' names count"  # fmt: skip
    assert "beside 3 shards" in problems[(INDEX_NAME, "missing")].found


def test_whole_is_off_by_default(whole, tmp_path):
    """`download` itself (and the unit tests of the headers and the index) call check_checkpoint without it."""
    folder = _copy(whole, tmp_path, record=False)
    _remove(folder, "config.json")
    _stray_copy(folder)
    paths = [p.name for p in folder.iterdir()]
    assert check_checkpoint(folder, paths) == []  # the index says nothing of a file it does not name
    assert {p.kind for p in check_checkpoint(folder, paths, whole=True)} == {"missing", "extra", "duplicate"}


def test_index_mismatch_reads_as_one_sentence(whole, tmp_path):
    folder = _copy(whole, tmp_path, record=False)
    index = json.loads((folder / INDEX_NAME).read_text())
    gone = next(t for t, f in sorted(index["weight_map"].items()) if f == S3)
    tensors = load_file(folder / S3)
    n = len(tensors)
    del tensors[gone]
    save_file(tensors, folder / S3, metadata={"format": "pt"})
    (problem,) = check_checkpoint(folder, [S3, INDEX_NAME])
    assert str(problem) == (
        f"{S3}: index: found {n - 1} tensors, expected the {n} tensors the index puts here, 1 of them absent from "
        f"the file ({gone})"
    )
    tensors["extra.weight"] = tensors.pop(next(iter(tensors)))  # renamed: one extra, two absent
    save_file(tensors, folder / S3, metadata={"format": "pt"})
    (problem,) = check_checkpoint(folder, [S3, INDEX_NAME])
    assert problem.found == f"{n - 1} tensors, 1 of them not in the index (extra.weight)"
    assert problem.expected.startswith(f"the {n} tensors the index puts here, 2 of them absent from the file (")
