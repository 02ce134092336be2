"""execute's records of what it wrote: a commit that fails fails the run, a resume reports the bytes it kept,
and a rank file left between its rename and its record by an older version is still the run's own."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path
from unittest import mock

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

import dsv41_convert.convert.execute as execute_mod
import dsv41_convert.store.source_stamps as stamps
from dsv41_convert.convert import write
from dsv41_convert.convert.execute import _set_aside_tokenizer_files, check_empty, execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.convert.write import write_partial
from dsv41_convert.errors import OutputError
from dsv41_convert.store.journal import journal_path
from dsv41_convert.store.manifest import DONE_DIR, MANIFEST
from dsv41_convert.store.sink import Sink

CHUNK, JOURNAL = 1 << 12, 1 << 13  # many chunks and checkpoints in a small rank file


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("records") / "bf16", quantized=False, vision=False)


@pytest.fixture(scope="module")
def clean(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("records-clean") / "out"
    execute(build_plan(src, 2), out)
    return out


def test_a_flush_error_on_the_last_rank_file_fails_the_run(src, tmp_path, monkeypatch):
    """With one worker each file's fsync + rename runs in a thread while the next is written; the last one's
    outcome must still be waited for: dropped, a full disk found at its flush ended the run with exit 0, a
    rank file missing and a fragment written as if a share had finished."""
    plan = build_plan(src, 2)
    last = plan.files[-1].file
    real = write.fsync_path

    def full_at_the_last(path: Path) -> None:
        if Path(path).name == last + ".partial":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path)

    monkeypatch.setattr(write, "fsync_path", full_at_the_last)
    out = tmp_path / "out"
    with pytest.raises(OutputError, match=rf"{last}: no space left"):
        execute(plan, out, workers=1)
    assert not (out / last).exists() and not (out / MANIFEST).exists()


def test_a_resume_reports_the_bytes_it_kept_and_wrote(src, clean, tmp_path):
    """A rank file stopped by Ctrl-C past a few checkpoints, then `--resume`: the summary says the bytes kept
    from the partial file (the journal's last checkpoint) and counts as written only the rest, and the files
    end as an uninterrupted run's."""
    plan = build_plan(src, 2)
    rf, out = plan.files[1], tmp_path / "out"
    out.mkdir()
    after_chunk = Sink._after_chunk

    def stop_half_way(sink: Sink) -> None:
        after_chunk(sink)
        if sink.queued > rf.nbytes // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), mock.patch.object(Sink, "_after_chunk", stop_half_way):
        write_partial(rf, src, out, quantizer_for("cpu"), chunk_bytes=CHUNK, plan_digest=plan.digest(),
                      journal_bytes=JOURNAL)  # fmt: skip
    kept = json.loads(journal_path(out, rf.file).read_text().splitlines()[-1])["end"]
    assert 0 < kept < rf.nbytes
    summary = execute(plan, out, resume=True, chunk_bytes=CHUNK, journal_bytes=JOURNAL)
    assert summary["resumed"] == {rf.file: kept}, summary["resumed"]
    assert summary["bytes"] == sum(f.nbytes for f in plan.files) - kept, summary["bytes"]
    for f in plan.files:
        assert (out / f.file).read_bytes() == (clean / f.file).read_bytes(), f.file


def test_a_rank_file_of_the_planned_size_without_a_record_is_resumed(src, clean, tmp_path):
    """A run of a version before 2026-12-05 killed between a rank file's rename and its done record left the
    file with no record, no journal and no manifest: --resume must take it as the run's own (it has exactly
    the planned size) and write it again, not refuse it as a user's file."""
    plan = build_plan(src, 2)
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    victim = plan.files[0].file
    (out / DONE_DIR / f"{victim}.done.json").unlink()
    (out / MANIFEST).unlink()
    assert not journal_path(out, victim).exists() and (out / victim).stat().st_size == plan.files[0].nbytes
    summary = execute(plan, out, resume=True)
    assert summary["written"] == [victim] and summary["manifest"], summary
    assert (out / victim).read_bytes() == (clean / victim).read_bytes()


def test_an_overwrite_replaces_another_conversion_killed_between_a_rename_and_its_record(src, tmp_path, monkeypatch):
    """A tp-4 run killed after a rank file's rename, before its done record, leaves that file with only its
    journal to say it is ours: an --overwrite at tp 2 must take it for the earlier run's and remove it, not
    refuse it as a file no run of ours wrote (nor leave it beside the new rank files)."""
    out = tmp_path / "out"

    def killed(*args, **kwargs) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(execute_mod, "write_done", killed)
        with pytest.raises(KeyboardInterrupt):
            execute(build_plan(src, 4), out, workers=1)
    first = "model0-mp4.safetensors"
    assert (out / first).is_file() and journal_path(out, first).exists()
    assert not (out / DONE_DIR / f"{first}.done.json").exists()
    summary = execute(build_plan(src, 2), out, overwrite=True)
    assert summary["manifest"] and not list(out.glob("*mp4*")), sorted(p.name for p in out.iterdir())


def test_a_share_finishing_beside_a_truncated_rank_file_writes_no_manifest(src, tmp_path):
    """`shard --ranks 1`, then rank 1's file cut short (a copy from another machine stopped half-way), then
    `shard --ranks 0` finishing the set: the done record of rank 1 no longer matches its file's size, so the
    run leaves a fragment, not a manifest.json that calls the folder complete."""
    plan = build_plan(src, 2)
    out = tmp_path / "out"
    execute(plan, out, ranks=[1])
    other = out / plan.files[1].file
    with open(other, "r+b") as f:
        f.truncate(plan.files[1].nbytes // 2)
    summary = execute(plan, out, ranks=[0])
    assert summary["manifest"] is None and summary["fragment"], summary
    assert not (out / MANIFEST).exists()


def test_the_markers_of_an_overwrite_stopped_before_its_removals_go_with_the_manifest(src, tmp_path, monkeypatch):
    """An --overwrite stopped after it marked the files it replaces (DONE_DIR/FILE.replacing), before it removed
    them, then --resume: the manifest it writes ends the replacement, so the markers go with it; left, a marker
    made a user's file put later at that name count as ours, and a later --resume wrote over it."""
    plan = build_plan(src, 2)
    out = tmp_path / "out"
    execute(plan, out)

    def stopped(*args) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(execute_mod, "_forget_done", stopped)
        with pytest.raises(KeyboardInterrupt):
            execute(plan, out, overwrite=True)
    assert len(list((out / DONE_DIR).glob("*.replacing"))) == len(plan.files)
    summary = execute(plan, out, resume=True)
    assert summary["manifest"] and not list((out / DONE_DIR).glob("*.replacing"))


def test_a_run_again_from_the_same_source_sets_no_tokenizer_file_aside(src, tmp_path):
    """Tokenizer files are set aside only where the new SRC lacks them: an --overwrite from the same source
    replaces them in place, and moves nothing into DONE_DIR/set-aside (which the CLI reports as a warning)."""
    plan = build_plan(src, 2)
    out = tmp_path / "out"
    execute(plan, out)
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    summary = execute(plan, out, overwrite=True)
    assert summary["set_aside"] == [] and not (out / DONE_DIR / "set-aside").exists()
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_a_share_refuses_a_folder_holding_a_file_no_share_writes(tmp_path):
    """check_empty for a share of the ranks (--ranks, a torchrun process; `others` given): the other shares'
    rank files and the files every share writes pass, a file of someone else's (notes.txt) is refused and
    named, as for a run of every rank; passed, the run wrote its rank files beside it."""
    others = frozenset({"model1-mp2.safetensors", "model1-mp2.safetensors.partial"})
    (tmp_path / "model1-mp2.safetensors").write_bytes(b"the other share's")
    (tmp_path / "config.json").write_text("{}")
    check_empty(tmp_path, resume=False, overwrite=False, others=others)
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(OutputError, match=r"files other than the other ranks' files \(notes\.txt\)"):
        check_empty(tmp_path, resume=False, overwrite=False, others=others)


def test_a_share_refuses_a_source_changed_since_another_share_began_its_file(tmp_path):
    """`shard --ranks 1` stopped half-way (its partial file kept for --resume), then a source shard replaced,
    then `shard --ranks 0`: the partial file may hold the old source's bytes and would be finished and counted
    towards this conversion, so the share is refused (as it is beside a finished file of the old source)."""
    src = make_tiny(tmp_path / "src", quantized=False, vision=False)
    plan = build_plan(src, 2)
    out = tmp_path / "out"
    after_chunk = Sink._after_chunk

    def stop_half_way(sink: Sink) -> None:
        after_chunk(sink)
        if sink.queued > plan.files[1].nbytes // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), mock.patch.object(Sink, "_after_chunk", stop_half_way):
        execute(plan, out, ranks=[1], chunk_bytes=CHUNK, journal_bytes=JOURNAL)
    assert (out / (plan.files[1].file + ".partial")).exists()
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as a shard fetched again
    with pytest.raises(OutputError, match=rf"{plan.files[1].file} may hold the old bytes"):
        execute(build_plan(src, 2), out, ranks=[0])
    assert not (out / plan.files[0].file).exists()


def test_a_resume_that_rewrites_a_file_first_removes_the_manifest(src, tmp_path):
    """A finished folder whose rank file was damaged since, then --resume stopped while writing it again: the
    manifest.json of the finished run must be gone, since it lists bytes no longer in the folder (a folder with
    a manifest counts as finished); kept, the stopped run left a "finished" folder holding a damaged file."""
    plan = build_plan(src, 2)
    out = tmp_path / "out"
    execute(plan, out)
    damaged = out / plan.files[1].file
    with open(damaged, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))

    def stopped(sink: Sink) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), mock.patch.object(Sink, "_after_chunk", stopped):
        execute(plan, out, resume=True)
    assert not (out / MANIFEST).exists()


def test_a_resume_with_files_to_write_checks_the_space_first(src, clean, tmp_path, monkeypatch):
    """--resume skips the up-front check of a run from the start (its files may be mostly done) and checks the
    bytes it still has to write once it knows them: with a rank file to write again and 1 KiB free, it is
    refused before any byte, naming OUT, not left to fail half-way through a file."""
    plan = build_plan(src, 2)
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    (out / plan.files[1].file).unlink()
    (out / MANIFEST).unlink()
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 1024)
    with pytest.raises(OutputError, match="to write but only"):
        execute(plan, out, resume=True)
    assert not (out / plan.files[1].file).exists() and not (out / (plan.files[1].file + ".partial")).exists()


def test_tokenizer_files_set_aside_again_and_again_are_all_kept(tmp_path):
    """Each run from a source without tokenizer files moves OUT's tokenizer.json to DONE_DIR/set-aside/ under a
    name not yet taken (tokenizer.json, .1, .2, ...): a hand-placed file set aside earlier is never replaced."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    for version in ("v1", "v2", "v3"):
        (out / "tokenizer.json").write_text(version)
        _set_aside_tokenizer_files(src, out)
    aside = out / DONE_DIR / "set-aside"
    kept = {p.name: p.read_text() for p in aside.iterdir()}
    assert kept == {"tokenizer.json": "v1", "tokenizer.json.1": "v2", "tokenizer.json.2": "v3"}, kept


def test_tp2_shares_of_two_sources_finishing_in_one_folder_are_refused(tmp_path, monkeypatch):
    """Two --ranks shares of a tp-2 conversion into one folder from two sources of one layout (one plan digest),
    on two hosts (source stamps are per host): the share completing the set compares the replicated tensors
    and writes no manifest.json; at tp 2 as at tp 4 (tp 1 has one rank file, nothing to compare)."""
    one = make_tiny(tmp_path / "one", quantized=False, vision=False)
    other = make_tiny(tmp_path / "other", quantized=False, vision=False, seed=1)
    out = tmp_path / "out"
    execute(build_plan(one, 2), out, ranks=[0])
    monkeypatch.setattr(stamps.socket, "gethostname", lambda: "otherhost")
    with pytest.raises(OutputError, match=r"cannot write manifest.json: \d+ replicated tensors? differs? between"):
        execute(build_plan(other, 2), out, ranks=[1])
    assert not (out / MANIFEST).exists()


def test_a_tokenizer_file_another_share_set_aside_first_is_not_an_error(tmp_path, monkeypatch):
    """Two processes of a torchrun launch into one OUT both find the earlier run's tokenizer.json and both move it
    aside; the second's os.replace found it gone and the share died of a FileNotFoundError (a helper's reading).
    Now the one that moved it reports it, the other goes on."""
    from dsv41_convert.convert import execute as execute_module

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (out / "tokenizer.json").write_text("earlier")
    real_replace = os.replace

    def peer_first(a, b):  # the other share's move lands between this one's look and its own move
        real_replace(a, Path(b).with_name("tokenizer.json.peer"))
        real_replace(a, b)

    monkeypatch.setattr(execute_module.os, "replace", peer_first)
    assert _set_aside_tokenizer_files(src, out) == []
    monkeypatch.setattr(execute_module.os, "replace", real_replace)
    aside = out / DONE_DIR / "set-aside"
    assert {p.name: p.read_text() for p in aside.iterdir()} == {"tokenizer.json.peer": "earlier"}
