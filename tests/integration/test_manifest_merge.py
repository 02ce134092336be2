"""Rank files written on several machines (`shard --ranks`, torchrun shares): each run leaves a manifest
fragment; `dsv41-convert manifest OUT` (or `shard --resume`) in the gathered folder writes manifest.json
equal to a single full run's, and refuses missing ranks, mismatching files and mixed plans."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.errors import OutputError, VerifyInputError
from dsv41_convert.store.manifest_check import check_folder
from dsv41_convert.store.manifest_merge import write_fragment


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A full tp-4 run, and ranks 0,3 / 1,2 (and 1,2 with fp8 experts) each in its own folder."""
    root = tmp_path_factory.mktemp("merge")
    src = make_tiny(root / "src")
    plan = build_plan(src, 4)
    folders = {"full": root / "full", "a": root / "a", "b": root / "b", "b_fp8": root / "b_fp8"}
    execute(plan, folders["full"])
    assert execute(plan, folders["a"], ranks=[0, 3])["fragment"] == str(
        folders["a"] / "manifest-fragment-mp4-r0_3.json"
    )
    execute(plan, folders["b"], ranks=[1, 2])
    execute(build_plan(src, 4, "fp8"), folders["b_fp8"], ranks=[1, 2])
    return folders | {"src": src}


def test_a_signal_during_startup_stops_the_merge_before_it_writes(runs, tmp_path):
    """SIGTERM while `manifest` imported its modules was postponed to a check the merge never made: it took
    the lock, wrote the done records and manifest.json, then exited 143 (an audit). Now nothing is written."""
    from cli_run import run_cli_with_a_signal_in_an_import

    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    before = sorted(p.name for p in g.rglob("*"))
    run = run_cli_with_a_signal_in_an_import("dsv41_convert.store.manifest_merge", "manifest", str(g), "--json")
    assert run.returncode == 143 and json.loads(run.stdout)["exit_code"] == 143, (run.stdout, run.stderr)
    assert sorted(p.name for p in g.rglob("*")) == before and not (g / "manifest.json").exists()


def test_a_signal_while_the_files_are_hashed_writes_no_record(runs, tmp_path, monkeypatch, capsys):
    """The check between the hashes and the first done record (a signal whose KeyboardInterrupt was dropped
    while the rank files were hashed): without it the merge wrote the records, then stopped. 130, nothing
    written."""
    from dsv41_convert import interrupts
    from dsv41_convert.store import manifest_merge

    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    before = sorted(p.name for p in g.rglob("*"))
    monkeypatch.setitem(interrupts._state, "interrupted", False)
    original = manifest_merge._other_revisions

    def marked(frags):
        found = original(frags)
        interrupts.interrupt_later()
        return found

    monkeypatch.setattr(manifest_merge, "_other_revisions", marked)
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 130, err
    assert sorted(p.name for p in g.rglob("*")) == before and not (g / "manifest.json").exists()


def _gather(dest: Path, *folders: Path) -> Path:
    """What a user copies from each machine: the visible files (rank files, fragment, config, tokenizer)."""
    dest.mkdir()
    for folder in folders:
        for p in folder.iterdir():
            if p.is_file():
                shutil.copy(p, dest / p.name)
    return dest


def _files(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())["files"]


def test_fragment_is_not_a_manifest(runs):
    a = runs["a"]
    assert not (a / "manifest.json").exists()
    frag = json.loads((a / "manifest-fragment-mp4-r0_3.json").read_text())
    assert frag["complete"] is False and sorted(frag["files"]) == ["model0-mp4.safetensors", "model3-mp4.safetensors"]
    assert frag["rank_files"] == [f"model{r}-mp4.safetensors" for r in range(4)]
    with pytest.raises(VerifyInputError, match=r"manifest\.json: not found"):
        check_folder(a)


def test_merge_equals_a_full_run(runs, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(g), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["manifest"] == str(g / "manifest.json") and len(summary["fragments"]) == 2
    assert _files(g) == _files(runs["full"])
    full = json.loads((runs["full"] / "manifest.json").read_text())
    merged = json.loads((g / "manifest.json").read_text())
    assert merged["plan_digest"] == full["plan_digest"] and merged["options"] == full["options"]
    # the same bytes as the full run's (a merge listed the side files in another order: an audit)
    assert (g / "manifest.json").read_bytes() == (runs["full"] / "manifest.json").read_bytes()
    assert merged["source"]["index_sha256"] == full["source"]["index_sha256"]
    assert check_folder(g).ok


def test_a_killed_merges_temporary_is_removed_by_the_next(runs, tmp_path, monkeypatch, capsys):
    """kill -9 of `manifest` while it wrote manifest.json left manifest.json.PID.partial, which the next merge
    kept and `check` listed as unchecked ever after (found by a helper's crash-consistency hunt). The next merge
    (it holds the folder alone) removes it; a file of the user's of that shape but another name stays."""
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    (g / "manifest.json.4242.partial").write_text('{"cut": ')
    (g / "notes.4242.partial").write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 0, err
    assert not (g / "manifest.json.4242.partial").exists() and (g / "notes.4242.partial").read_text() == "mine"
    assert (g / "manifest.json").read_bytes() == (runs["full"] / "manifest.json").read_bytes()


def test_resume_in_a_gathered_folder_writes_the_manifest(runs, tmp_path):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    summary = execute(build_plan(runs["src"], 4), g, resume=True)
    assert summary["written"] == [] and len(summary["skipped"]) == 4 and summary["manifest"]
    assert _files(g) == _files(runs["full"])


@pytest.mark.parametrize("how", ["manifest", "shard --resume"])
def test_shares_of_two_sources_of_one_layout_are_refused(runs, tmp_path, monkeypatch, capsys, how):
    """Two checkpoints of one layout (make-tiny seeds 0 and 1) have one plan digest: their shares merged and
    passed `check` (an audit). Their replicated tensors differ, and the merge now compares them."""
    other = make_tiny(tmp_path / "other", seed=1)
    execute(build_plan(other, 4), tmp_path / "b1", ranks=[1, 2])
    g = _gather(tmp_path / "g", runs["a"], tmp_path / "b1")
    if how == "manifest":
        code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    else:
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(runs["src"]), str(g), "--tp", "4", "--resume")
    assert code == 2 and f"{g}: cannot write manifest.json: " in err, err
    assert "replicated tensors differ between the rank files" in err and "from different sources?" in err
    assert not (g / "manifest.json").exists()


def test_shares_of_two_sources_finishing_in_one_folder_are_refused(runs, tmp_path, monkeypatch):
    """Two shares into one folder (shared storage) from two sources of one layout, run on two hosts, where the
    source stamps (recorded per host) do not reach: the share that completed the set wrote manifest.json and
    `check` passed (an audit). The completing share now compares the replicated tensors."""
    import dsv41_convert.store.source_stamps as stamps

    other = make_tiny(tmp_path / "other", seed=1)
    out = tmp_path / "out"
    execute(build_plan(runs["src"], 4), out, ranks=[0, 3])
    monkeypatch.setattr(stamps.socket, "gethostname", lambda: "otherhost")
    with pytest.raises(OutputError, match=r"cannot write manifest.json: \d+ replicated tensors? differs? between"):
        execute(build_plan(other, 4), out, ranks=[1, 2])
    assert not (out / "manifest.json").exists()


def test_the_processes_of_one_torchrun_launch_compare_no_replicas(runs, tmp_path, monkeypatch):
    """They read one SRC; each of those finishing last would read every rank file's replicas (29 GB of the
    real model at tp 8): only shares given --ranks, and gathered folders, compare them."""
    import dsv41_convert.convert.unshard as unshard

    def never(*args):
        raise AssertionError("shares_agree ran")

    monkeypatch.setattr(unshard, "shares_agree", never)
    plan, out = build_plan(runs["src"], 4), tmp_path / "out"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        summary = execute(plan, out)
    assert summary["manifest"] and _files(out) == _files(runs["full"])


def test_missing_rank_is_an_error(runs, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    (g / "model2-mp4.safetensors").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 2 and "model2-mp4.safetensors: missing" in err and not (g / "manifest.json").exists()
    g2 = _gather(tmp_path / "g2", runs["a"])  # machine b's files never copied
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g2))
    assert code == 2 and "model1-mp4.safetensors: no fragment lists it" in err and "model2-mp4" in err


def test_corrupt_rank_file_is_an_error(runs, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    with open(g / "model3-mp4.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 1]))
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 2 and "model3-mp4.safetensors: sha256" in err and "manifest-fragment-mp4-r0_3.json says" in err


def test_mixed_plans_are_an_error(runs, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", runs["a"], runs["b_fp8"])
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 2 and "manifest-fragment-mp4-r1_2.json: from another plan" in err
    assert not (g / "manifest.json").exists()


def test_resume_beside_a_fragment_of_another_plan_says_what_to_remove(runs, tmp_path):
    """`shard --resume` in a gathered folder holding a share of another plan said "remove it [the fragment] or
    use --overwrite"; removed as told, the share's rank files were then refused as files no run of ours wrote
    ("remove them yourself"). The advice names them too, and followed, the resume finishes the conversion."""
    g = _gather(tmp_path / "g", runs["a"], runs["b_fp8"])
    plan = build_plan(runs["src"], 4)
    with pytest.raises(OutputError) as refused:
        execute(plan, g, resume=True)
    said = str(refused.value)
    assert "manifest-fragment-mp4-r1_2.json: a fragment from a run with other options" in said, said
    assert "model1-mp4.safetensors, model2-mp4.safetensors" in said, said
    for name in ("manifest-fragment-mp4-r1_2.json", "model1-mp4.safetensors", "model2-mp4.safetensors"):
        (g / name).unlink()  # as it says
    summary = execute(plan, g, resume=True)
    assert summary["written"] == ["model1-mp4.safetensors", "model2-mp4.safetensors"] and summary["manifest"]
    assert _files(g) == _files(runs["full"])


def test_a_fragment_that_is_a_fifo_is_refused_not_waited_on(runs, tmp_path):
    """A FIFO at a fragment's name: read whole, it blocks until a writer comes (the reads of the session's other
    FIFO audits); merge refuses it, naming it."""
    import os
    import subprocess
    import sys

    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    fragment = sorted(g.glob("manifest-fragment-*.json"))[-1]
    fragment.unlink()
    os.mkfifo(fragment)
    cmd = [sys.executable, "-c", "from dsv41_convert.cli import main; main()", "manifest", str(g)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 2 and f"{fragment}: not a regular file (a FIFO" in run.stderr, run.stderr[-2000:]
    assert not (g / "manifest.json").exists()


def test_no_fragment_is_an_error(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(tmp_path))
    assert code == 2 and "no manifest-fragment-*.json files" in err


def test_rank_files_no_run_of_ours_wrote_are_named_as_such(tmp_path, monkeypatch, capsys):
    """A folder upstream convert.py wrote (rank files, tokenizer, config.json; no record of a run of ours): the
    refusal told the user to copy in the fragments of `shard --ranks` runs they never made."""
    for name in ("model0-mp2.safetensors", "model1-mp2.safetensors", "config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes(b"x")
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(tmp_path))
    assert code == 2 and "no manifest-fragment-*.json files" in err and "upstream convert.py" in err, err
    assert "`shard` SRC OUT" in err and not (tmp_path / "manifest.json").exists()


def test_a_folder_whose_last_share_wrote_the_manifest_needs_no_merge(runs, tmp_path, monkeypatch, capsys):
    """Shares that finish at the same moment each see every rank file done and each write manifest.json (no
    fragment left): `manifest` then reports that manifest (exit 0, `already_merged`) instead of failing for
    want of fragments; without a manifest it still fails."""
    out = tmp_path / "out"
    summary = execute(build_plan(runs["src"], 4), out)
    assert summary["manifest"] and not list(out.glob("manifest-fragment-*.json"))
    before = (out / "manifest.json").read_bytes()
    code, stdout, err = run_cli(monkeypatch, capsys, "manifest", str(out), "--json")
    assert code == 0, err
    got = json.loads(stdout)
    assert got["already_merged"] and got["manifest"] == str(out / "manifest.json")
    assert sorted(got["rank_files"]) == [f"model{r}-mp4.safetensors" for r in range(4)]
    assert (out / "manifest.json").read_bytes() == before
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(out))  # one run, no shares: it said "the share"
    # it said "(a shared run: its share that finished last ...)" of a run that had no shares (a helper's hunt)
    assert code == 0 and "already written by the run of these files (or by its share that" in err, err
    assert "a shared run" not in err, err
    for name, offset in (("model2-mp4.safetensors", -1), ("config.json", 2)):  # same sizes, one byte other
        path = out / name
        data = bytearray(original := path.read_bytes())
        data[offset] ^= 1
        path.write_bytes(data)
        code, _, err = run_cli(monkeypatch, capsys, "manifest", str(out))  # it compared sizes only: exit 0
        assert code == 2 and f"{name}: sha256 " in err and "corrupt?" in err, err
        path.write_bytes(original)
    (out / "manifest.json").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(out))
    assert code == 2 and "no manifest-fragment-*.json files" in err


def test_torchrun_shares_leave_fragments(runs, tmp_path, monkeypatch):
    plan = build_plan(runs["src"], 4)
    for me in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(me))
        summary = execute(plan, tmp_path / f"m{me}")
        assert summary["fragment"].endswith(f"manifest-fragment-mp4-r{me}_{me + 2}.json")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    g = _gather(tmp_path / "g", tmp_path / "m0", tmp_path / "m1")
    execute(plan, g, resume=True)
    assert _files(g) == _files(runs["full"])


def test_a_rewrite_of_some_ranks_with_other_options_is_refused(runs, tmp_path, monkeypatch, capsys):
    """--overwrite of some ranks with other options: it removed the old manifest.json and other plans'
    fragments and rewrote its ranks, leaving the other ranks of the replaced conversion beside them, a
    whole-looking set of two conversions for a loader that reads no manifest (an audit). Refused before
    anything is removed or written."""
    out = tmp_path / "out"
    shutil.copytree(runs["full"], out)
    shutil.copy(runs["b"] / "manifest-fragment-mp4-r1_2.json", out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(OutputError, match=r"holds a share of another plan .*convert every rank again"):
        execute(build_plan(runs["src"], 4, "fp8"), out, ranks=[0], overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert check_folder(out).ok


def test_a_resume_with_nothing_left_to_write_keeps_the_manifest(runs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(runs["full"], out)
    before = (out / "manifest.json").read_bytes()
    res = execute(build_plan(runs["src"], 4), out, resume=True)
    assert res["written"] == [] and (out / "manifest.json").read_bytes() == before


# --- side files (config.json, hf_config.json, tokenizer files): each fragment records the ones its share wrote


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def other_shares(runs, tmp_path_factory) -> dict[str, Path]:
    """Ranks 1,2 of the same plan (same index, same digest) written from other copies of the source:
    `tok` with another tokenizer.json, `no_tc` without tokenizer_config.json; `no_tc_a` ranks 0,3 of it."""
    root = tmp_path_factory.mktemp("other")
    tok = shutil.copytree(runs["src"], root / "src_tok")
    (tok / "tokenizer.json").write_text(json.dumps(json.loads((tok / "tokenizer.json").read_text()), indent=1))
    no_tc = shutil.copytree(runs["src"], root / "src_no_tc")
    (no_tc / "tokenizer_config.json").unlink()
    shares = {"tok": root / "tok", "no_tc": root / "no_tc", "no_tc_a": root / "no_tc_a"}
    execute(build_plan(tok, 4), shares["tok"], ranks=[1, 2])
    execute(build_plan(no_tc, 4), shares["no_tc"], ranks=[1, 2])
    execute(build_plan(no_tc, 4), shares["no_tc_a"], ranks=[0, 3])
    assert build_plan(tok, 4).digest() == build_plan(runs["src"], 4).digest()  # the index alone names the plan
    return shares


def _refused(monkeypatch, capsys, g: Path, *names: str) -> str:
    """`manifest g` exits 2 naming each of `names`, writes no manifest, and `check` then refuses g."""
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 2 and out == "", (code, out, err)
    for name in names:
        assert name in err, err
    assert not (g / "manifest.json").exists()
    with pytest.raises(VerifyInputError, match=r"manifest\.json: not found"):
        check_folder(g)
    return err


def test_fragment_records_the_side_files_its_share_wrote(runs):
    frag = json.loads((runs["a"] / "manifest-fragment-mp4-r0_3.json").read_text())
    side = ["config.json", "hf_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(frag["side_files"]) == side
    for name in side:
        path = runs["a"] / name
        assert frag["side_files"][name] == {"size": path.stat().st_size, "sha256": _sha256(path)}


def test_clean_gather_checks_the_side_files(runs, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(g), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["side_files"] == ["config.json", "hf_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert summary["side_files_unchecked"] == []
    assert check_folder(g).ok


@pytest.mark.parametrize(
    "name, damage, found",
    [
        ("config.json", lambda p: p.write_text("garbage\n"), "8 bytes"),
        ("tokenizer.json", lambda p: p.write_text('{"x":1}\n'), "8 bytes"),
        ("hf_config.json", lambda p: p.write_bytes(p.read_bytes().replace(b"256", b"257", 1)), "sha256"),
        ("tokenizer_config.json", lambda p: p.unlink(), "missing"),
        ("tokenizer.json", lambda p: p.unlink(), "missing"),
    ],
)
def test_a_damaged_side_file_is_an_error(runs, tmp_path, monkeypatch, capsys, name, damage, found):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    damage(g / name)
    err = _refused(monkeypatch, capsys, g, "manifest-fragment-mp4-r0_3.json")
    error = err.split("error: ", 1)[1]
    assert error.startswith(f"{g}: cannot write manifest.json: {name}: {found}"), error
    others = {"config.json", "hf_config.json", "tokenizer.json", "tokenizer_config.json", "model"} - {name}
    assert not [o for o in others if f" {o}" in error], error  # only the damaged file is named


def test_a_damaged_side_file_is_an_error_through_the_shell(tmp_path):
    """The reported case, as a user runs it: tp 2, one rank per share, garbage config.json."""
    exe = str(Path(sys.executable).with_name("dsv41-convert"))
    src = make_tiny(tmp_path / "src")
    for r in (0, 1):
        subprocess.run([exe, "shard", str(src), str(tmp_path / f"s{r}"), "--tp", "2", "--ranks", str(r)], check=True)
    g = _gather(tmp_path / "g", tmp_path / "s0", tmp_path / "s1")
    (g / "config.json").write_text("garbage\n")
    res = subprocess.run([exe, "manifest", str(g)], capture_output=True, text=True)
    assert res.returncode == 2 and "config.json: 8 bytes" in res.stderr, res.stderr
    assert not (g / "manifest.json").exists()
    assert subprocess.run([exe, "check", str(g)], capture_output=True).returncode != 0


def test_shares_that_wrote_different_side_files_are_an_error(runs, other_shares, tmp_path, monkeypatch, capsys):
    # another tokenizer.json beside the same plan: whichever copy came last would go into the manifest
    both = "manifest-fragment-mp4-r1_2.json and manifest-fragment-mp4-r0_3.json record different files"
    g = _gather(tmp_path / "g", runs["a"], other_shares["tok"])
    _refused(monkeypatch, capsys, g, f" tokenizer.json: {both}")
    # another config.json (a share of another version of this tool, say)
    b = shutil.copytree(runs["b"], tmp_path / "b")
    (b / "config.json").write_text((b / "config.json").read_text().replace("256", "257", 1))
    plan = build_plan(runs["src"], 4)
    done = ["model1-mp4.safetensors", "model2-mp4.safetensors"]
    write_fragment(b, plan, {"tp": 4, "expert_dtype": "fp4", "device": "cpu"}, done)
    g2 = _gather(tmp_path / "g2", runs["a"], b)
    _refused(monkeypatch, capsys, g2, f" config.json: {both}")
    # one share wrote tokenizer_config.json, the other did not
    g3 = _gather(tmp_path / "g3", runs["a"], other_shares["no_tc"])
    _refused(monkeypatch, capsys, g3, "tokenizer_config.json: manifest-fragment-mp4-r0_3.json records it", "r1_2.json")


def test_a_side_file_no_share_wrote_is_an_error(runs, other_shares, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", other_shares["no_tc_a"], other_shares["no_tc"])
    assert not (g / "tokenizer_config.json").exists()
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(g), "--json")
    assert code == 0 and "tokenizer_config.json" not in json.loads(out)["side_files"], err
    (g / "manifest.json").unlink()
    for share in (other_shares["no_tc_a"], other_shares["no_tc"]):  # the merge removed them: gathered again
        for frag in share.glob("manifest-fragment-*.json"):
            shutil.copy(frag, g)
    shutil.copy(runs["src"] / "tokenizer_config.json", g)  # copied in by hand
    _refused(monkeypatch, capsys, g, "tokenizer_config.json: no fragment records it")


def _strip_side_files(fragment: Path) -> None:
    """What `shard --ranks` of an earlier version wrote: no side_files record."""
    data = json.loads(fragment.read_text())
    del data["side_files"]
    fragment.write_text(json.dumps(data))


def test_fragments_of_an_earlier_version_merge_with_side_files_unchecked(runs, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    for frag in g.glob("manifest-fragment-*.json"):
        _strip_side_files(frag)
    (g / "tokenizer.json").write_text('{"x":1}\n')  # nothing to check it against
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(g), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["side_files_unchecked"] == ["manifest-fragment-mp4-r0_3.json", "manifest-fragment-mp4-r1_2.json"]
    assert summary["side_files"] == []
    # one old fragment beside a new one: the new one's record still checks every side file
    g2 = _gather(tmp_path / "g2", runs["a"], runs["b"])
    _strip_side_files(g2 / "manifest-fragment-mp4-r1_2.json")
    (g2 / "config.json").write_text("garbage\n")
    _refused(monkeypatch, capsys, g2, "config.json: 8 bytes, manifest-fragment-mp4-r0_3.json says")
    (g2 / "config.json").write_bytes((runs["a"] / "config.json").read_bytes())
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(g2), "--json")
    assert code == 0, err
    assert json.loads(out)["side_files_unchecked"] == ["manifest-fragment-mp4-r1_2.json"]
    assert check_folder(g2).ok


def test_mixed_plans_name_the_other_plan_once(runs, tmp_path, monkeypatch, capsys):
    """The other plan's fragment lists ranks 1 and 2: no "no fragment lists it" line for them beside it."""
    g = _gather(tmp_path / "g", runs["a"], runs["b_fp8"])
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 2 and "from another plan" in err and "no fragment lists it" not in err, err


def _edit_fragment(folder: Path, name: str, fn) -> None:
    path = folder / name
    frag = json.loads(path.read_text())
    fn(frag)
    path.write_text(json.dumps(frag))


@pytest.mark.parametrize(
    ("edit", "found"),
    [
        (lambda f: f["files"]["model1-mp4.safetensors"].pop("sha256"), "is not a record of size and sha256"),
        (lambda f: f["files"].__setitem__("model1-mp4.safetensors", 5), "is not a record of size and sha256"),
        (lambda f: f["files"]["model1-mp4.safetensors"].__setitem__("size", "9"), "is not a record of size"),
        (lambda f: f["rank_files"].pop(), "are not the 3 rank files of one tp-3 conversion"),
        (lambda f: f["rank_files"].__setitem__(0, "../a/model0-mp4.safetensors"), "are not the output files"),
        (lambda f: f["files"].__setitem__("other.safetensors", {"size": 1, "sha256": "0"}), "files lists other"),
        (lambda f: f.pop("options"), "options is not an object"),
        (lambda f: f.__setitem__("source", "x"), "source is not an object"),
        (lambda f: f.__setitem__("plan_digest", 7), "plan_digest is not a string"),
        (lambda f: f["side_files"].__setitem__("../x.json", f["side_files"]["config.json"]), "side_files lists ../x"),
    ],
)
def test_a_malformed_fragment_is_named_by_merge_and_resume(runs, tmp_path, monkeypatch, capsys, edit, found):
    """Before: a record without sha256 merged a corrupt rank file (size-only), a record of another type was a
    traceback (merge and shard --resume), a shortened rank_files wrote a 3-rank manifest, a path in it hashed
    a file outside OUT, and a side file no share writes (a path outside OUT) recorded by one fragment merged."""
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    _edit_fragment(g, "manifest-fragment-mp4-r1_2.json", edit)
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(g), "--json")
    assert code == 2 and "manifest-fragment-mp4-r1_2.json: " in err and found in err, err
    assert json.loads(out)["exit_code"] == 2 and not (g / "manifest.json").exists()
    assert not (g / ".dsv41-convert").exists()  # no done record written before the refusal (options: after)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(runs["src"]), str(g), "--tp", "4", "--resume")
    assert code == 2 and found in err, err


def test_merge_refuses_a_safetensors_file_that_check_would_refuse(runs, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    shutil.copy(runs["a"] / "model0-mp4.safetensors", g / "model0-mp2.safetensors")
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 2 and "model0-mp2.safetensors: a .safetensors file that is not a rank file" in err, err
    assert not (g / "manifest.json").exists()
    (g / "model0-mp2.safetensors").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 0 and check_folder(g).ok, err


def test_a_manifest_of_another_conversion_is_not_reported_as_merged(runs, tmp_path, monkeypatch, capsys):
    """No fragments and a tp-2 run's manifest.json beside tp-4 rank files: before, `manifest` said "already
    merged" (exit 0) and `check` failed right after."""
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    for frag in g.glob("manifest-fragment-*.json"):
        frag.unlink()
    tp2 = tmp_path / "tp2"
    execute(build_plan(runs["src"], 2), tp2)
    shutil.copy(tp2 / "manifest.json", g / "manifest.json")
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 2 and "not the conversion it describes" in err and "model0-mp2.safetensors: missing" in err, err
    assert "model0-mp4.safetensors: in the folder but not in manifest.json" in err


def test_shares_from_different_hub_revisions_are_an_error(runs, tmp_path, monkeypatch, capsys):
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    _edit_fragment(g, "manifest-fragment-mp4-r0_3.json", lambda f: f["source"].__setitem__("revision", "a" * 40))
    _edit_fragment(g, "manifest-fragment-mp4-r1_2.json", lambda f: f["source"].__setitem__("revision", "b" * 40))
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 2 and f"converted from Hub revision {'b' * 40}" in err, err


def test_a_share_refuses_a_source_changed_since_another_share_wrote_here(tmp_path, monkeypatch, capsys):
    """Ranks 0,1 then, after one source shard changed, ranks 2,3 into the same OUT: before, the second share
    wrote manifest.json over rank files from the old bytes (exit 0, `check` ok), with or without --overwrite."""
    src = make_tiny(tmp_path / "src")
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "4", "--ranks", "0,1")
    assert code == 0, err
    shard = sorted(src.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(data)
    for extra in ([], ["--overwrite"], ["--dry-run"]):
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "4", "--ranks", "2,3", *extra)
        assert code == 2 and f"{shard.name} changed" in err and "model0-mp4.safetensors" in err, (extra, err)
    assert not (out / "manifest.json").exists() and not (out / "model2-mp4.safetensors").exists()
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "4", "--overwrite")
    assert code == 0 and check_folder(out).ok, err


def test_a_rank_file_gathered_again_names_the_earlier_merges_record(runs, tmp_path, monkeypatch, capsys):
    """A folder merged once, then a share gathered again whose fragment records other bytes for a rank file:
    the record the first merge left in .dsv41-convert/ disagrees, and the message says which one to remove."""
    g = _gather(tmp_path / "g", runs["a"], runs["b"])
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    assert code == 0, err
    shutil.copy(runs["b"] / "manifest-fragment-mp4-r1_2.json", g)  # the merge removed it: gathered again
    _edit_fragment(
        g, "manifest-fragment-mp4-r1_2.json", lambda f: f["files"]["model1-mp4.safetensors"].update(sha256="0" * 64)
    )
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(g))
    record = ".dsv41-convert/model1-mp4.safetensors.done.json"
    assert (
        code == 2 and f"model1-mp4.safetensors: {record} and manifest-fragment-mp4-r1_2.json record different" in err
    ), err
    assert (
        f"({record} is from an earlier merge or run here: if model1-mp4.safetensors was gathered again, remove" in err
    )


def test_a_rewrite_drops_this_plans_fragments_that_record_the_old_bytes(runs, tmp_path, monkeypatch, capsys):
    """Shares (or a torchrun launch) of an earlier version left their fragments beside the manifest.json the last
    one wrote (now removed with it, but such folders exist); a later
    run that rewrote the files (--overwrite from another copy of one layout: one plan digest) removed the
    manifest but kept the fragments, whose records were the old bytes: `manifest OUT` then refused the
    consistent folder (exit 2), blaming the new done record as an earlier merge's. They go with the rewrite."""
    out = tmp_path / "out"
    execute(build_plan(runs["src"], 4), out, ranks=[0, 3])
    execute(build_plan(runs["src"], 4), out, ranks=[1, 2])
    shutil.copy(runs["a"] / "manifest-fragment-mp4-r0_3.json", out)  # as an earlier version left it
    assert (out / "manifest.json").is_file() and (out / "manifest-fragment-mp4-r0_3.json").is_file()
    other = make_tiny(tmp_path / "other", seed=1)  # the same layout, other weights
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(other), str(out), "--tp", "4", "--overwrite")
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(out))
    assert code == 0, err
    files = json.loads((out / "manifest.json").read_text())["files"]
    for r in range(4):
        name = f"model{r}-mp4.safetensors"
        assert files[name]["sha256"] == _sha256(out / name), name


def test_a_share_with_other_options_is_refused_and_the_first_share_kept(tmp_path, monkeypatch, capsys):
    """Rank 0 with the default options, then rank 1 with --expert-dtype fp8 into the same OUT: exit 0, rank 0's
    fragment removed and its config.json replaced by the fp8 one, and `manifest` could not say what went
    missing (an audit). Refused now, the first share's files untouched; --overwrite of every rank still
    replaces the lot."""
    src = make_tiny(tmp_path / "src")
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--ranks", "0")
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "manifest-fragment-mp2-r0.json" in before
    for extra in ([], ["--dry-run"], ["--resume"]):
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--ranks", "1",
                               "--expert-dtype", "fp8", *extra)  # fmt: skip
        assert code == 2 and "holds a share of another plan (manifest-fragment-mp2-r0.json" in err, (extra, err)
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before, extra
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--ranks", "1")
    assert code == 0 and check_folder(out).ok, err  # the same options: the two shares make the manifest
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--expert-dtype", "fp8",
                           "--overwrite")  # fmt: skip
    assert code == 0 and check_folder(out).ok, err


@pytest.mark.parametrize("command", ["shard", "export"])
def test_one_torchrun_process_run_again_with_other_options_leaves_no_mix(runs, tmp_path, monkeypatch, capsys, command):
    """`RANK=1 WORLD_SIZE=2 shard ... --expert-dtype fp8 --overwrite` (one process of a launch run again, by
    hand or by a scheduler's retry) into a finished conversion: exit 0 with ranks 1, 3 fp8 beside 0, 2 fp4 and
    rank 0's fragment removed; export the same with bf16 and fp8 shards (an audit). Each process of a torchrun
    --overwrite now removes the replaced conversion's files of every rank: alone, it leaves its new files and
    no old ones (no manifest); the other process then completes the new conversion (a whole launch: both)."""
    from safetensors import safe_open

    out = tmp_path / "out"
    first = ["--tp", "4"] if command == "shard" else ["--format", "bf16"]
    other = ["--tp", "4", "--expert-dtype", "fp8"] if command == "shard" else ["--format", "fp8"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert run_cli(monkeypatch, capsys, command, str(runs["src"]), str(out), *first)[0] == 0
    old = {p.name: p.read_bytes() for p in out.glob("model*.safetensors")}
    monkeypatch.setenv("RANK", "1")
    code, _, err = run_cli(monkeypatch, capsys, command, str(runs["src"]), str(out), *other, "--overwrite")
    assert code == 0, err
    left = {p.name: p.read_bytes() for p in out.glob("model*.safetensors")}
    assert left and not any(old.get(name) == data for name, data in left.items())  # no file of the old conversion
    assert not (out / "manifest.json").exists()
    dtypes = set()
    for path in out.glob("model*.safetensors"):
        with safe_open(str(path), "pt") as f:
            dtypes |= {str(f.get_slice(k).get_dtype()) for k in f.keys() if ".experts." in k and k.endswith("weight")}
    assert dtypes and "F4" not in dtypes and "BF16" not in dtypes, dtypes  # experts: the new format only
    monkeypatch.setenv("RANK", "0")
    code, _, err = run_cli(monkeypatch, capsys, command, str(runs["src"]), str(out), *other, "--overwrite")
    assert code == 0, err
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert check_folder(out).ok


@pytest.mark.parametrize("order", [("0", "1"), ("1", "0")])
def test_a_torchrun_overwrite_launch_from_another_copy_of_the_layout_replaces_the_conversion(
    runs, tmp_path, monkeypatch, capsys, order
):
    """README: each process of a torchrun launch with --overwrite removes the replaced conversion's rank files
    and the whole launch replaces it. Its processes here run one after the other (a launch whose other process
    starts late): the first refused the folder (exit 2, and torchrun stopped its peer), because the peer's files
    were finished from the first source, whose done records said only the plan, which both sources share. Its
    dry run says what the run does."""
    other = make_tiny(tmp_path / "other", seed=1)  # the same layout (plan digest), other weights
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert run_cli(monkeypatch, capsys, "shard", str(runs["src"]), str(out), "--tp", "4")[0] == 0
    monkeypatch.setenv("RANK", order[0])
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(other), str(out), "--tp", "4", "--overwrite", "--dry-run")
    assert code == 0, err
    for rank in order:
        monkeypatch.setenv("RANK", rank)
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(other), str(out), "--tp", "4", "--overwrite")
        assert code == 0, err
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    execute(build_plan(other, 4), fresh)
    assert check_folder(out).ok
    for r in range(4):
        name = f"model{r}-mp4.safetensors"
        assert _sha256(out / name) == _sha256(fresh / name), name


# --- a finished folder holds manifest.json and no fragment: `manifest OUT`, `check` and `--resume` agree on it


def _fragments(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("manifest-fragment-*.json"))


@pytest.mark.parametrize("how", ["torchrun", "ranks"])
def test_shares_finishing_in_one_folder_leave_no_fragment(runs, tmp_path, monkeypatch, capsys, how):
    """A single-host torchrun launch (or --ranks shares into one folder): the share that finished first left
    its fragment beside the manifest.json the last one wrote, and said "gather all ranks, then `dsv41-convert
    manifest OUT`" where nothing was left to gather. The last share removes the fragments its manifest
    supersedes; the first still leaves its own while the others run (what a gathering needs)."""
    out = tmp_path / "out"
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for share, ranks in ((1, "1,3"), (0, "0,2")):
        args = ["shard", str(runs["src"]), str(out), "--tp", "4"]
        if how == "torchrun":
            monkeypatch.setenv("WORLD_SIZE", "2")
            monkeypatch.setenv("RANK", str(share))
            monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        else:
            args += ["--ranks", ranks]
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, err
        if share == 1:
            assert _fragments(out) == ["manifest-fragment-mp4-r1_3.json"]
    assert (out / "manifest.json").read_bytes() == (runs["full"] / "manifest.json").read_bytes()
    assert _fragments(out) == [], "a fragment left beside the finished manifest"
    for name in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


def test_a_share_finishing_while_another_writes_its_fragment_leaves_none(runs, tmp_path, monkeypatch, capsys):
    """Two shares ending at once: share "1,3" finds its own files done and not the others', and before it writes
    its fragment, share "0,2" finishes the set (manifest.json, no fragment to remove yet). The fragment written
    after that stayed beside the manifest; the share looks again once it is written, finds the set complete and
    finishes the folder itself."""
    from dsv41_convert.convert import execute as execute_module

    out = tmp_path / "out"
    real = execute_module.write_fragment
    other_share = [sys.executable, "-m", "dsv41_convert.cli", "shard", str(runs["src"]), str(out), "--tp", "4",
                   "--ranks", "0,2"]  # fmt: skip

    def the_other_share_ends_first(*args, **kwargs):
        done = subprocess.run(other_share, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert (out / "manifest.json").exists() and _fragments(out) == []
        return real(*args, **kwargs)

    monkeypatch.setattr(execute_module, "write_fragment", the_other_share_ends_first)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(runs["src"]), str(out), "--tp", "4", "--ranks", "1,3")
    assert code == 0, err
    assert (out / "manifest.json").read_bytes() == (runs["full"] / "manifest.json").read_bytes()
    assert _fragments(out) == [], "a fragment left beside the finished manifest"


def _without_tokenizer(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    (dest / "tokenizer.json").unlink()
    return dest


def test_a_resume_of_gathered_shares_leaves_no_fragment(runs, tmp_path, monkeypatch, capsys):
    """Shares converted on two hosts from a source without tokenizer.json, gathered; the tokenizer put into
    SRC, then `shard --resume` copies it and writes manifest.json listing it, but left the fragments:
    `manifest OUT` then refused the folder ("tokenizer.json: no fragment records it") that `check` passed.
    The resume removes the fragments once its manifest is written."""
    src = _without_tokenizer(runs["src"], tmp_path / "src")
    plan = build_plan(src, 4)
    for ranks in ([0, 3], [1, 2]):
        execute(plan, tmp_path / f"host{ranks[0]}", ranks=ranks)
    g = _gather(tmp_path / "g", tmp_path / "host0", tmp_path / "host1")
    shutil.copy(runs["src"] / "tokenizer.json", src / "tokenizer.json")
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(g), "--tp", "4", "--resume")
    assert code == 0, err
    assert "tokenizer.json" in _files(g) and _fragments(g) == []
    assert run_cli(monkeypatch, capsys, "check", str(g))[0] == 0
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(g), "--json")
    assert code == 0 and json.loads(out)["already_merged"], err


def test_manifest_beside_fragments_it_supersedes(runs, tmp_path, monkeypatch, capsys):
    """A fragment left beside a complete manifest.json (a run of an earlier version, or one killed between
    its manifest and the fragments' removal): `manifest OUT` merged the fragments again, and refused the
    folder when the manifest listed a side file they did not (a tokenizer copied in by the resume that
    finished it) while `check` passed. The manifest supersedes them: reported as written, checked as `check`
    does, the fragments removed; `--resume` removes them too."""
    src = _without_tokenizer(runs["src"], tmp_path / "src")
    for ranks in ([0, 3], [1, 2]):
        execute(build_plan(src, 4), tmp_path / f"host{ranks[0]}", ranks=ranks)
    for how in ("manifest", "shard --resume"):
        out = tmp_path / how.replace(" ", "_")
        shutil.copytree(runs["full"], out)  # tokenizer.json listed
        for host in ("host0", "host1"):
            for frag in (tmp_path / host).glob("manifest-fragment-*.json"):
                shutil.copy(frag, out)
        before = (out / "manifest.json").read_bytes()
        assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0
        args = ["manifest", str(out)] if how == "manifest" else ["shard", str(runs["src"]), str(out), "--tp", "4",
                                                                  "--resume"]  # fmt: skip
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, (how, err)
        assert _fragments(out) == [] and (out / "manifest.json").read_bytes() == before, how
        assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


@pytest.mark.parametrize("how", ["torchrun", "ranks"])
def test_the_first_share_says_who_finishes_the_folder(runs, tmp_path, monkeypatch, capsys, how):
    """The first process of a single-host torchrun launch said "gather all ranks, then `dsv41-convert manifest
    OUT`", though the last process writes manifest.json into the same OUT: it now says so; a --ranks share
    (its peers may run on other machines) names both ways."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = ["shard", str(runs["src"]), str(tmp_path / "out"), "--tp", "4"]
    if how == "torchrun":
        for name, value in (("WORLD_SIZE", "2"), ("RANK", "1"), ("LOCAL_WORLD_SIZE", "2")):
            monkeypatch.setenv(name, value)
    else:
        args += ["--ranks", "1,3"]
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "fragment: " in err and "gather all ranks" not in err, err
    if how == "torchrun":
        assert "the process of this launch that finishes last writes manifest.json and removes it" in err, err
        assert "dsv41-convert manifest OUT" not in err, err
    else:
        assert "in one folder, the share that finishes last writes manifest.json and removes it" in err, err
        assert "gathered from several machines, `dsv41-convert manifest OUT` does" in err, err


@pytest.mark.parametrize("found", ["no-manifest", "no-folder", "not-json"])
def test_a_folder_check_refuses_is_said_before_any_progress(tmp_path, monkeypatch, capsys, found):
    """`check OUT` of a folder without a manifest.json printed the progress display's title (`check OUT`) and an
    empty line before `error: OUT/manifest.json: not found`, as if the check had started; so did a folder that
    does not exist and a manifest that is no JSON. The refusal is now the first thing said."""
    out = (tmp_path / "out").resolve()
    if found != "no-folder":
        out.mkdir()
    if found == "not-json":
        (out / "manifest.json").write_text("{")
    said = {"no-manifest": f"{out}/manifest.json: not found", "no-folder": f"{out}: no such folder",
            "not-json": f"{out}/manifest.json: not readable JSON"}[found]  # fmt: skip
    code, stdout, err = run_cli(monkeypatch, capsys, "check", str(out))
    assert code == 2 and err.startswith(f"error: {said}") and stdout == "", err


@pytest.mark.parametrize("found", ["no-fragments", "no-folder", "held"])
def test_a_folder_manifest_refuses_is_said_before_any_progress(runs, tmp_path, monkeypatch, capsys, found):
    """`manifest OUT` of a folder without fragments printed the progress display's title (`manifest OUT`) and an
    empty line before `error: OUT: no manifest-fragment-*.json files`, as if the merge had started; so did a
    folder that does not exist, and one another run holds. The refusal is now the first thing said."""
    from dsv41_convert.store.lock import hold

    out = (tmp_path / "out").resolve()
    held = contextlib.nullcontext()
    if found == "no-fragments":
        out.mkdir()
        said = f"{out}: no manifest-fragment-*.json files"
    elif found == "no-folder":
        said = f"{out}: no such folder"
    else:
        _gather(out, runs["a"], runs["b"])
        said, held = f"{out}: in use by pid {os.getpid()}", hold(out)
    with held:
        code, stdout, err = run_cli(monkeypatch, capsys, "manifest", str(out))
    assert code == 2 and err.startswith(f"error: {said}") and stdout == "", err
