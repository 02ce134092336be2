"""Done records and manifest helpers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.store.file_digest import sha256_file
from dsv41_convert.store.manifest import atomic_write, finished, read_done, source_revision, write_done
from dsv41_convert.store.manifest_check import check_folder, read_manifest


def test_done_record_checks_size_sha_and_plan(tmp_path):
    f = tmp_path / "model0-mp2.safetensors"
    f.write_bytes(b"abc" * 1000)
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    assert sha256_file(f, chunk=7) == sha
    write_done(tmp_path, f.name, 3000, sha, "plan-a")
    assert read_done(tmp_path, f.name)["sha256"] == sha
    assert finished(tmp_path, [f.name], "plan-a") == {f.name}
    assert finished(tmp_path, [f.name], "plan-b") == set()  # other options
    f.write_bytes(b"abd" * 1000)  # same size, other bytes
    assert finished(tmp_path, [f.name], "plan-a") == set()
    f.write_bytes(b"abc" * 999)
    assert finished(tmp_path, [f.name], "plan-a") == set()
    assert finished(tmp_path, ["missing.safetensors"], "plan-a") == set()


def test_finished_sorts_many_files_hashed_at_once(tmp_path):
    """Of several recorded files, only the intact ones of this plan count, whichever thread hashed them."""
    names = [f"model{r}-mp8.safetensors" for r in range(8)]
    for r, name in enumerate(names):
        data = bytes([r]) * (3 << 20)
        (tmp_path / name).write_bytes(data)
        write_done(tmp_path, name, len(data), hashlib.sha256(data).hexdigest(), "plan-b" if r == 5 else "plan-a")
    with open(tmp_path / names[2], "r+b") as f:  # one byte flipped, size kept
        f.seek(1 << 20)
        f.write(b"\xff")
    (tmp_path / names[6]).unlink()
    assert finished(tmp_path, names, "plan-a") == {names[r] for r in (0, 1, 3, 4, 7)}


def test_atomic_write_leaves_no_temporary(tmp_path):
    atomic_write(tmp_path / "config.json", b"{}")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_source_revision_from_hub_snapshot_path():
    rev = "dba1be0a40aa45a94ad051997016db3960a90277"
    assert source_revision(Path(f"/c/models--deepseek-ai--DeepSeek-V4.1-Flash/snapshots/{rev}")) == rev
    assert source_revision(Path("/data/ckpt")) is None


@pytest.mark.parametrize("kind", ["symbolic", "hard"])
def test_atomic_write_never_writes_through_a_link_at_its_temporarys_name(tmp_path, kind):
    """The temporary's name is predictable (NAME.PID.partial): a link planted there was opened and written
    through, into its target, before the rename moved the link itself into place (a hard link: truncated
    in place, the other name's file with it)."""
    import os

    victim = tmp_path / "precious.txt"
    victim.write_text("mine\n")
    temporary = tmp_path / f"config.json.{os.getpid()}.partial"
    temporary.symlink_to(victim) if kind == "symbolic" else os.link(victim, temporary)
    atomic_write(tmp_path / "config.json", b"{}")
    assert victim.read_text() == "mine\n" and (tmp_path / "config.json").read_bytes() == b"{}"
    assert not (tmp_path / "config.json").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "precious.txt"]  # fmt: skip


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_atomic_write_names_its_file_when_the_disk_is_full(tmp_path, monkeypatch, where):
    """A full disk while writing manifest.json said only "No space left on device" (an audit), and an error the
    system gave naming the temporary (a read-only folder: "manifest.json.4242.partial: Read-only file system", a
    helper's hunt) named a file the user never saw: the error names the file, and no temporary is left."""
    import errno
    import os

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device", *([str(args[0])] if where == "replace" else []))

    monkeypatch.setattr(os, where, full)
    with pytest.raises(OSError) as caught:
        atomic_write(tmp_path / "manifest.json", b"{}")
    assert caught.value.filename == str(tmp_path / "manifest.json") and caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


CONFIGS = {"config.json": b"{}", "hf_config.json": b"{ }"}  # beside the rank files of every shard conversion


def _manifest_folder(folder: Path, files: dict[str, bytes], tp: int | None = None) -> None:
    """`files` written, and a manifest.json recording each one's size and sha256, written here by hand; with a tp
    (a shard conversion's manifest), CONFIGS too where `files` does not give them."""
    folder.mkdir()
    files = CONFIGS | files if tp else files
    for name, data in files.items():
        (folder / name).write_bytes(data)
    records = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}
    manifest = {"format": "dsv41-convert manifest v1", "options": {"tp": tp}, "files": records}
    (folder / "manifest.json").write_text(json.dumps(manifest))


FILES = {
    "config.json": b"{}",
    "hf_config.json": b"{ }",
    "model0-mp2.safetensors": b"a" * 100,
    "model1-mp2.safetensors": b"b" * 100,
    "tokenizer.json": b"{ }",
    "tokenizer_config.json": b"{  }",
}


@pytest.mark.parametrize("damaged", sorted(FILES))
def test_check_compares_every_listed_file(tmp_path, damaged):
    """Each file the manifest lists, the first and the last in name order included, is hashed and compared: one
    byte changed in any of them (its size kept) is reported, naming it, and every other file is checked."""
    _manifest_folder(tmp_path / "out", FILES, tp=2)
    assert check_folder(tmp_path / "out").checked == sorted(FILES)
    data = bytearray(FILES[damaged])
    data[-1] ^= 1
    (tmp_path / "out" / damaged).write_bytes(data)
    result = check_folder(tmp_path / "out")
    assert not result.ok
    assert len(result.problems) == 1 and damaged in result.problems[0], result.problems
    assert result.checked == sorted(set(FILES) - {damaged})


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_check_names_a_rank_file_its_manifest_leaves_out(tmp_path, rank):
    """A tp-3 manifest that does not list one of its rank files (rank 0 too) fails the check, naming that file."""
    files = {f"model{r}-mp3.safetensors": bytes([r]) * 10 for r in range(3)} | {"config.json": b"{}"}
    _manifest_folder(tmp_path / "out", files, tp=3)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    gone = f"model{rank}-mp3.safetensors"
    del manifest["files"][gone]
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "out" / gone).unlink()
    result = check_folder(tmp_path / "out")
    assert not result.ok and [p for p in result.problems if p.startswith(f"{gone}:")], result.problems


@pytest.mark.parametrize(
    ("kind", "options", "gone"),
    [("shard", {"tp": 2}, n) for n in CONFIGS]
    + [("export", {"format": "bf16"}, n) for n in ("config.json", "model.safetensors.index.json")],
)
def test_check_names_a_config_its_manifest_leaves_out(tmp_path, kind, options, gone):
    """A shard manifest edited to drop config.json or hf_config.json, or an export's to drop config.json or its
    index, fails the check naming the file, there or not: such a manifest passed `check` (exit 0, a warning)
    with the config changed after the run, which verify and a loader then read."""
    files = {"model0-mp2.safetensors": b"a", "model1-mp2.safetensors": b"b", "model.safetensors.index.json": b"{}"}
    _manifest_folder(tmp_path / "out", CONFIGS | files)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["options"] = options
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    assert check_folder(tmp_path / "out").ok
    del manifest["files"][gone]
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "out" / gone).write_text('{"norm_eps": 0.5}')
    problems = check_folder(tmp_path / "out").problems
    assert problems == [
        f"{gone}: {'a shard conversion' if kind == 'shard' else 'an export'} writes it, not listed in manifest.json"
    ]
    (tmp_path / "out" / gone).unlink()
    assert check_folder(tmp_path / "out").problems == [problems[0] + " nor in the folder"]


@pytest.mark.parametrize("there", [False, True])
def test_check_names_a_shard_the_index_names_and_the_manifest_leaves_out(tmp_path, there):
    """An export's manifest edited to drop one of its shards (the shard removed, or left unlisted) fails the check
    naming the shard: the manifest vouches for the index, and the index sends a loader to that shard; with the
    shard gone, check passed (exit 0; a helper's hunt). An index that is no JSON object adds no line of its own."""
    shards = {f"model-0000{i}-of-00002.safetensors": bytes([i]) * 8 for i in (1, 2)}
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "b.weight": "model-00002-of-00002.safetensors"}}  # fmt: skip
    files = {"config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode()} | shards
    _manifest_folder(tmp_path / "out", files)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    manifest["options"] = {"format": "bf16"}
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    assert check_folder(tmp_path / "out").ok
    del manifest["files"]["model-00002-of-00002.safetensors"]
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    if not there:
        (tmp_path / "out" / "model-00002-of-00002.safetensors").unlink()
    said = "model-00002-of-00002.safetensors: model.safetensors.index.json names it, not listed in manifest.json"
    assert check_folder(tmp_path / "out").problems == [said + ("" if there else " nor in the folder")]
    for broken in (b"[1, 2]", b"not json", b'{"weight_map": 3}'):
        (tmp_path / "out" / "model.safetensors.index.json").write_bytes(broken)
        problems = check_folder(tmp_path / "out").problems
        index_lines = [p for p in problems if p.startswith("model.safetensors.index.json:")]
        assert len(problems) == 1 + there and index_lines and "manifest says" in index_lines[0], problems


def test_check_names_the_rank_file_of_a_tp_1_manifest(tmp_path):
    """A tp-1 manifest that lists no model0-mp1.safetensors, and a folder without it, fails the check naming it:
    a tp-1 conversion is one rank file, and a check that skipped tp 1 passed a folder holding only config.json."""
    _manifest_folder(tmp_path / "out", {"model0-mp1.safetensors": b"w" * 64, "config.json": b"{}"}, tp=1)
    assert check_folder(tmp_path / "out").ok
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    del manifest["files"]["model0-mp1.safetensors"]
    (tmp_path / "out" / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "out" / "model0-mp1.safetensors").unlink()
    result = check_folder(tmp_path / "out")
    assert not result.ok and [p for p in result.problems if p.startswith("model0-mp1.safetensors:")], result.problems


@pytest.mark.parametrize(
    ("files", "said"),
    [
        ({}, "no `files` object"),  # checked nothing, and said ok
        ({"sub/../../x.safetensors": {"size": 1, "sha256": "0" * 64}}, "not a plain file name"),  # outside OUT
        ({"sub/config.json": {"size": 2, "sha256": "0" * 64}}, "not a plain file name"),
    ],
)
def test_read_manifest_refuses_an_empty_list_and_names_with_folders(tmp_path, files, said):
    """manifest.json lists plain file names of OUT, at least one: a manifest listing none made `check` pass on any
    folder, and a name with a folder part made it hash a file elsewhere (`sub/../../x` leaves OUT)."""
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "dsv41-convert manifest v1", "files": files}))
    with pytest.raises(VerifyInputError, match=said):
        read_manifest(tmp_path)


def test_check_for_one_tp_names_an_unlisted_rank_file_of_that_tp(tmp_path):
    """check_folder(tp=2) leaves out the rank files of other tps (another conversion beside this one), but a
    tp-2 rank file in the folder that the manifest does not list is this conversion's problem: named. Leaving
    out every rank file passed a manifest (one without options.tp) that forgot a rank."""
    _manifest_folder(tmp_path / "out", {"model0-mp2.safetensors": b"a" * 10, "config.json": b"{}"}, tp=None)
    (tmp_path / "out" / "model1-mp2.safetensors").write_bytes(b"b" * 10)
    (tmp_path / "out" / "model0-mp4.safetensors").write_bytes(b"c" * 10)
    result = check_folder(tmp_path / "out", tp=2)
    assert [p.split(":")[0] for p in result.problems] == ["model1-mp2.safetensors"], result.problems


def test_a_complete_manifest_of_many_ranks_passes_and_one_missing_many_is_one_line(tmp_path):
    """A tp-32 manifest listing all 32 rank files passes (past 16 ranks the missing ones are summed up in one line,
    and that summary once fired on tp alone: a complete folder refused); a tp-40 manifest listing 2 of its rank
    files fails with that single line, naming the count 2."""
    _manifest_folder(tmp_path / "a", {f"model{r}-mp32.safetensors": bytes([r]) for r in range(32)}, tp=32)
    result = check_folder(tmp_path / "a")
    assert result.ok and len(result.checked) == 32 + len(CONFIGS), result.problems
    _manifest_folder(tmp_path / "b", {f"model{r}-mp40.safetensors": bytes([r]) for r in range(2)}, tp=40)
    problems = check_folder(tmp_path / "b").problems
    assert problems == [
        "manifest.json says tp 40 but lists 2 of its rank files "
        "(model2-mp40.safetensors, model3-mp40.safetensors, model4-mp40.safetensors, ... missing)"
    ]
