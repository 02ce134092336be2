"""What `shard`, `check` and `demo` may do to a folder, with the faults an audit planted (each failed before
the fix): OUT that is SRC under another path, --overwrite over files no run of ours wrote, an --overwrite
stopped half-way then --resume, --dry-run with what the real run refuses, a damaged done record, the worker
count reported, and `check` on a folder that is not finished."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_cli
from tiny_ckpt import make_tiny

import dsv41_convert.convert.execute as execute_mod
from dsv41_convert.store.manifest import DONE_DIR


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("safety") / "src", vision=False)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def shard(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(monkeypatch, capsys, "shard", *args)


def test_out_that_is_src_under_a_bind_mount_is_refused_and_src_kept(src, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "b"
    shutil.copytree(src, copy)
    mount = tmp_path / "bm"
    mount.mkdir()
    if subprocess.run(["mount", "--bind", str(copy), str(mount)], capture_output=True).returncode:
        pytest.skip("bind mounts need privileges here")
    try:
        before = tree(copy)
        for out in (mount, mount / "sub"):
            code, _, err = shard(monkeypatch, capsys, str(copy), str(out), "--tp", "2", "--overwrite")
            assert code == 2 and "is the source folder" in err and "another path" in err, err
        assert tree(copy) == before
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_out_in_a_folder_of_src_under_a_bind_mount_is_refused(src, tmp_path, monkeypatch, capsys):
    """A bind mount of a folder inside SRC (SRC/sub at BIND): `export SRC BIND`, `shard SRC BIND/mp2` and
    `reference-logits SRC BIND/ref.safetensors` wrote into SRC, exit 0 (an audit: only SRC itself was
    compared)."""
    copy = tmp_path / "b"
    shutil.copytree(src, copy)
    (copy / ".cache" / "sub").mkdir(parents=True)
    mount = tmp_path / "bm"
    mount.mkdir()
    if subprocess.run(["mount", "--bind", str(copy / ".cache" / "sub"), str(mount)], capture_output=True).returncode:
        pytest.skip("bind mounts need privileges here")
    try:
        before = tree(copy)
        for args in (("shard", str(copy), str(mount / "mp2"), "--tp", "2"),
                     ("export", str(copy), str(mount), "--format", "fp8-fp4"),
                     ("reference-logits", str(copy), str(mount / "ref.safetensors"))):  # fmt: skip
            code, _, err = run_cli(monkeypatch, capsys, *args)
            assert code == 2 and f"({mount} is {copy / '.cache' / 'sub'} under another path" in err, (args, err)
        assert tree(copy) == before
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("dry_run", [False, True])
def test_overwrite_never_removes_a_checkpoint_no_run_of_ours_wrote(src, tmp_path, monkeypatch, capsys, dry_run):
    """OUT holds a downloaded Hugging Face checkpoint: --overwrite used to delete its shards and index."""
    out = tmp_path / "out"
    shutil.copytree(src, out)
    before = tree(out)
    extra = ["--dry-run"] if dry_run else []
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--overwrite", *extra)
    assert code == 2 and "which no dsv41-convert run wrote there" in err and "model-000" in err, err
    assert tree(out) == before


def test_overwrite_still_replaces_a_conversion_of_ours(src, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "4")[0] == 0
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.glob("model*")) == ["model0-mp2.safetensors", "model1-mp2.safetensors"]


def test_an_overwrite_stopped_before_writing_is_continued_by_resume(src, tmp_path, monkeypatch, capsys):
    """fp4 rank files done, then `--overwrite --expert-dtype fp8` stopped by Ctrl-C: `--resume --expert-dtype
    fp8` was refused ("finished by a run with other options") by the old files' done records."""
    out, clean = tmp_path / "out", tmp_path / "clean"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2")[0] == 0

    def stopped(*_args, **_kw):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(execute_mod, "_run", stopped)
        code, _, _ = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--overwrite", "--expert-dtype", "fp8")
    assert code == 130
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--resume", "--expert-dtype", "fp8")
    assert code == 0, err
    assert shard(monkeypatch, capsys, str(src), str(clean), "--tp", "2", "--expert-dtype", "fp8")[0] == 0
    for p in clean.glob("model*"):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


def test_dry_run_refuses_what_the_run_refuses(src, tmp_path, monkeypatch, capsys):
    code, _, err = shard(monkeypatch, capsys, str(src), str(tmp_path / "x"), "--tp", "2", "--ranks", "7", "--dry-run")
    assert code == 2 and "--ranks [7]: out of range" in err, err
    out = tmp_path / "o"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2")[0] == 0
    args = (str(src), str(out), "--tp", "2", "--expert-dtype", "fp8", "--resume")
    code, _, err = shard(monkeypatch, capsys, *args, "--dry-run")
    assert code == 2 and "finished by a run with other options" in err, err
    code, _, err = shard(monkeypatch, capsys, *args)  # the real run refuses the same
    assert code == 2 and "finished by a run with other options" in err, err
    args = (str(src), str(tmp_path / "y"), "--tp", "4", "--ranks", "1,3", "--dry-run", "--json")
    code, doc, err = shard(monkeypatch, capsys, *args)
    assert code == 0, err
    summary = json.loads(doc)
    assert [r["rank"] for r in summary["files"]] == [1, 3]
    assert summary["total_bytes"] == sum(r["bytes"] for r in summary["files"])  # it was all four ranks'


@pytest.mark.parametrize("record", [b"[]", b'{"size": "12"}', b"\xff\xfe not utf-8"])
def test_a_damaged_done_record_means_the_file_is_written_again(src, tmp_path, monkeypatch, capsys, record):
    out = tmp_path / "o"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2")[0] == 0
    want = (out / "model0-mp2.safetensors").read_bytes()
    (out / DONE_DIR / "model0-mp2.safetensors.done.json").write_bytes(record)
    code, doc, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--resume", "--json")
    assert code == 0, err
    summary = json.loads(doc)
    assert summary["written"] == ["model0-mp2.safetensors"] and summary["skipped"] == ["model1-mp2.safetensors"]
    assert (out / "model0-mp2.safetensors").read_bytes() == want


def test_the_workers_reported_are_the_processes_used(src, tmp_path, monkeypatch, capsys):
    code, doc, _ = shard(monkeypatch, capsys, str(src), str(tmp_path / "a"), "--tp", "2", "--workers", "100", "--json")
    assert code == 0 and json.loads(doc)["workers"] == 2
    args = (str(src), str(tmp_path / "b"), "--tp", "2", "--ranks", "0", "--workers", "4", "--json")
    code, doc, _ = shard(monkeypatch, capsys, *args)
    assert code == 0 and json.loads(doc)["workers"] == 1
    code, doc, _ = shard(monkeypatch, capsys, str(src), str(tmp_path / "a"), "--tp", "2", "--resume", "--json")
    assert code == 0 and json.loads(doc)["workers"] == 0 and json.loads(doc)["written"] == []


def test_check_of_an_unfinished_folder_says_how_to_finish_it(src, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--ranks", "0")[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "check", str(out))
    assert code == 2 and "manifest.json: not found" in err and "fragments of shares" in err, err
    (out / "model1-mp2.safetensors.partial").write_bytes(b"x")
    code, _, err = run_cli(monkeypatch, capsys, "check", str(out))
    assert code == 2 and "an unfinished conversion (1 .partial file:" in err and "--resume" in err, err
    # every file done but the manifest (the run stopped before its last step): said "not every file is done"
    out = tmp_path / "whole"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2")[0] == 0
    (out / "manifest.json").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "check", str(out))
    assert code == 2 and "an unfinished conversion (manifest.json is the last file a run writes)" in err, err
    # `manifest` of a file: "no such folder"
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(out / "config.json"))
    assert code == 2 and f"{out / 'config.json'}: not a folder" in err, err


def test_demo_overwrite_replaces_only_a_folder_a_demo_wrote(tmp_path, monkeypatch, capsys):
    proj = tmp_path / "proj"
    (proj / "src" / "mypkg").mkdir(parents=True)
    (proj / "src" / "mypkg" / "code.py").write_text("print(1)\n")
    before = tree(proj)
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(proj), "--tp", "2")
    # it said "not empty; pass --overwrite", which then refused the folder (an audit): the refusal --overwrite
    # gives is given without it too
    assert code == 2 and "not a folder an earlier demo wrote" in err and "pass --overwrite" not in err, err
    code, doc, err = run_cli(monkeypatch, capsys, "demo", str(proj), "--tp", "2", "--overwrite", "--json")
    assert code == 2 and "not a folder an earlier demo wrote" in err, err
    assert json.loads(doc)["exit_code"] == 2
    assert tree(proj) == before


def test_demo_overwrite_keeps_a_users_folder_beside_its_output(tmp_path, monkeypatch, capsys):
    """Every DIR/mp<digits> folder was removed, whatever wrote it (an audit: a user's mp3/ beside a tp-2 demo's
    mp2/); now only the conversions the demo wrote (shard's records in them)."""
    demo = tmp_path / "demo"
    assert run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--threads", "1")[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--threads", "1")
    assert code == 2 and "an earlier demo's output); pass --overwrite" in err, err  # as it advises, below
    (demo / "mp3").mkdir()
    (demo / "mp3" / "x").write_text("mine\n")
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "4", "--threads", "1", "--overwrite")
    assert code == 0, err
    assert (demo / "mp3" / "x").read_text() == "mine\n" and not (demo / "mp2").exists() and (demo / "mp4").is_dir()


def test_demo_overwrite_removes_only_what_the_demo_wrote(tmp_path, monkeypatch, capsys):
    """`demo DIR --tp 2`, then the user's own `shard DIR/src DIR/mp4 --tp 4` and notes in src/ and mp2/:
    `demo DIR --tp 2 --overwrite` removed mp4/ (shard's records in it) and both notes, exit 0 (an audit). The
    demo's mark lists the conversions it wrote; a user's file among what it would replace is refused first,
    nothing removed; without them the demo runs again and the user's conversion stays."""
    demo = tmp_path / "demo"
    assert run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--threads", "1")[0] == 0
    assert shard(monkeypatch, capsys, str(demo / "src"), str(demo / "mp4"), "--tp", "4")[0] == 0
    for notes in (demo / "src" / "NOTES.txt", demo / "mp2" / "NOTES.txt"):
        notes.write_text("mine\n")
        before = tree(demo)
        code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--threads", "1", "--overwrite")
        assert code == 2 and "NOTES.txt" in err and "does not write" in err, err
        assert tree(demo) == before
        notes.unlink()
    mine = tree(demo / "mp4")
    before = tree(demo)  # a demo at the tp of the user's conversion: refused before anything is removed (it
    # removed mp2/ and the reference, then failed at its shard step, its mark naming mp4/ for the next one)
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "4", "--threads", "1", "--overwrite")
    assert code == 2 and "mp4: not a conversion an earlier demo wrote" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "4", "--threads", "1")
    assert code == 2 and "mp4: not a conversion an earlier demo wrote" in err and "pass --overwrite" not in err, err
    assert tree(demo) == before
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--threads", "1", "--overwrite")
    assert code == 0, err
    assert tree(demo / "mp4") == mine
    theirs = tmp_path / "theirs"  # a src/ that links to a checkpoint of the user's: written through (an audit)
    shutil.move(demo / "src", theirs)
    (demo / "src").symlink_to(theirs)
    before = tree(theirs)
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--threads", "1", "--overwrite")
    assert code == 2 and "src: a link" in err, err
    assert tree(theirs) == before


def test_demo_overwrite_leaves_no_reference_of_the_earlier_demo(tmp_path, monkeypatch, capsys):
    """--overwrite removes the earlier demo's conversions and its reference before the new one is made: a run
    stopped after that (here its make-tiny step fails) leaves no reference of another checkpoint beside what
    it wrote, for a later `verify DIR/mp2 --reference-logits DIR/ref-tp1.safetensors` to compare against."""
    from dsv41_convert.app.demo import MARK, REFERENCE
    from dsv41_convert.errors import OutputError

    demo = tmp_path / "demo"
    (demo / "mp2").mkdir(parents=True)
    (demo / "mp2" / "model0-mp2.safetensors").write_bytes(b"earlier")
    (demo / REFERENCE).write_bytes(b"earlier reference")
    (demo / MARK).write_text(json.dumps({"wrote": ["mp2"]}) + "\n")
    (demo / "mp3").mkdir()  # a user's, beside it
    (demo / "mp3" / "x").write_text("mine\n")

    def stopped(*args, **kw):
        raise OutputError("stopped here")

    monkeypatch.setattr("dsv41_convert.synth.write.write_checkpoint", stopped)
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--overwrite")
    assert code == 2 and "stopped here" in err, err
    assert not (demo / REFERENCE).exists() and not (demo / "mp2").exists()
    assert (demo / "mp3" / "x").read_text() == "mine\n"


def test_demo_overwrite_with_a_folder_at_the_references_name_removes_nothing(tmp_path, monkeypatch, capsys):
    """A folder of the user's at DIR/ref-tp1.safetensors (the name the demo writes its reference to): `demo DIR
    --overwrite` removed the earlier demo's mp2/, then failed on that folder (`Is a directory`, exit 2): half of
    the clearing done, against "nothing is removed where something is refused". Now refused first, naming it."""
    from dsv41_convert.app.demo import MARK, REFERENCE

    demo = tmp_path / "demo"
    (demo / "mp2").mkdir(parents=True)
    (demo / "mp2" / "model0-mp2.safetensors").write_bytes(b"earlier")
    (demo / MARK).write_text(json.dumps({"wrote": ["mp2"]}) + "\n")
    (demo / REFERENCE).mkdir()
    (demo / REFERENCE / "mine.txt").write_text("mine\n")
    before = tree(demo)
    code, doc, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--overwrite", "--json")
    assert code == 2 and json.loads(doc)["exit_code"] == 2, err
    assert f"{demo / REFERENCE}:" in err, err
    assert tree(demo) == before


@pytest.mark.parametrize("kind", ["link", "file"])
def test_demo_overwrite_with_its_conversion_a_link_or_a_file_removes_nothing(kind, tmp_path, monkeypatch, capsys):
    """The conversion the mark lists, at this run's mp<tp>, replaced by a link (to a folder of the user's) or a
    file: `demo DIR --tp 2 --overwrite` removed the earlier reference and wrote DIR/src, then failed in its
    shard step (`not empty`, or not a folder): half of the clearing done, against "refuses before removing
    anything". Now refused first, naming it."""
    from dsv41_convert.app.demo import MARK, REFERENCE

    demo, theirs = tmp_path / "demo", tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model0-mp2.safetensors").write_bytes(b"mine")
    demo.mkdir()
    if kind == "link":
        (demo / "mp2").symlink_to(theirs)
    else:
        (demo / "mp2").write_bytes(b"mine")
    (demo / REFERENCE).write_bytes(b"earlier reference")
    (demo / MARK).write_text(json.dumps({"wrote": ["mp2"]}) + "\n")
    before, before_theirs = tree(demo), tree(theirs)
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(demo), "--tp", "2", "--threads", "1", "--overwrite")
    assert code == 2 and f"{demo / 'mp2'}:" in err, err
    assert tree(demo) == before and tree(theirs) == before_theirs and not (demo / "src").exists()


def test_resume_refuses_a_source_changed_since_the_run_began(src, tmp_path, monkeypatch, capsys):
    """A shard fetched again (or edited) in place, then --resume: the finished rank files were skipped,
    holding the old bytes, and `check` passed them."""
    source, out = tmp_path / "src", tmp_path / "o"
    shutil.copytree(src, source)
    assert shard(monkeypatch, capsys, str(source), str(out), "--tp", "2")[0] == 0
    code, doc, _ = shard(monkeypatch, capsys, str(source), str(out), "--tp", "2", "--resume", "--json")
    assert code == 0 and json.loads(doc)["written"] == []  # unchanged source: nothing to do
    victim = sorted(source.glob("model-*.safetensors"))[2]
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size - 4)
        f.write(b"\x11\x22\x33\x44")
    for extra in ([], ["--dry-run"]):
        code, _, err = shard(monkeypatch, capsys, str(source), str(out), "--tp", "2", "--resume", *extra)
        assert code == 2 and f"{victim.name} changed" in err and "--overwrite" in err, err
    assert shard(monkeypatch, capsys, str(source), str(out), "--tp", "2", "--overwrite")[0] == 0
    code, doc, err = shard(monkeypatch, capsys, str(source), str(out), "--tp", "2", "--resume", "--json")
    assert code == 0 and json.loads(doc)["written"] == [], err
    # another machine's record (a gathered folder) says nothing about this machine's copy
    for rec in (out / DONE_DIR).glob("source-*.json"):
        rec.rename(rec.with_name("source-elsewhere.json"))
    victim.touch()
    assert shard(monkeypatch, capsys, str(source), str(out), "--tp", "2", "--resume")[0] == 0


@pytest.mark.parametrize("command", ["export", "shard"])
def test_overwrite_never_replaces_files_with_our_names_that_no_run_of_ours_wrote(
    src, tmp_path, monkeypatch, capsys, command
):
    """`export SRC THEIRS --format bf16 --overwrite` into a downloaded checkpoint whose shard names are the
    ones export writes (an audit): every shard, the config and the index were replaced without a word. The
    same for rank files another tool wrote under our names (upstream convert.py's)."""
    out = tmp_path / "theirs"
    if command == "export":
        shutil.copytree(src, out)
        args = ("export", str(src), str(out), "--format", "bf16", "--overwrite")
    else:
        out.mkdir()
        (out / "model0-mp2.safetensors").write_bytes(b"upstream's rank file")
        args = ("shard", str(src), str(out), "--tp", "2", "--overwrite")
    before = tree(out)
    plain = [a for a in args if a != "--overwrite"]  # an audit: it said "pass --resume ... or --overwrite"
    resume = [*plain, "--resume"]  # an audit: --resume replaced them all
    for command_line in ([*args], [*args, "--dry-run"], resume, [*resume, "--dry-run"], plain, [*plain, "--dry-run"]):
        code, _, err = run_cli(monkeypatch, capsys, *command_line)
        assert code == 2 and "which no dsv41-convert run wrote there" in err and "not replaced" in err, err
        assert tree(out) == before


@pytest.mark.parametrize("command", ["export", "shard"])
@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "tokenizer.json", "manifest.json"])
def test_overwrite_never_replaces_side_files_no_run_of_ours_wrote(src, tmp_path, monkeypatch, capsys, command, name):
    """A folder of someone else's config, index or tokenizer (an audit): --overwrite replaced them without a
    word, while a stranger's shard beside them was refused. Without a flag the refusal names them too (it said
    "not empty; pass --resume ... or --overwrite", which both refuse them)."""
    out = tmp_path / "theirs"
    out.mkdir()
    (out / name).write_text('{"mine": 1}')
    args = (
        ("export", str(src), str(out), "--format", "fp8-fp4") if command == "export" else ("shard", str(src), str(out))
    )
    for extra in (["--overwrite"], ["--overwrite", "--dry-run"], ["--resume"], ["--resume", "--dry-run"], [],
                  ["--dry-run"]):  # fmt: skip
        code, _, err = run_cli(monkeypatch, capsys, *args, *extra)
        assert code == 2 and f"holds {name}, which no dsv41-convert run wrote there" in err, err
    if command == "shard":  # the library's run says so too, under its lock (the CLI asks before, check_out)
        from dsv41_convert.convert.plan import build_plan
        from dsv41_convert.errors import OutputError

        with pytest.raises(OutputError, match=f"holds {name}, which no dsv41-convert run wrote there"):
            execute_mod.execute(build_plan(src, 1, "fp4"), out)
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).read_text() == '{"mine": 1}'


def test_export_of_a_source_without_tokenizer_warns(src, tmp_path, monkeypatch, capsys):
    """As shard does: the export is complete without it, but verify and inference are not (Engram)."""
    source = tmp_path / "src"
    shutil.copytree(src, source)
    (source / "tokenizer.json").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "export", str(source), str(tmp_path / "o"), "--format", "fp8-fp4")
    assert code == 0 and "warning:" in err and "no tokenizer.json" in err, err


def test_a_finished_export_resumed_leaves_no_manifest_without_its_config(src, tmp_path, monkeypatch, capsys):
    """`export --resume` of a finished folder writes no shard, but removes config.json and the index until its
    end: killed in between (here: the step that writes them fails), it left a manifest.json listing files
    that were gone, and `check` failed on them (an audit). Now the manifest goes first, as for any change."""
    from dsv41_convert.convert import export as export_mod

    out = tmp_path / "out"
    assert run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "fp8")[0] == 0

    def killed(ep, out):
        raise OSError(5, "killed here")

    monkeypatch.setattr(export_mod, "_after", killed)
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "fp8", "--resume")
    assert code == 2 and "killed here" in err, err
    assert not (out / "config.json").exists() and not (out / "manifest.json").exists()
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] != 0  # unfinished, and says so
    monkeypatch.undo()
    assert run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "fp8", "--resume")[0] == 0
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


@pytest.mark.parametrize("command", ["export", "shard"])
def test_an_earlier_runs_tokenizer_is_set_aside_when_the_new_source_has_none(src, tmp_path, monkeypatch, capsys,
                                                                             command):  # fmt: skip
    """`--overwrite` with a source without tokenizer files into a folder an earlier run wrote them to: they
    stayed, unlisted by the manifest and passed by `check`, beside the warning that OUT would have none
    (an audit). Now they are moved to .dsv41-convert/set-aside/ (a hand-placed one is not lost), saying so."""
    out = tmp_path / "out"
    fmt = ("--format", "fp8") if command == "export" else ("--tp", "2")
    assert run_cli(monkeypatch, capsys, command, str(src), str(out), *fmt)[0] == 0
    before = {name: (out / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    for name in before:
        (bare / name).unlink()
    code, _, err = run_cli(monkeypatch, capsys, command, str(bare), str(out), *fmt, "--overwrite")
    assert code == 0, err
    aside = out / ".dsv41-convert" / "set-aside"
    for name, data in before.items():
        assert not (out / name).exists() and (aside / name).read_bytes() == data
        assert f"moved {aside / name} there from OUT" in err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


def test_export_names_the_source_files_it_does_not_carry(src, tmp_path, monkeypatch, capsys):
    """generation_config.json and a chat template beside the weights (a fine-tuned checkpoint): export
    dropped them without a word (an audit); it writes only weights, config, index and tokenizer files."""
    source = tmp_path / "src"
    shutil.copytree(src, source)
    code, out, err = run_cli(monkeypatch, capsys, "export", str(source), str(tmp_path / "a"), "--format", "fp8")
    assert code == 0 and "not carried" not in err
    (source / "generation_config.json").write_text('{"temperature": 0.6}')
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "encoding").mkdir()  # the published repository's chat encoding (no chat_template in its tokenizer)
    (source / "encoding" / "encoding.py").write_text("")
    (source / ".cache").mkdir()
    code, out, err = run_cli(monkeypatch, capsys, "export", str(source), str(tmp_path / "b"), "--format", "fp8",
                             "--json")  # fmt: skip
    named = "chat_template.jinja, encoding/, generation_config.json"
    assert code == 0 and f"{source}: not carried into {tmp_path / 'b'}: {named}" in " ".join(err.split()), err
    assert json.loads(out)["not_carried"] == ["chat_template.jinja", "encoding/", "generation_config.json"]
    # the dry run said nothing of them (it warns of a missing tokenizer.json, as the run does)
    code, out, err = run_cli(monkeypatch, capsys, "export", str(source), str(tmp_path / "d"), "--format", "fp8",
                             "--dry-run")  # fmt: skip
    assert code == 0 and f"{source}: not carried into {tmp_path / 'd'}: {named}" in " ".join(err.split()), err
    assert not (tmp_path / "d").exists()
    # an earlier export as SRC: its manifest.json is a record of its own files, not one to carry (copied
    # into OUT as the warning said, it made `check OUT` fail)
    code, out, err = run_cli(monkeypatch, capsys, "export", str(tmp_path / "b"), str(tmp_path / "c"), "--format",
                             "bf16", "--json")  # fmt: skip
    assert code == 0 and (tmp_path / "b" / "manifest.json").is_file(), err
    assert json.loads(out)["not_carried"] == [] and "not carried" not in err
    # copied into OUT as advised, a --resume names only what OUT still lacks (it named them all again)
    shutil.copy(source / "generation_config.json", tmp_path / "a")
    shutil.copytree(source / "encoding", tmp_path / "a" / "encoding")
    code, out, err = run_cli(monkeypatch, capsys, "export", str(source), str(tmp_path / "a"), "--format", "fp8",
                             "--resume", "--json")  # fmt: skip
    assert code == 0 and f"not carried into {tmp_path / 'a'}: chat_template.jinja (" in " ".join(err.split()), err
    assert json.loads(out)["not_carried"] == ["chat_template.jinja"]


def test_a_folder_copied_without_its_records_is_still_ours_by_its_manifest(src, tmp_path, monkeypatch, capsys):
    """A finished tp-2 folder copied to another machine with its visible files only (no .dsv41-convert/):
    its manifest.json, in our format, says a run of ours wrote it, so `shard --resume` goes on there rather
    than calling its files a stranger's (a manifest in another format still does: the tests above)."""
    out = tmp_path / "out"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2")[0] == 0
    shutil.rmtree(out / ".dsv41-convert")
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--resume")
    assert code == 0 and "no dsv41-convert run wrote there" not in err, err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


@pytest.mark.parametrize("command", [["export", "--format", "fp8-fp4"], ["shard", "--tp", "2"]])
def test_a_source_whose_shards_link_into_out_is_refused_and_kept(src, tmp_path, monkeypatch, capsys, command):
    """SRC's shards are symbolic links to an export's shards in OUT (a folder of links, to save the copy):
    `export SRC OUT --overwrite` wrote new shards over them and `shard` removed them as another conversion's,
    exit 0, the source gone. Hard links keep their bytes (a new file is renamed over OUT's name): allowed."""
    out, linked = tmp_path / "out", tmp_path / "linked"
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "bf16")
    assert code == 0, err
    linked.mkdir()
    for path in out.iterdir():
        if path.is_file():
            (linked / path.name).symlink_to(path) if path.suffix == ".safetensors" else shutil.copy(path, linked)
    before = tree(out)
    code, _, err = run_cli(monkeypatch, capsys, command[0], str(linked), str(out), *command[1:], "--overwrite")
    assert code == 2 and f"{linked}/model-0" in err and "(a link), which this run would write or remove" in err, err
    assert tree(out) == before
    hard = tmp_path / "hard"
    hard.mkdir()
    for path in linked.iterdir():
        (hard / path.name).hardlink_to(path.resolve())
    code, _, err = run_cli(monkeypatch, capsys, command[0], str(hard), str(out), *command[1:], "--overwrite")
    assert code == 0, err
    assert tree(hard) == {name: data for name, data in before.items() if "/" not in name and name in tree(hard)}


def test_a_failed_overwrite_leaves_no_rank_file_of_the_replaced_run(tmp_path, monkeypatch, capsys):
    """shard OUT from source A, then `--overwrite` from source B that fails on a NaN in rank 1's expert: the
    folder held B's rank 0 beside A's rank 1, a whole tp-2 set of two models that upstream's generate.py
    (which reads no manifest) loads as one (an audit). The replaced files now go first; --resume of B then
    finishes B's set."""
    import torch
    from tiny_ckpt import source_tensors, tiny_config, write_ckpt

    a = make_tiny(tmp_path / "a", vision=False, seed=1)
    cfg = tiny_config(vision=False)
    tensors = source_tensors(cfg, 0)
    tensors["layers.2.ffn.experts.6.w1.scale"].view(torch.uint8)[0, 0] = 0xFF  # rank 1's at tp 2 (8 experts)
    b = write_ckpt(tmp_path / "b", tensors, cfg)
    out = tmp_path / "out"
    assert shard(monkeypatch, capsys, str(a), str(out), "--tp", "2", "--workers", "1")[0] == 0
    old = {p.name: p.read_bytes() for p in out.glob("model*-mp2.safetensors")}
    code, _, err = shard(monkeypatch, capsys, str(b), str(out), "--tp", "2", "--overwrite", "--workers", "1")
    assert code == 2 and "layers.2.ffn.experts.6.w1.scale: found nan" in err, err
    left = {p.name: p.read_bytes() for p in out.glob("model*-mp2.safetensors")}
    assert "model1-mp2.safetensors" not in left  # the failed rank: neither A's nor a partial under its name
    assert all(left[n] != old[n] for n in left), sorted(left)
    assert not (out / "manifest.json").exists()


def test_resume_from_another_folder_of_the_same_layout_is_refused(tmp_path, monkeypatch, capsys):
    """OUT converted from A, then `--resume` from B, another checkpoint of the same layout (a second fine-tune):
    exit 0, "skipped 2", A's rank files under a manifest that names B, and `check` passed (an audit). The
    shards' stamps now tell the folders apart; a copy of A that keeps its files' times (cp -a) still resumes."""
    a = make_tiny(tmp_path / "a", vision=False, seed=1)
    b = make_tiny(tmp_path / "b", vision=False, seed=2)
    out = tmp_path / "out"
    assert shard(monkeypatch, capsys, str(a), str(out), "--tp", "2")[0] == 0
    before = tree(out)
    for extra in ([], ["--dry-run"]):
        code, _, err = shard(monkeypatch, capsys, str(b), str(out), "--tp", "2", "--resume", *extra)
        assert code == 2 and f"a run here began from {a.resolve()}" in err and "differ from its files" in err, err
    assert tree(out) == before
    # two shares of one OUT from the two folders: rank 1 from B beside rank 0 from A
    mixed = tmp_path / "mixed"
    assert shard(monkeypatch, capsys, str(a), str(mixed), "--tp", "2", "--ranks", "0")[0] == 0
    code, _, err = shard(monkeypatch, capsys, str(b), str(mixed), "--tp", "2", "--ranks", "1")
    assert code == 2 and "model0-mp2.safetensors may hold the old bytes" in err, err
    assert not (mixed / "model1-mp2.safetensors").exists()
    moved = tmp_path / "a-copy"
    subprocess.run(["cp", "-a", str(a), str(moved)], check=True)
    code, doc, err = shard(monkeypatch, capsys, str(moved), str(out), "--tp", "2", "--resume", "--json")
    assert code == 0 and json.loads(doc)["written"] == [], err


@pytest.mark.parametrize("command", ["shard", "export"])
def test_dry_run_refuses_a_read_only_out_as_the_run_does(src, tmp_path, monkeypatch, capsys, command):
    """`--dry-run` into a read-only file system said 0 where the run fails on its lock file (an audit)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("mounts need privileges here")
    try:
        args = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
        for extra in (["--dry-run"], []):
            code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(ro / "out"), *args, *extra)
            assert code == 2 and str(ro) in err, (extra, err)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_dry_run_refuses_an_out_it_may_not_write(src, tmp_path, monkeypatch, capsys):
    """The same refusal without mount privileges (CI): the nearest existing folder of OUT is not writable."""
    real = execute_mod.os.access
    parent = tmp_path / "locked"
    parent.mkdir()
    monkeypatch.setattr(execute_mod.os, "access", lambda p, mode: False if p == parent else real(p, mode))
    code, _, err = shard(monkeypatch, capsys, str(src), str(parent / "new" / "out"), "--tp", "2", "--dry-run")
    assert code == 2 and f"cannot write into {parent}" in err, err
    assert not (parent / "new").exists()


@pytest.mark.parametrize("command", ["shard", "export"])
def test_dry_run_refuses_an_out_without_room_as_the_run_does(src, tmp_path, monkeypatch, capsys, command):
    """`--dry-run` said 0 into a disk without room for the files, where the run then refused before its first
    byte (`N bytes to write but only M bytes free`, exit 2): the dry run checked OUT's permissions, not its
    free space (found on a 4 MiB tmpfs: the tiny checkpoint's 15 MB at tp 2)."""
    args = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
    out = tmp_path / "new" / "out"
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 1000)
    for extra in (["--dry-run"], []):
        code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(out), *args, *extra)
        assert code == 2 and "bytes to write but only 1,000 bytes free" in err, (extra, err)
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 1 << 40)  # room: the dry run still says 0
    code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(tmp_path / "roomy"), *args, "--dry-run")
    assert code == 0 and not (tmp_path / "roomy").exists(), err


@pytest.mark.parametrize("device", ["gpu", "cuda"])
@pytest.mark.parametrize("command", ["shard", "export"])
def test_dry_run_refuses_a_device_as_the_run_does(src, tmp_path, monkeypatch, capsys, command, device):
    """`--device gpu --dry-run` (and `--device cuda` where torch sees no card) said 0 and printed the plan, where
    the run refuses the value (exit 2, README: `error: --device 'gpu': expected cpu or cuda`)."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the run takes --device cuda")
    args = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
    said = "--device 'gpu': expected cpu or cuda" if device == "gpu" else "--device cuda: torch sees no CUDA device"
    for extra in (["--dry-run"], []):
        out = tmp_path / f"out{len(extra)}"
        code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(out), *args, "--device", device, *extra)
        assert code == 2 and said in err, (extra, err)
        assert not out.exists()


_REFUSED = {
    "gpu": (["--device", "gpu"], "--device 'gpu': expected cpu or cuda"),
    "cuda": (["--device", "cuda"], "--device cuda: torch sees no CUDA device here"),
    "resume-overwrite": (["--resume", "--overwrite"], "--resume and --overwrite: pick one"),
    "ranks": (["--ranks", "5"], "--ranks [5]: out of range for --tp 2"),
}


@pytest.mark.parametrize(
    ("command", "refused"),
    [("shard", name) for name in _REFUSED] + [("export", name) for name in _REFUSED if name != "ranks"],
)
def test_a_refused_option_is_said_before_any_progress(src, tmp_path, monkeypatch, capsys, command, refused):
    """`shard --device gpu` printed the progress display's title (`shard SRC -> OUT (tp 2)`) and an empty bar
    before `error: --device 'gpu': expected cpu or cuda`, as if the run had started; so did every refusal of an
    option (execute's check_options). The refusal is now the first thing said."""
    import torch

    if refused == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the run takes --device cuda")
    options, said = _REFUSED[refused]
    args = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
    out = tmp_path / "out"
    code, stdout, err = run_cli(monkeypatch, capsys, command, str(src), str(out), *args, *options)
    assert code == 2 and err.startswith(f"error: {said}") and stdout == "", err
    assert not out.exists()


def _out_not_empty(src: Path, out: Path, command: str, run) -> tuple[list[str], str]:
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    return [], f"{out}: not empty (notes.txt)"


def _out_of_a_stranger(src: Path, out: Path, command: str, run) -> tuple[list[str], str]:
    out.mkdir()
    (out / "config.json").write_text("{}")  # a file at our name that no run of ours wrote
    return ["--resume"], f"{out}: holds config.json, which no dsv41-convert run wrote there"


def _out_of_another_conversion(src: Path, out: Path, command: str, run) -> tuple[list[str], str]:
    other = ["shard", "--tp", "4"] if command == "export" else ["export", "--format", "bf16"]
    assert run(other[0], str(src), str(out), *other[1:])[0] == 0
    return ["--resume"], f"{out}: holds files of another conversion"


_OUT_REFUSED = {"not-empty": _out_not_empty, "stranger": _out_of_a_stranger, "other": _out_of_another_conversion}


@pytest.mark.parametrize("refused", [*_OUT_REFUSED, "held"])
@pytest.mark.parametrize("command", ["shard", "export"])
def test_a_refused_out_is_said_before_any_progress(src, tmp_path, monkeypatch, capsys, command, refused):
    """`shard SRC OUT` into a non-empty OUT printed the progress display's title (`shard SRC -> OUT (tp 2)`) and
    an empty line before `error: OUT: not empty (...)`, as if the run had started; so did OUT held by another
    run, OUT holding files no run of ours wrote, or another conversion's (--resume). What OUT refuses as it is
    found is now the first thing said, and OUT is left as it was."""
    from dsv41_convert.store.lock import hold

    args = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
    out = (tmp_path / "out").resolve()
    if refused == "held":
        out.mkdir()
        options, said, held = [], f"{out}: in use by pid {os.getpid()}", hold(out)
    else:
        run = functools.partial(run_cli, monkeypatch, capsys)
        (options, said), held = _OUT_REFUSED[refused](src, out, command, run), contextlib.nullcontext()
    before = tree(out)
    with held:
        code, stdout, err = run_cli(monkeypatch, capsys, command, str(src), str(out), *args, *options)
    assert code == 2 and err.startswith(f"error: {said}") and stdout == "", err
    assert tree(out) == before


@pytest.mark.parametrize(
    ("first", "again"),
    [(["shard", "--tp", "2"], ["shard", "--tp", "4"]), (["export", "--format", "fp8"], ["export", "--format", "bf16"])],
    ids=["shard", "export"],
)
def test_dry_run_of_an_overwrite_credits_only_the_files_it_removes(src, tmp_path, monkeypatch, capsys, first, again):
    """`--overwrite --dry-run` counted every file OUT held as room the run frees, a user's file beside the
    conversion too (found: a 10 MB notes file on a 30 MB tmpfs), and said 0 where the run, which removes only
    the replaced conversion, then refused ("N bytes to write but only M bytes free", exit 2). Here a disk whose
    free space is what OUT's files leave of it, a 1 GiB (sparse) file of the user's among them, and room for
    half the new files once the old are gone: the run refuses, and the dry run must say so first."""
    out, ref = tmp_path / "out", tmp_path / "ref"
    assert run_cli(monkeypatch, capsys, first[0], str(src), str(out), *first[1:])[0] == 0
    assert run_cli(monkeypatch, capsys, again[0], str(src), str(ref), *again[1:])[0] == 0
    new = sum(p.stat().st_size for p in ref.glob("*.safetensors"))  # what the overwrite writes, measured
    notes = out / "notes.bin"
    notes.touch()
    os.truncate(notes, 1 << 30)
    capacity = (1 << 30) + new // 2

    def disk_free(path) -> int:  # the disk holds OUT's files alone
        return max(0, capacity - sum(p.stat().st_size for p in out.rglob("*") if p.is_file()))

    monkeypatch.setattr(execute_mod, "disk_free", disk_free)
    said = []
    for extra in (["--dry-run"], []):
        code, _, err = run_cli(monkeypatch, capsys, again[0], str(src), str(out), *again[1:], "--overwrite", *extra)
        assert code == 2 and "bytes to write but only" in err, (extra, err)
        said.append(err.split(" bytes to write")[0].rsplit(" ", 1)[-1])
    assert said[0] == said[1]  # the bytes the run writes, not those less the removed files' (the dry run said so)
    assert notes.stat().st_size == 1 << 30  # the user's file stays


@pytest.mark.parametrize(
    ("first", "again", "removal"),
    [
        (["shard", "--tp", "2"], ["shard", "--tp", "2", "--expert-dtype", "fp8"], "_remove_replaced"),
        (["shard", "--tp", "2"], ["shard", "--tp", "4"], "_no_other_conversion"),
        (["export", "--format", "fp8"], ["export", "--format", "bf16"], "_remove_replaced"),
    ],
    ids=["same-files", "another-tp", "export"],
)
def test_an_overwrite_stopped_in_its_removals_leaves_no_record_of_gone_files(
    src, tmp_path, monkeypatch, capsys, first, again, removal
):
    """--overwrite removed the replaced run's files before its manifest.json (and an export's index and
    config.json): SIGKILL in between left a manifest listing files already gone as the finished conversion
    (an audit: 4 kills in 80, at 0.34-0.44 s). The records go first now; --resume then finishes."""
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, first[0], str(src), str(out), *first[1:])
    assert code == 0 and (out / "manifest.json").is_file(), err
    real_unlink = Path.unlink

    def killed_after_the_first(path, *args, **kwargs):  # the run dies right after one of the old files goes
        real_unlink(path, *args, **kwargs)
        if path.name.endswith(".safetensors") and path.parent == out:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Path, "unlink", killed_after_the_first)
        code, _, err = run_cli(monkeypatch, capsys, again[0], str(src), str(out), *again[1:], "--overwrite")
    assert code == 130, err
    listing = {p.name for p in out.iterdir()}
    assert not {"manifest.json", "model.safetensors.index.json"} & listing, listing
    assert again[0] != "export" or "config.json" not in listing
    # the same files: --resume continues; another conversion's files still there: --overwrite again
    finish = "--overwrite" if removal == "_no_other_conversion" else "--resume"
    code, _, err = run_cli(monkeypatch, capsys, again[0], str(src), str(out), *again[1:], finish)
    assert code == 0, err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


def _link(at: Path, to: Path, kind: str) -> None:
    """A symbolic link at `at` to `to`, or a hard link (`to` under a second name)."""
    if kind == "symbolic":
        at.symlink_to(to)
    else:
        os.link(to, at)


def test_a_lock_file_with_another_name_is_replaced_unless_a_process_holds_it(src, tmp_path, monkeypatch, capsys):
    """A killed run's lock file copied with `cp -al` (a snapshot of OUT) made every later run refuse (an audit):
    a lock file of two names that no process holds is removed (its other name's bytes kept) and a new one
    made; one a process holds is refused, not written."""
    import fcntl

    out = tmp_path / "out"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2")[0] == 0
    snapshot = tmp_path / "snapshot.lock"
    snapshot.write_bytes(b"pid 1 exclusive\n")
    os.link(snapshot, out / ".dsv41-convert.lock")
    with open(snapshot, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # a run holds it now
        code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--overwrite")
        assert code == 2 and "has another name (a hard link), not a lock file of ours; remove it" in err, err
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--overwrite")
    assert code == 0, err
    assert snapshot.read_bytes() == b"pid 1 exclusive\n" and snapshot.stat().st_nlink == 1


@pytest.mark.parametrize("how", ["--resume", "--overwrite"])
@pytest.mark.parametrize("target", ["a source shard", "another file"])
@pytest.mark.parametrize("kind", ["symbolic", "hard"])
def test_a_link_at_a_partial_files_name_is_not_written_through(src, tmp_path, monkeypatch, capsys, how, target, kind):
    """A link planted at OUT/model0-mp2.safetensors.partial: the writer opened it and wrote through it, into a
    source shard (the run then blamed the source: "unexpected end of file") or into any file the link named
    (exit 0, the rank file left a link to it), an audit; a hard link the same (a later audit: the partial is
    truncated or appended to in place). The link is removed, its target kept."""
    clean = tmp_path / "clean"
    assert shard(monkeypatch, capsys, str(src), str(clean), "--tp", "2")[0] == 0
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    victim = sorted(src.glob("*.safetensors"))[2] if target == "a source shard" else tmp_path / "precious.txt"
    if target == "another file":
        victim.write_text("mine\n")
    before = victim.read_bytes()
    (out / "model0-mp2.safetensors").unlink()
    _link(out / "model0-mp2.safetensors.partial", victim, kind)
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", how)
    assert code == 0, err
    assert victim.read_bytes() == before
    final = out / "model0-mp2.safetensors"
    assert not final.is_symlink() and final.read_bytes() == (clean / final.name).read_bytes()
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


def test_a_share_overwritten_with_other_options_is_refused(src, tmp_path, monkeypatch, capsys):
    """`shard --ranks 1 --expert-dtype fp8 --overwrite` into a whole tp-4 conversion (fp4 experts) replaced
    rank 1 alone: OUT held ranks 0, 2, 3 with fp4 experts and rank 1 with fp8, a whole-looking set of two
    conversions that a loader reading no manifest takes (an audit). Refused; with the same options allowed."""
    out = tmp_path / "out"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "4")[0] == 0
    before = tree(out)
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "4", "--ranks", "1", "--expert-dtype",
                         "fp8", "--overwrite")  # fmt: skip
    assert code == 2 and "holds a share of another plan" in err and "convert every rank again" in err, err
    assert tree(out) == before
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "4", "--ranks", "1", "--expert-dtype",
                         "fp8", "--overwrite", "--dry-run")  # fmt: skip
    assert code == 2 and "holds a share of another plan" in err, err
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "4", "--ranks", "1", "--overwrite")
    assert code == 0, err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0
    # a folder of one share alone (a machine's own OUT): redone with other options, its own earlier fragment
    # is what it replaces, not another share's
    alone = tmp_path / "alone"
    assert shard(monkeypatch, capsys, str(src), str(alone), "--tp", "4", "--ranks", "0,1")[0] == 0
    code, _, err = shard(monkeypatch, capsys, str(src), str(alone), "--tp", "4", "--ranks", "0,1", "--expert-dtype",
                         "fp8", "--overwrite")  # fmt: skip
    assert code == 0, err
    assert [p.name for p in alone.glob("manifest-fragment-*")] == ["manifest-fragment-mp4-r0_1.json"]
    assert '"fp8"' in (alone / "manifest-fragment-mp4-r0_1.json").read_text()


@pytest.mark.parametrize("name", [".dsv41-convert.lock", ".dsv41-convert/model0-mp2.safetensors.journal.tmp"])
@pytest.mark.parametrize("kind", ["symbolic", "hard"])
def test_a_link_at_a_record_or_lock_files_name_is_not_written_through(src, tmp_path, monkeypatch, capsys, name, kind):
    """The folder's lock (an exclusive taker truncates it) and a journal's temporary were opened through a link
    planted at their names: the link's target was truncated (an audit: a copy of a source shard cut to the
    journal's 230-byte header; a later audit: a hard link the same)."""
    out = tmp_path / "out"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2")[0] == 0
    victim = tmp_path / "precious.bin"
    victim.write_bytes(bytes(range(256)) * 64)
    (out / name).unlink(missing_ok=True)
    _link(out / name, victim, kind)
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--overwrite")
    assert victim.read_bytes() == bytes(range(256)) * 64
    if name.endswith(".lock") and kind == "symbolic":  # refused, not removed: another taker may have put its
        # lock file there meanwhile
        assert code == 2 and f"{out / name} is a link, not a lock file of ours; remove it" in err, err
        assert f"shard {src} -> {out}" not in err  # refused before the progress title
        (out / name).unlink()
        code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--overwrite")
    assert code == 0, err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


def test_a_share_started_while_a_share_of_another_plan_runs_is_refused(src, tmp_path, monkeypatch, capsys):
    """Two shares of two plans started at once into a fresh OUT both finished, exit 0, with OUT's config.json
    the last one's (an audit): neither had left a fragment for the other to see. A running share claims its
    plan (store/plan_claims.py); a share of another plan that finds a live claim is refused, one of the same
    plan is not, and a claim nobody holds any more (its run killed) is removed."""
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.store.plan_claims import claimed

    out = tmp_path / "out"
    out.mkdir()
    other = "0" * 64  # the plan of a share running now
    with claimed(out, other) as (_, live):
        assert live == []
        code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--ranks", "0")
        assert code == 2 and f"a share of another plan is being written into it now (plan {other[:12]}" in err, err
        assert not list(out.glob("model*"))
        assert [p.name for p in (out / ".dsv41-convert").glob("plan-*.claim")] == [f"plan-{other}.claim"]
    (out / ".dsv41-convert" / f"plan-{other}.claim").write_bytes(b"")  # a share killed: its claim held by none
    mine = build_plan(src, 2, "fp4").digest()
    with claimed(out, mine):  # the other share ended; one of this plan runs (a torchrun launch's other process)
        code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--ranks", "0")
        assert code == 0, err
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--ranks", "1")
    assert code == 0, err
    assert not list((out / ".dsv41-convert").glob("plan-*.claim"))  # removed by their last holders
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


def test_dry_run_of_a_share_refuses_a_running_share_of_another_plan_as_the_run_does(src, tmp_path, monkeypatch, capsys):
    """`shard --ranks 1 --dry-run` beside a share of another plan still running (its claim held, no fragment
    yet) said 0, where the run refuses it ("a share of another plan is being written into it now", exit 2):
    found with a medium-preset share running. The dry run looks at the claims too, and removes none."""
    from dsv41_convert.store.plan_claims import claimed

    out = tmp_path / "out"
    out.mkdir()
    other = "0" * 64  # the plan of a share running now
    said = f"a share of another plan is being written into it now (plan {other[:12]}"
    with claimed(out, other):
        for extra in (["--dry-run"], []):
            code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--ranks", "1", *extra)
            assert code == 2 and said in err, (extra, err)
    stale = out / ".dsv41-convert" / f"plan-{other}.claim"
    stale.write_bytes(b"")  # a share killed: its claim held by none; the dry run passes and leaves it
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--ranks", "1", "--dry-run")
    assert code == 0 and stale.exists(), err


@pytest.mark.parametrize("command", ["shard", "export", "reference-logits"])
@pytest.mark.parametrize("to", ["nowhere", "itself"])
def test_out_a_link_to_nowhere_is_named_as_such(src, tmp_path, monkeypatch, capsys, command, to):
    """OUT a dangling link: the error said only "OUT: File exists" (an audit); reference-logits replaced the link
    with its file, and a link to itself ended in a RuntimeError traceback (a later audit)."""
    out = tmp_path / "dangling"
    target = out if to == "itself" else tmp_path / "nowhere"
    out.symlink_to(target)
    args = {"shard": ["--tp", "2"], "export": ["--format", "bf16"], "reference-logits": []}[command]
    code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(out), *args)
    assert code == 2 and f"{out}: a link to {target}, which does not exist" in err, err
    assert out.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("finish", ["--resume", "--overwrite"])
def test_a_users_file_at_one_of_the_runs_names_is_never_written_over(src, tmp_path, monkeypatch, capsys, finish):
    """A run stopped after its first rank file, then a user's file put at the second's name: `--resume` wrote
    over it, exit 0 (an audit: the check for files no run of ours wrote ran only in a folder without our
    records). Refused now, the file kept; an --overwrite killed in its removals still resumes (its files are
    listed before their records go: test_an_overwrite_stopped_in_its_removals_...)."""
    out = tmp_path / "out"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--ranks", "0")[0] == 0
    for p in out.glob("manifest-fragment-*"):
        p.unlink()  # as a run of every rank stopped after rank 0: a done record, no fragment
    mine = out / "model1-mp2.safetensors"
    mine.write_text("my own precious data\n")
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", finish)
    assert code == 2 and "holds model1-mp2.safetensors, which no dsv41-convert run wrote there" in err, err
    assert mine.read_text() == "my own precious data\n"


def test_a_run_killed_between_a_files_rename_and_its_record_resumes(src, tmp_path, monkeypatch, capsys):
    """A rank file in place whose done record was not yet written (the run killed in between): it must still
    be the run's own to --resume, not a file no run of ours wrote. The journal went before the record, so for
    a moment neither said so (a run killed there was refused by the check for users' files)."""
    import dsv41_convert.convert.execute as execute

    out = tmp_path / "out"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(execute, "write_done", killed)
        code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--workers", "1")
    assert code == 130, err
    assert (out / "model0-mp2.safetensors").is_file() and not list((out / ".dsv41-convert").glob("*.done.json"))
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--resume")
    assert code == 0, err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


def test_an_overwrite_stopped_after_its_removals_leaves_no_marker_to_take_a_users_file(src, tmp_path, monkeypatch,
                                                                                       capsys):  # fmt: skip
    """The markers an --overwrite writes before it drops the records outlived the files they named: a user's
    file put at such a name later counted as ours and --resume wrote over it (an audit). They go with the
    files; a rank file of exactly the planned size that no record names (a run of the version before killed
    between its rename and its record) is still taken as ours."""
    import dsv41_convert.convert.execute as execute

    out = tmp_path / "out"
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2")[0] == 0
    real = execute._remove_replaced

    def stopped_after(*args):
        real(*args)
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(execute, "_remove_replaced", stopped_after)
        assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--overwrite")[0] == 130
    assert not list((out / ".dsv41-convert").glob("*.replacing")) and not list(out.glob("model*"))
    mine = out / "model0-mp2.safetensors"
    mine.write_text("my own precious data\n")
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--resume")
    assert code == 2 and "which no dsv41-convert run wrote there" in err and mine.read_text().startswith("my own")
    mine.unlink()
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--resume")[0] == 0
    (out / ".dsv41-convert" / "model1-mp2.safetensors.done.json").unlink()  # as the version before left it
    code, _, err = shard(monkeypatch, capsys, str(src), str(out), "--tp", "2", "--resume")
    assert code == 0, err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


@pytest.mark.parametrize("command", ["shard", "export"])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_signal_during_startup_stops_the_run_before_it_removes_or_writes(src, tmp_path, command, workers):
    """SIGTERM while the command's modules were imported is postponed to the next check (interrupts.py); the
    first one came after `--overwrite` had removed the conversion it replaces, and with workers after every
    job was handed out (an audit: `export --workers 2` wrote 6 of 14 shards after a SIGTERM at 0.4 s). Now the
    run stops before OUT is touched: 143, OUT as it was."""
    from cli_run import run_cli_with_a_signal_in_an_import

    out = tmp_path / "out"
    options = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
    first = subprocess.run(
        [sys.executable, "-m", "dsv41_convert.cli", command, str(src), str(out), *options],
        capture_output=True,
        text=True,
        check=False,
    )
    assert first.returncode == 0, first.stderr
    before = tree(out)
    args = (command, str(src), str(out), *options, "--overwrite", "--workers", workers)
    run = run_cli_with_a_signal_in_an_import("dsv41_convert.convert.execute", *args)
    assert run.returncode == 143, run.stderr
    assert tree(out) == before


def _interrupted_after(monkeypatch, module, name: str) -> None:
    """`module.name` marks this process interrupted once it returns, as a Ctrl-C that landed in it and was
    postponed (interrupts.py); the mark is undone after the test."""
    from dsv41_convert import interrupts

    monkeypatch.setitem(interrupts._state, "interrupted", False)
    original = getattr(module, name)

    def marked(*args, **kwargs):
        result = original(*args, **kwargs)
        interrupts.interrupt_later()
        return result

    monkeypatch.setattr(module, name, marked)


@pytest.mark.parametrize(
    ("first", "then"),
    [
        (["shard", "--tp", "2"], ["shard", "--tp", "2"]),  # the same conversion: its own files replaced
        (["shard", "--tp", "4"], ["shard", "--tp", "2"]),  # another conversion's files removed first
        (["export", "--format", "bf16"], ["export", "--format", "bf16"]),
        (["shard", "--tp", "2"], ["export", "--format", "bf16"]),
    ],
)
def test_a_signal_during_the_output_checks_stops_the_overwrite_before_it_removes(src, tmp_path, monkeypatch, capsys,
                                                                                first, then):  # fmt: skip
    """A signal postponed in the lock's wait or the checks: an --overwrite removed the conversion it replaces,
    then stopped (another conversion's files even after the check meant for it: an audit). 130, OUT as it was."""
    out = tmp_path / "out"
    assert run_cli(monkeypatch, capsys, first[0], str(src), str(out), *first[1:])[0] == 0
    before = tree(out)
    _interrupted_after(monkeypatch, execute_mod, "check_empty")
    code, _, err = run_cli(monkeypatch, capsys, then[0], str(src), str(out), *then[1:], "--overwrite")
    assert code == 130, err
    assert tree(out) == before


def test_a_signal_while_the_pool_starts_hands_out_no_job(src, tmp_path, monkeypatch, capsys):
    """The check before each job is handed to the pool. A signal that lands while the pool is made (it imports
    modules: postponed, interrupts.py) was only raised after the first job had been handed out, at the end of
    its deferred submit. Now no job is handed out: 130, no rank file begun."""
    from concurrent.futures import ProcessPoolExecutor

    from dsv41_convert import interrupts

    monkeypatch.setitem(interrupts._state, "interrupted", False)
    handed = []
    made, submit = ProcessPoolExecutor.__init__, ProcessPoolExecutor.submit

    def made_then_interrupted(pool, *args, **kwargs):
        made(pool, *args, **kwargs)
        interrupts.interrupt_later()

    def counted(pool, fn, *args, **kwargs):
        if fn is execute_mod._worker_file:
            handed.append(args[0].file)
        return submit(pool, fn, *args, **kwargs)

    monkeypatch.setattr(ProcessPoolExecutor, "__init__", made_then_interrupted)
    monkeypatch.setattr(ProcessPoolExecutor, "submit", counted)
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "4", "--workers", "2")
    assert code == 130, err
    assert handed == []
    assert not [p.name for p in out.iterdir() if p.name.startswith("model")]


def test_demo_overwrite_names_an_older_demos_mark_as_such(tmp_path, monkeypatch, capsys):
    """A demo of 2026-12-04 left DIR/.dsv41-demo as a line of text (no list of its conversions); --overwrite said
    "no .dsv41-demo" beside the file (a user's upgrade): it refuses naming the file as an older demo's."""
    proj = tmp_path / "proj"
    (proj / "mp2").mkdir(parents=True)
    (proj / "mp2" / "config.json").write_text("{}\n")
    (proj / "ref-tp1.safetensors").write_bytes(b"x")
    mark = proj / ".dsv41-demo"
    mark.write_text("written by `dsv41-convert demo`: src/, mp*/ and ref-tp1.safetensors are its output\n")
    before = tree(proj)
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(proj), "--tp", "2", "--overwrite")
    assert code == 2 and f"{mark}: " in err and "no .dsv41-demo" not in err and "before 2026-12-05" in err, err
    assert tree(proj) == before


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_share_run_again_over_its_finished_file_names_it_as_its_own(src, tmp_path, monkeypatch, capsys, dry_run):
    """`shard --ranks 1` again (no --resume) after rank 1 finished said "files other than the other ranks' files
    (model1-mp2.safetensors)", its own file called a stranger (a helper's hunt). Now: this share's file from an
    earlier run, with the advice; a stranger's file beside it is still said as before."""
    out = tmp_path / "out"
    run = ("shard", str(src), str(out), "--tp", "2", "--ranks", "1")
    assert run_cli(monkeypatch, capsys, *run)[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, *run, *(["--dry-run"] if dry_run else []))
    assert code == 2 and "holds 1 file of this share from an earlier run (model1-mp2.safetensors)" in err, err
    assert "--resume" in err and "other ranks' files" not in err, err
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, *run, *(["--dry-run"] if dry_run else []))
    assert code == 2 and "files other than the other ranks' files" in err and "notes.txt" in err, err


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("command", ["shard", "export"])
def test_too_little_space_is_said_before_any_progress_and_loses_nothing(
    src, tmp_path, monkeypatch, capsys, command, overwrite
):
    """Free space was checked only once the run held OUT: the progress display's title came first, and an
    --overwrite had already removed the conversion it replaces when it refused (a full disk lost the old files,
    exit 2). Now the refusal is the first thing said, and OUT is left as it was."""
    args = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
    out = (tmp_path / "out").resolve()
    capacity = 1000  # a disk holding OUT's files alone and 1,000 bytes more
    if overwrite:  # a smaller conversion replaced: even once it is removed, the new one does not fit
        other = ["--tp", "1"] if command == "shard" else ["--format", "fp8"]
        assert run_cli(monkeypatch, capsys, command, str(src), str(out), *other)[0] == 0
        capacity += sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    before = tree(out) if out.exists() else None
    monkeypatch.setattr(
        execute_mod, "disk_free", lambda path: capacity - sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    )
    extra = ["--overwrite"] if overwrite else []
    code, stdout, err = run_cli(monkeypatch, capsys, command, str(src), str(out), *args, *extra)
    assert code == 2 and err.startswith(f"error: {out}: ") and " bytes to write but only " in err and stdout == "", err
    assert (tree(out) if out.exists() else None) == before


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("share", ["ranks", "torchrun"])
def test_a_share_overwrite_with_too_little_space_keeps_the_file_it_replaces(
    src, tmp_path, monkeypatch, capsys, share, dry_run
):
    """A share's --overwrite of rank 0 on a full disk (`--ranks 0`, or RANK=0 WORLD_SIZE=2 as torchrun sets them):
    the early space check skipped every share's --overwrite, so the run showed its progress title, removed rank 0's
    finished file and its done record (a torchrun process also manifest.json), then refused (exit 2, the file lost),
    where --dry-run refused up front. Now the share is checked before anything is touched, with the dry run's
    numbers (what it removes first credited)."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    out = (tmp_path / "out").resolve()
    assert shard(monkeypatch, capsys, str(src), str(out), "--tp", "2")[0] == 0
    capacity = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())  # a disk holding OUT's files alone
    before = tree(out)
    monkeypatch.setattr(
        execute_mod, "disk_free", lambda path: capacity - sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    )
    run = ["--tp", "2", "--overwrite", *(["--dry-run"] if dry_run else [])]
    if share == "ranks":
        run += ["--ranks", "0"]
    else:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
    code, stdout, err = shard(monkeypatch, capsys, str(src), str(out), *run)
    assert code == 2 and f"{out}: " in err and stdout == "", err
    assert f"-> {out}" not in err  # no progress title
    said = f" but only {(out / 'model0-mp2.safetensors').stat().st_size:,} bytes free on that device"
    assert said in err, err
    assert tree(out) == before
