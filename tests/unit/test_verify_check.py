"""`check OUT`: manifest sizes and sha256, naming the bad file."""

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import run_cli

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.store.manifest import FORMAT
from dsv41_convert.store.manifest_check import check_folder, our_manifest

CONFIGS = {"config.json": b"{}", "hf_config.json": b"{ }"}  # what a shard conversion writes beside its rank files


def _folder(tmp_path, files: dict[str, bytes]):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    entries = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
    (tmp_path / "manifest.json").write_text(json.dumps({"format": FORMAT, "files": entries}))
    return tmp_path


def test_clean_folder_passes(tmp_path):
    result = check_folder(_folder(tmp_path, {"model0-mp1.safetensors": b"abc" * 100, "config.json": b"{}"}))
    assert result.ok and sorted(result.checked) == ["config.json", "model0-mp1.safetensors"]


@pytest.mark.parametrize("threads", [None, 1, 3])
def test_flipped_byte_truncation_and_missing_file_are_named(tmp_path, threads):
    folder = _folder(tmp_path, {"a.safetensors": b"x" * 64, "b.safetensors": b"y" * 64, "c.json": b"{}"})
    (folder / "a.safetensors").write_bytes(b"x" * 63 + b"z")
    (folder / "b.safetensors").write_bytes(b"y" * 60)
    (folder / "c.json").unlink()
    result = check_folder(folder, threads=threads)
    assert not result.ok and result.checked == []
    a, b, c = result.problems
    assert a.startswith("a.safetensors: sha256")
    assert b.startswith("b.safetensors: 60 bytes, manifest says 64")
    assert c.startswith("c.json: missing")


def test_missing_or_foreign_manifest_is_an_input_error(tmp_path):
    with pytest.raises(VerifyInputError, match=r"manifest\.json: not found"):
        check_folder(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other", "files": {}}))
    with pytest.raises(VerifyInputError, match="format 'other'"):
        check_folder(tmp_path)
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format": FORMAT, "files": {"../x": {"size": 1, "sha256": ""}}})
    )
    with pytest.raises(VerifyInputError, match="plain file name"):
        check_folder(tmp_path)


def test_check_cli_reports_the_same_at_any_workers_and_refuses_zero(tmp_path, monkeypatch, capsys):
    files = {f"model{r}-mp4.safetensors": bytes([r]) * (1 << 16) for r in range(4)} | {"config.json": b"{}"}
    folder = _folder(tmp_path, files)
    (folder / "model2-mp4.safetensors").write_bytes(b"\x09" * (1 << 16))  # same size, other bytes
    reports = []
    for workers in ([], ["--workers", "1"], ["--workers", "4"], ["--workers", "auto"]):
        code, out, err = run_cli(monkeypatch, capsys, "check", str(folder), "--json", *workers)
        assert code == 1 and "model2-mp4.safetensors: sha256" in err
        reports.append(json.loads(out))
    assert all(r == reports[0] for r in reports) and reports[0]["problems"][0].startswith("model2-mp4.safetensors")
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder), "--workers", "0")
    assert code == 2 and "--workers" in err


def test_a_rank_file_the_manifest_leaves_out_and_a_stray_one_are_named(tmp_path):
    """A manifest of tp 2 that lists rank 0 only, and a safetensors file nobody listed (another tp's rank
    file dropped in): both were passed as long as the listed files matched."""
    folder = _folder(tmp_path, {"model0-mp2.safetensors": b"a" * 64, **CONFIGS})
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(manifest | {"options": {"tp": 2}}))
    (folder / "model0-mp4.safetensors").write_bytes(b"b" * 64)
    result = check_folder(folder)
    assert result.problems == [
        "model1-mp2.safetensors: a tp-2 conversion's rank file (manifest.json says tp 2), neither listed in it "
        "nor in the folder",
        "model0-mp4.safetensors: in the folder but not in manifest.json (another conversion's file?)",
    ]
    (folder / "model1-mp2.safetensors").write_bytes(b"c" * 64)
    assert check_folder(folder).problems[0] == (
        "model1-mp2.safetensors: a tp-2 conversion's rank file (manifest.json says tp 2), not listed in it"
    )
    assert sorted(result.checked) == ["config.json", "hf_config.json", "model0-mp2.safetensors"]


def test_files_put_beside_the_conversion_are_named_as_unchecked(tmp_path, monkeypatch, capsys):
    """A generation_config.json or a chat-template folder copied into an export after it finished: a loader
    reads them, the manifest vouches for none, and `check` passed without a word. Now named on stderr and in
    --json `unchecked` (folders as NAME/); the verdict stays the listed files' (exit 0); the run's own hidden
    state, any other hidden entry (.git/, .DS_Store: no loader reads them) and the manifest are not named."""
    folder = _folder(tmp_path, {"model-00001-of-00001.safetensors": b"a" * 64, "config.json": b"{}"})
    (folder / "generation_config.json").write_text("{}")
    (folder / "encoding").mkdir()
    (folder / ".dsv41-convert").mkdir()
    (folder / ".git").mkdir()  # hidden entries no loader reads (README: aside, as the runs' own records)
    (folder / ".DS_Store").write_bytes(b"\0")
    (folder / "manifest-fragment-mp2-r1.json").write_text("{}")  # a share's record, beside its last share's manifest
    code, out, err = run_cli(monkeypatch, capsys, "check", str(folder), "--json")
    assert code == 0 and json.loads(out)["unchecked"] == ["encoding/", "generation_config.json"]
    assert f"{folder}: not in manifest.json, so not checked: encoding/, generation_config.json" in err
    (folder / "generation_config.json").unlink()
    (folder / "encoding").rmdir()
    code, out, err = run_cli(monkeypatch, capsys, "check", str(folder), "--json")
    assert code == 0 and json.loads(out)["unchecked"] == [] and "not checked" not in err


def test_a_manifest_of_a_huge_tp_is_one_line_at_once(tmp_path):
    """options.tp = 10**9 in a damaged manifest: `check` looped over a billion ranks (killed after 20 s)."""
    folder = _folder(tmp_path, {"model0-mp2.safetensors": b"a" * 64, "model1-mp2.safetensors": b"b" * 64, **CONFIGS})
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(manifest | {"options": {"tp": 10**9}}))
    problems = check_folder(folder).problems
    assert problems[0] == (
        "manifest.json says tp 1000000000 but lists 0 of its rank files (model0-mp1000000000.safetensors, "
        "model1-mp1000000000.safetensors, model2-mp1000000000.safetensors, ... missing)"
    )
    assert len(problems) == 1
    (folder / "manifest.json").write_text(json.dumps(manifest | {"options": {"tp": 16}}))  # 16 missing: each named
    assert len(check_folder(folder).problems) == 16
    (tmp_path / "late").mkdir()
    late = _folder(tmp_path / "late", {f"model{r}-mp40.safetensors": b"x" for r in range(20, 40)} | CONFIGS)
    manifest = json.loads((late / "manifest.json").read_text())
    (late / "manifest.json").write_text(json.dumps(manifest | {"options": {"tp": 40}}))  # ranks 20..39 listed
    assert check_folder(late).problems == [
        "manifest.json says tp 40 but lists 20 of its rank files (model0-mp40.safetensors, "
        "model1-mp40.safetensors, model2-mp40.safetensors, ... missing)"
    ]


def test_our_manifest_answers_only_for_a_well_formed_one_of_ours(tmp_path):
    """The one reader behind "did a run of ours write here?" (shard/export's stranger check) and "what sha256
    does CONVERTED record?" (verify's provenance): None wherever read_manifest would refuse."""
    folder = _folder(tmp_path, {"model0-mp1.safetensors": b"abc"})
    assert our_manifest(folder) == json.loads((folder / "manifest.json").read_text())
    broken = [
        {"format": "other/1", "files": {"model0-mp1.safetensors": {"size": 3, "sha256": "00"}}},
        {"format": FORMAT, "files": {"model0-mp1.safetensors": {"size": "3", "sha256": "00"}}},
        {"format": FORMAT, "files": {"../model0-mp1.safetensors": {"size": 3, "sha256": "00"}}},
        {"format": FORMAT, "files": []},
        {"format": FORMAT, "files": {"": {"size": 3, "sha256": "00"}}},
        ["not", "an", "object"],
    ]
    for doc in broken:
        (folder / "manifest.json").write_text(json.dumps(doc))
        assert our_manifest(folder) is None, doc
    (folder / "manifest.json").write_text('{"format": ')
    assert our_manifest(folder) is None
    (folder / "manifest.json").unlink()
    assert our_manifest(folder) is None and our_manifest(tmp_path / "absent") is None


@pytest.mark.parametrize("shared", [False, True], ids=["a-run", "a-share"])
def test_a_folder_a_run_is_writing_is_named_in_use_by_every_reader(tmp_path, monkeypatch, capsys, shared):
    """check, verify and reference-logits of rank files, while `shard` (or one share of it, `--ranks`) writes into
    the folder: check said "manifest.json: not found; an unfinished conversion ...; continue it with `shard` ...
    --resume" (a second writer, refused), or, once a run had removed a finished set's manifest.json, named the
    files it was replacing as missing (exit 1); verify named a rank file not yet renamed as missing. Each reader
    now names the run that holds the folder (exit 2), as a second writer is told, and reads it once it ends."""
    from dsv41_convert.store.lock import hold

    (tmp_path / "mp2").mkdir()
    folder = _folder(tmp_path / "mp2", {"model0-mp2.safetensors": b"a" * 64, "config.json": b"{}"})
    files = ["model1-mp2.safetensors"] if shared else []
    ref = tmp_path / "ref.safetensors"
    with hold(folder, shared=shared, files=files):
        for args in (
            ["check", str(folder)],
            ["check", str(folder), "--json"],
            ["verify", str(folder), "--reference-logits", str(ref)],
            ["reference-logits", str(folder), str(tmp_path / "out.safetensors"), "--stream-layers"],
        ):
            code, out, err = run_cli(monkeypatch, capsys, *args)
            assert code == 2 and f"{folder.resolve()}: in use by pid {os.getpid()}" in err, (args, err)
            assert "Traceback" not in err
            assert "--json" not in args or json.loads(out)["exit_code"] == 2
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder))
    assert code == 0, err


def test_the_summary_line_counts_in_the_singular_and_the_plural(tmp_path, monkeypatch, capsys):
    """`check` said "1 files match the manifest, 1 do not": each count takes its own verb."""
    folder = _folder(tmp_path, {"a.json": b"{}", "b.json": b"[]"})
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder))
    assert code == 0 and "2 files match the manifest, 0 do not" in err, err
    (folder / "b.json").write_bytes(b"[1]")
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder))
    assert code == 1 and "1 file matches the manifest, 1 does not" in err, err
    (folder / "a.json").write_bytes(b"{1}")
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder))
    assert code == 1 and "0 files match the manifest, 2 do not" in err, err


def test_the_summary_counts_what_the_manifest_does_not_list_apart_from_the_files_that_differ(
    tmp_path, monkeypatch, capsys
):
    """A .safetensors file the manifest does not list, beside two listed files that match: `check` said "2 files
    match the manifest, 1 does not", counting it among the listed files that differ. It still fails the check
    (exit 1, named), counted apart; a listed file that differs is still counted as one."""
    folder = _folder(tmp_path, {"a.json": b"{}", "b.json": b"[]"})
    (folder / "model-extra.safetensors").write_bytes(b"x" * 16)
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder))
    assert code == 1 and "model-extra.safetensors: in the folder but not in manifest.json" in err, err
    assert "2 files match the manifest, 0 do not; 1 problem with what it does not list (named above)" in err, err
    (folder / "b.json").write_bytes(b"[1]")
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder))
    assert code == 1 and "1 file matches the manifest, 1 does not; 1 problem with what it does not list" in err, err
    result = check_folder(folder)
    assert (result.not_listed, result.mismatched, len(result.problems)) == (1, 1, 2)


def test_a_link_that_leads_to_no_file_is_a_problem_named_not_an_input_error(tmp_path, monkeypatch, capsys):
    """A rank file replaced by a link whose target is gone (a deleted blob, a copy moved away), a stray
    *.safetensors link beside the set, or a link in a loop: `check` said "error: .../model1-mp2.safetensors: No such
    file or directory" (exit 2) of a name `ls` shows, before file_digest could name the link (the stat of the shards'
    times followed it). Now each is a problem of the check, named (exit 1)."""
    files = {"model0-mp2.safetensors": b"a" * 64, "model1-mp2.safetensors": b"b" * 64, **CONFIGS}
    folder = _folder(tmp_path, files)
    (folder / "model1-mp2.safetensors").unlink()
    (folder / "model1-mp2.safetensors").symlink_to(tmp_path / "gone")
    (folder / "stray.safetensors").symlink_to(tmp_path / "gone")
    (folder / "loop.safetensors").symlink_to("loop.safetensors")
    code, out, err = run_cli(monkeypatch, capsys, "check", str(folder), "--json")
    assert code == 1 and "No such file" not in err, err
    assert json.loads(out)["problems"] == [
        "loop.safetensors: in the folder but not in manifest.json (another conversion's file?)",
        "stray.safetensors: in the folder but not in manifest.json (another conversion's file?)",
        "model1-mp2.safetensors: a broken link where manifest lists a file of 64 bytes",
    ]
