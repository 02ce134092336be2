"""`reference-logits SRC OUT`: OUT is replaced only with --overwrite, never written inside SRC, never a folder;
each refusal exits 2 naming OUT before any compute and leaves everything as it was. The same run writes
the same bytes (the metadata's key order is fixed: store.safetensors_header.sort_metadata)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_cli, run_cli_with_a_signal_in_an_import

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.store import manifest
from dsv41_convert.verify import reffile


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """The tiny preset as `make-tiny` writes it (a real tokenizer, so the default prompts)."""
    out = tmp_path_factory.mktemp("src") / "src"
    subprocess.run([sys.executable, "-m", "dsv41_convert.cli", "make-tiny", str(out)], check=True, capture_output=True)
    return out


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in sorted(folder.rglob("*"))}


def _compute_fails(*_args, **_kwargs):
    raise AssertionError("the refusal must come before the compute")


def test_existing_out_is_kept_without_overwrite_and_replaced_with_it(src, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ref.safetensors"
    once = ("--decode-steps", "1")
    assert run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), *once)[0] == 0
    first = out.read_bytes()
    with monkeypatch.context() as m:
        m.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
        out.write_bytes(b"precious")
        code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out))
    assert code == 2 and f"error: {out.resolve()}: exists; pass --overwrite to replace it" in err
    assert out.read_bytes() == b"precious"
    code, _, err = run_cli(
        monkeypatch, capsys, "reference-logits", str(src), str(out), *once, "--overwrite", "--as-converted"
    )
    assert code == 0 and out.read_bytes() == first  # and the same run, the same bytes (--as-converted: no-op)
    assert "--as-converted changes nothing here: an fp8 source" in err
    assert len(reffile.load(out, 128).runs) > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.safetensors"]


def test_a_users_file_at_the_old_temporarys_name_is_kept(src, tmp_path, monkeypatch, capsys):
    """The reference file went through OUT.partial, a name a user's file may have: it was replaced and renamed
    away (an audit). The temporary is the process's own (OUT.PID.partial), as atomic_write's; one a run that
    died while saving left is removed."""
    out = tmp_path / "ref.safetensors"
    (tmp_path / "ref.safetensors.partial").write_bytes(b"precious")
    (tmp_path / "ref.safetensors.4242.partial").write_bytes(b"a run that died while saving")
    assert run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--decode-steps", "1")[0] == 0
    assert (tmp_path / "ref.safetensors.partial").read_bytes() == b"precious" and out.stat().st_size > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref.safetensors", "ref.safetensors.partial"]


def test_a_name_near_the_longest_a_folder_takes_is_written(src, tmp_path, monkeypatch, capsys):
    """A name of 252 bytes (a file name may have 255) was computed, then refused at the save: its temporary
    NAME.PID.partial was too long ("...safetensors.27654.partial: File name too long", exit 2, after the whole
    compute). The temporary's name is cut to fit; one of a run that died while saving is still removed."""
    out = tmp_path / ("r" * 240 + ".safetensors")
    once = ("reference-logits", str(src), str(out), "--decode-steps", "1")
    code, _, err = run_cli(monkeypatch, capsys, *once)
    assert code == 0, err
    assert len(reffile.load(out, 128).runs) > 0
    mine = manifest.temporary_of(out).name
    assert len(mine) <= 255 and str(os.getpid()) in mine
    stale = tmp_path / mine.replace(f".{os.getpid()}.", ".4242.")
    stale.write_bytes(b"a run that died while saving")
    assert run_cli(monkeypatch, capsys, *once, "--overwrite")[0] == 0
    assert [p.name for p in tmp_path.iterdir()] == [out.name]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, VerifyInputError])
def test_a_run_that_saves_nothing_leaves_no_folder_it_made(src, tmp_path, monkeypatch, capsys, stop):
    """README: an output folder a run made, and the folders it made above it, left empty by a run stopped
    before its first byte, is removed again. reference-logits into new/sub/ref.safetensors, stopped in the
    compute (Ctrl-C; an input error such as non-finite outputs, "nothing written"), left new/sub/ behind."""

    def compute_stops(*_args, **_kwargs):
        raise stop("stopped in the compute")

    monkeypatch.setattr("dsv41_convert.verify.reference.compute_reference_ranks", compute_stops)
    out = tmp_path / "new" / "sub" / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out))
    assert code == (130 if stop is KeyboardInterrupt else 2), err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()  # a folder that was there stays, and so does the lock's absence
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(tmp_path / "kept" / "r.st"))
    assert code in (2, 130) and [p.name for p in tmp_path.iterdir()] == ["kept"]
    assert list((tmp_path / "kept").iterdir()) == []


@pytest.mark.parametrize("where", ["ref.safetensors", "new/sub/ref.safetensors"])
def test_out_inside_the_source_is_refused_and_nothing_is_created(src, where, monkeypatch, capsys):
    before = _listing(src)
    monkeypatch.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
    out = src / where
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--overwrite")
    said = f"error: {out.resolve()}: the output file is the source folder {src.resolve()} or inside it"
    assert code == 2 and said in err
    assert _listing(src) == before


def test_out_that_is_a_folder_is_refused(src, tmp_path, monkeypatch, capsys):
    out = tmp_path / "refs"
    out.mkdir()
    monkeypatch.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--overwrite")
    assert code == 2 and f"error: {out.resolve()}: is a folder" in err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("overwrite", [(), ("--overwrite",)])
def test_out_that_is_a_fifo_is_refused_and_kept(src, tmp_path, monkeypatch, capsys, overwrite):
    """OUT a FIFO (or a socket or a device: `reference-logits SRC /dev/null`): the run computed, then renamed the
    reference over it, so the FIFO became a regular file (as root, /dev/null did: a helper's hunt), and without
    --overwrite it said "exists; pass --overwrite to replace it". Refused before any compute, either way."""
    out = tmp_path / "ref.safetensors"
    os.mkfifo(out)
    monkeypatch.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), *overwrite)
    assert code == 2 and f"error: {out.resolve()}: not a regular file (a FIFO, a socket or a device)" in err, err
    assert stat.S_ISFIFO(out.stat().st_mode) and [p.name for p in tmp_path.iterdir()] == ["ref.safetensors"]


def test_out_that_is_an_input_of_the_run_is_refused_and_kept(src, tmp_path, monkeypatch, capsys):
    """OUT the --prompts file, or the image a prompt names: with --overwrite the reference replaced it (exit 0), and
    an image so replaced left a reference recording a sha256 no image matches any more, which verify refuses for
    good (a helper's hunt). Refused before any compute, the input kept."""
    from PIL import Image

    Image.new("RGB", (64, 48), (90, 40, 200)).save(tmp_path / "a.png")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "look", "image": "a.png"}\n')
    kept = _listing(tmp_path)
    monkeypatch.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
    for out, what in ((prompts, "the --prompts file"), (tmp_path / "a.png", f"the image of {prompts}:1")):
        code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--prompts", str(prompts),
                               "--overwrite")  # fmt: skip
        assert code == 2 and f"{out}: is {what} (" in err and "which this run reads; choose another OUT" in err, err
        assert _listing(tmp_path) == kept


def test_out_under_a_file_is_refused_naming_the_file(src, tmp_path, monkeypatch, capsys):
    """`reference-logits SRC afile/r.safetensors`: "afile: File exists" (mkdir's words; an audit), as make-tiny
    says it now for both."""
    (tmp_path / "afile").write_text("mine")
    monkeypatch.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
    for command in (["reference-logits", str(src), str(tmp_path / "afile" / "r.safetensors")],
                    ["make-tiny", str(tmp_path / "afile" / "t")]):  # fmt: skip
        code, _, err = run_cli(monkeypatch, capsys, *command)
        assert code == 2 and f"{tmp_path / 'afile'}: Not a directory, so {command[-1]} cannot be made in it" in err
    assert (tmp_path / "afile").read_text() == "mine"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "dir")  # "dangling: File exists" (a review)
    for command in (["reference-logits", str(src), str(tmp_path / "dangling" / "r.safetensors")],
                    ["make-tiny", str(tmp_path / "dangling" / "t")]):  # fmt: skip
        code, _, err = run_cli(monkeypatch, capsys, *command)
        said = f"{tmp_path / 'dangling'}: a link to {tmp_path / 'nowhere' / 'dir'}, which does not exist, so"
        assert code == 2 and said in err, err
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("fails", ["fsync", "rename"])
def test_a_disk_that_fails_at_the_fsync_or_the_rename_leaves_nothing(src, tmp_path, monkeypatch, capsys, fails):
    """ENOSPC and EIO that a file system reports only at the fsync (ext4's delayed allocation, NFS) or at the
    rename: `error: Input/output error` without a path, and OUT.PID.partial left (an audit). Now OUT is named
    and nothing is left, nor the folder made for it."""
    import errno
    import os

    out = tmp_path / "refs" / "r.safetensors"
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        if fails == "fsync" and os.readlink(f"/proc/self/fd/{fd}").endswith(".partial"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_fsync(fd)

    def replace(a, b, **kw):
        if fails == "rename" and str(a).endswith(".partial"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(a), None, str(b))
        return real_replace(a, b, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--decode-steps", "0")
    assert code == 2 and f"{out}: cannot write the reference file (Input/output error); nothing written" in err, err
    assert not out.parent.exists()  # the folder the run made for OUT went with the rest


def test_an_image_that_is_no_image_is_named_by_file_and_line(src, tmp_path, monkeypatch, capsys):
    """It said `line-1: image ...: cannot identify image file <_io.BytesIO object at 0x...>`."""
    (tmp_path / "notes.txt").write_text("not a picture")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "hello"}\n{"text": "look", "image": "notes.txt"}\n')
    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--prompts", str(prompts))
    assert code == 2 and f"{prompts}:2: image {tmp_path / 'notes.txt'}: not an image PIL can read" in err, err
    assert "BytesIO" not in err and not out.exists()


def test_no_image_prompt_for_a_vision_tower_is_warned_before_the_compute(src, tmp_path, monkeypatch, capsys):
    """The default prompts are text: verify against the file never checks what the vision tower computes (it
    reports `unreached`); said here too, before the compute, while the prompts can still change. Where the
    file records the weights' digests (an fp8 source) verify compares the tower's bytes and fails a changed one
    (test_verify_matrix.py::test_vision_prompt_passes_by_replay_and_a_vision_fault_fails): the warning said
    `cannot check it` there too."""
    out = tmp_path / "ref.safetensors"
    for json_flag in ([], ["--json"]):  # with --json too: on stderr, beside the document (it said nothing)
        with monkeypatch.context() as m:
            m.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
            with pytest.raises(AssertionError, match="before the compute"):
                run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), *json_flag)
        err = capsys.readouterr().err
        assert (
            f"warning: no prompt runs it, so verify against {out} compares only its weights' bytes, not what it "
            "computes: vision tower and aligner" in err
        )
        assert "cannot check it" not in err
    with monkeypatch.context() as m:  # no digests recorded: verify then reports it `not checked`
        m.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
        with pytest.raises(AssertionError, match="before the compute"):
            run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--no-weight-digests")
    err = capsys.readouterr().err
    assert f"warning: no prompt runs it, so verify against {out} cannot check it: vision tower and aligner" in err
    # --stream-layers: of the fp8 source it records the digests; of a folder of rank files (their tp-1 replay) none
    mp1 = tmp_path / "mp1"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(mp1), "--tp", "1")[0] == 0
    for folder, said in ((src, "compares only its weights' bytes"), (mp1, "cannot check it")):
        with monkeypatch.context() as m:
            m.setattr("dsv41_convert.verify.streamed.compute_streamed_reference", _compute_fails)
            with pytest.raises(AssertionError, match="before the compute"):
                run_cli(monkeypatch, capsys, "reference-logits", str(folder), str(out), "--stream-layers")
        err = capsys.readouterr().err
        assert f"warning: no prompt runs it, so verify against {out} {said}" in " ".join(err.split()), (folder, err)
    from PIL import Image

    Image.new("RGB", (64, 48), (90, 40, 200)).save(tmp_path / "a.png")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "look", "image": "a.png"}\n')
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--prompts", str(prompts),
                           "--decode-steps", "1")  # fmt: skip
    assert code == 0 and "no prompt runs it" not in err, err


def test_sigterm_during_an_import_stops_the_run_and_writes_nothing(src, tmp_path):
    """Before: a SIGTERM in the first second (torch's import) could be swallowed, and the run computed,
    wrote OUT and exited 0 (4 of 40 tries on the dev box), or aborted (exit 134)."""
    out = tmp_path / "ref.safetensors"
    args = ("reference-logits", str(src), str(out), "--decode-steps", "1")
    run = run_cli_with_a_signal_in_an_import("dsv41_convert.verify.reference", *args)
    assert run.returncode == 143, run.stderr
    assert "terminated (SIGTERM)" in run.stderr and "Traceback" not in run.stderr
    assert list(tmp_path.iterdir()) == []


def _plant(src: Path, copy: Path, name: str, plant) -> Path:
    """A copy of `src` with tensor `name` changed by `plant(tensor) -> tensor`; -> the file that holds it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, copy)
    path = copy / json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(path))
    tensors[name] = plant(tensors[name])
    save_file(tensors, str(path), {"format": "pt"})
    return path


def test_a_non_finite_source_tensor_is_named_with_its_file(src, tmp_path, monkeypatch, capsys):
    """reference-logits named a NaN by tensor only ("rank 0: rank 1: layers.1.ffn.experts.12.w1.weight: found
    nan", and "...: scale is NaN" of an fp8 source), where shard names the file too (an audit): both paths
    (the ranks' plan_state, the streamed SourceWeights) name the file and the tensor, one rank (none at tp 1:
    "rank 0:" named the only one), nothing written."""
    import torch

    bf16 = tmp_path / "bf16"
    subprocess.run([sys.executable, "-m", "dsv41_convert.cli", "make-tiny", str(bf16), "--source-dtype", "bf16",
                    "--no-vision"], check=True, capture_output=True)  # fmt: skip
    name = "layers.1.ffn.experts.12.w1.weight"  # an expert on rank 1 of 2

    def nan(t):
        t = t.clone()
        t[3, 5] = float("nan")
        return t

    path = _plant(bf16, tmp_path / "nan", name, nan)
    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(path.parent), str(out), "--tp", "2",
                           "--as-converted", "--decode-steps", "1")  # fmt: skip
    assert code == 2 and f"error: rank 1: {path}: {name}: found nan at index [3, 5]" in err, err
    assert not out.exists()
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(path.parent), str(out), "--as-converted",
                           "--decode-steps", "1")  # fmt: skip
    assert code == 2 and f"error: {path}: {name}: found nan at index [3, 5]" in err, err  # one rank: none named
    assert not out.exists()
    scale = "layers.1.ffn.experts.7.w1.scale"
    path = _plant(src, tmp_path / "nan-scale", scale, lambda t: torch.full_like(t.view(torch.uint8), 255).view(t.dtype))
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(path.parent), str(out), "--stream-layers",
                           "--decode-steps", "1")  # fmt: skip
    assert code == 2 and f"{path}: {scale}: found nan at index [0, 0] in F8_E8M0" in err, err  # as shard says it
    assert not out.exists()


def test_a_non_finite_byte_in_a_ranks_rows_is_said_at_its_source_index(src, tmp_path, monkeypatch, capsys):
    """A NaN scale in rank 1's rows of wo_a (scale rows 4..7 of 8 at tp 2): reference-logits said "[1, 1]"
    with no rows named, read as a source index, where shard says "(source rows 128..255) ... [5, 1]" (an
    audit). The ranks' in-memory files name the region and count the index as shard does."""
    import torch

    scale = "layers.0.attn.wo_a.scale"

    def nan(t):
        t = t.view(torch.uint8).clone()
        t[5, 0] = 255
        return t.view(torch.float8_e8m0fnu)

    path = _plant(src, tmp_path / "nan", scale, nan)
    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(path.parent), str(out), "--tp", "2",
                           "--decode-steps", "1")  # fmt: skip
    want = f"{path}: layers.0.attn.wo_a.weight (source rows 128..255): scale is NaN (e8m0 byte 255) at [5, 0]"
    assert code == 2 and want in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "at", "byte", "said"),
    [
        ("layers.0.attn_norm.weight", (0,), 0x7FC0, "found nan at index [0] in BF16"),  # every prompt reads it
        ("layers.1.engram.embed.scale", (3, 0), 0xFF, "found nan at index [3, 0] in F8_E8M0"),  # a row none reads
    ],
)
@pytest.mark.parametrize("run", ["verify", "reference-logits", "reference-logits --stream-layers"])
def test_a_nan_copied_unchanged_from_the_source_is_refused_as_shard_refuses_it(
    src, tmp_path, monkeypatch, capsys, name, at, byte, said, run
):
    """A NaN in a tensor taken unchanged (a norm, an Engram table's scale): shard refuses it naming the file;
    `verify --reference SRC` ran the reference on it and FAILed the correct rank files (exit 1, "layers.0.attn
    ... max |diff| nan"), reference-logits wrote a file (exit 0) where no prompt reached the row, its weights
    record holding the NaN's digest (an audit)."""
    import torch

    conv = tmp_path / "mp2"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")[0] == 0

    def nan(t):
        t = t.clone()
        t.view(torch.uint16 if t.element_size() == 2 else torch.uint8)[at] = byte
        return t

    path = _plant(src, tmp_path / "nan", name, nan)
    assert run_cli(monkeypatch, capsys, "shard", str(path.parent), str(tmp_path / "x"), "--tp", "2")[0] == 2
    out = tmp_path / "ref.safetensors"
    args = ["verify", str(conv), "--reference", str(path.parent)] if run == "verify" else [
        "reference-logits", str(path.parent), str(out), *run.split()[1:]]  # fmt: skip
    code, _, err = run_cli(monkeypatch, capsys, *args, "--decode-steps", "1")
    assert code == 2 and f"{path.name}: {name}: {said}" in err, err
    assert not out.exists()


def test_a_torchrun_count_other_than_tp_is_refused_before_out_is_made(src, tmp_path, monkeypatch, capsys):
    """torchrun of 2 processes with --tp 4 was refused only inside the launch, after OUT's folder was made
    (an empty sub/ left: an audit), and the warnings came before the refusal."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "sub" / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--tp", "4")
    assert code == 2 and "torchrun started 2 ranks but --tp is 4" in err and "warning" not in err, err
    assert not (tmp_path / "sub").exists()


def test_a_reference_kept_in_the_converted_folder_does_not_fail_verify(src, tmp_path, monkeypatch, capsys):
    """`reference-logits SRC MP2/ref.safetensors`, then `verify MP2 --reference-logits MP2/ref.safetensors`: FAIL
    (exit 1) on a correct set, "ref.safetensors: in the folder but not in manifest.json" (an audit). verify
    leaves its own reference file out of the manifest check; reference-logits warns that `check` will not."""
    out = tmp_path / "mp2"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2")[0] == 0
    ref = out / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(ref), "--decode-steps", "1")
    assert code == 0 and "holds a manifest.json (a converted folder?)" in err, err
    code, said, err = run_cli(monkeypatch, capsys, "verify", str(out), "--reference-logits", str(ref), "--threads", "1")
    assert code == 0 and "PASS" in said, err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 1  # check knows of no reference: it names it
    elsewhere = tmp_path / "ref-elsewhere.safetensors"  # kept as a link there: where it lies decides
    ref.rename(elsewhere)
    ref.symlink_to(elsewhere)
    code, said, err = run_cli(monkeypatch, capsys, "verify", str(out), "--reference-logits", str(ref), "--threads", "1")
    assert code == 0 and "PASS" in said, err


def test_a_converted_file_is_not_replaced_by_a_reference(src, tmp_path, monkeypatch, capsys):
    """`reference-logits SRC MP2/model0-mp2.safetensors --overwrite` replaced the rank file with the reference, exit 0,
    warning that `check` would name it as a file the manifest does not list (it lists it): check and verify then
    failed the conversion (a helper's hunt). A file the manifest lists is refused before the compute, kept as it was."""
    out = tmp_path / "mp2"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2")[0] == 0
    before = _listing(out)
    monkeypatch.setattr("dsv41_convert.verify.reference.compute_reference_ranks", _compute_fails)
    for name in ("model0-mp2.safetensors", "config.json"):
        code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out / name), "--overwrite")
        assert code == 2 and f"{out / name}: a file of the conversion in {out} (its manifest.json lists it)" in err, err
    assert _listing(out) == before
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0


def test_a_changed_weight_no_prompt_runs_is_named_not_the_manifest(src, tmp_path, monkeypatch, capsys):
    """A byte of a vision weight changed (no prompt has an image): the note named the tensor and its bytes; a
    mend for a manifest-only failure put the manifest's sha256 line there instead (a review). The manifest's
    note is for a failure of the manifest alone."""
    import json

    from dsv41_convert.store.safetensors_header import read_header

    conv = tmp_path / "mp1"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "1")[0] == 0
    path, name = conv / "model0-mp1.safetensors", "vision.blocks.0.attn.wo.weight"
    at = read_header(path).tensors[name].begin + 5
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    code, out, _ = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference", str(src), "--decode-steps", "1",
                           "--json")  # fmt: skip
    note = json.loads(out)["localization"]["note"]
    assert code == 1 and note.startswith(f"{name} on rank 0: 1 of ") and "no prompt's output differs" in note, note


@pytest.mark.parametrize("run", ["verify", "reference-logits", "reference-logits --stream-layers"])
def test_a_window_no_memory_can_hold_is_refused_naming_the_config(src, tmp_path, monkeypatch, capsys, run):
    """A config whose sliding_window is 10**12 rows loaded (a positive int) and ended reference-logits and
    verify --reference SRC in the allocator's traceback ("DefaultCPUAllocator: can't allocate memory ...
    128000000000000 bytes", exit 1; an audit). The model's caches are sized before they are allocated:
    exit 2 naming the file and the key, nothing written."""
    import json
    import shutil

    huge = tmp_path / "huge"
    shutil.copytree(src, huge)
    config = json.loads((huge / "config.json").read_text())
    config["text_config"]["sliding_window"] = 10**12
    (huge / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ref.safetensors"
    if run == "verify":
        conv = tmp_path / "mp2"
        assert run_cli(monkeypatch, capsys, "shard", str(huge), str(conv), "--tp", "2")[0] == 0  # no model built
        args = ["verify", str(conv), "--reference", str(huge)]
    else:
        args = ["reference-logits", str(huge), str(out), *run.split()[1:]]
    code, _, err = run_cli(monkeypatch, capsys, *args, "--decode-steps", "1")
    said = f"{huge / 'config.json'}: the model's caches need"
    assert code == 2 and said in err and "text_config.sliding_window = 1000000000000" in err, err
    assert not out.exists()


def test_a_digest_flag_given_that_records_nothing_is_warned(src, tmp_path, monkeypatch, capsys):
    """--weight-digests given for a bf16 source without --as-converted, or --fp8-expert-digests given with
    --no-weight-digests, recorded nothing without a word, and verify later said "weights: not recorded" (an
    audit). Given so, each is warned; taken as the default, nothing is said."""
    out = tmp_path / "ref.safetensors"
    run = ["reference-logits", str(src), str(out), "--decode-steps", "1", "--overwrite"]
    code, _, err = run_cli(monkeypatch, capsys, *run, "--no-weight-digests", "--fp8-expert-digests")
    assert code == 0 and "warning: --fp8-expert-digests: nothing recorded (they are of fp4 routed experts" in err, err
    assert "--weight-digests: nothing" not in err
    for flags in ([], ["--weight-digests", "--fp8-expert-digests"]):  # recorded: nothing to say
        code, _, err = run_cli(monkeypatch, capsys, *run, *flags)
        assert code == 0 and "nothing recorded" not in err, err
    bf16 = tmp_path / "bf16"
    subprocess.run([sys.executable, "-m", "dsv41_convert.cli", "make-tiny", str(bf16), "--source-dtype", "bf16"],
                   check=True, capture_output=True)  # fmt: skip
    run[1] = str(bf16)
    code, _, err = run_cli(monkeypatch, capsys, *run, "--weight-digests")
    assert code == 0 and "warning: --weight-digests: nothing recorded (they are of converted weights" in err, err
    code, _, err = run_cli(monkeypatch, capsys, *run)
    assert code == 0 and "nothing recorded" not in err, err


def test_a_torchrun_process_that_saves_nothing_leaves_no_folder(src, tmp_path, monkeypatch, capsys):
    """README: a folder a run made and leaves empty, stopped before its first byte, is removed again. Under torchrun
    the processes other than rank 0, which never write OUT, made its folder too (mkdir -p), so a launch stopped in
    the compute (SIGTERM from a scheduler, Ctrl-C) left new/sub/ behind, empty: rank 0 found it there and kept it as
    not its own (a helper's hunt, two processes by hand). Only the process that saves makes OUT's folder."""

    def compute_stops(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("dsv41_convert.verify.reference.compute_reference_ranks", compute_stops)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    out = tmp_path / "new" / "sub" / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--tp", "2")
    assert code == 130, err
    assert list(tmp_path.iterdir()) == []
