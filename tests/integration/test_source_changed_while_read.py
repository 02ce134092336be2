"""A source shard rewritten while `reference-logits` or `verify --reference SRC` reads it (a download fetching
it again, `make-tiny --overwrite`, an edit) is refused, exit 2, nothing written, no verdict: as `shard` and
`export` refuse theirs (store.source_stamps: size and modification time before and after). Before, the
reference file held logits of the old bytes beside fp8-expert digests of the new ones (read again after the
model ran), and verify FAILED a correct conversion of either version: `weights: layers.0.ffn.experts.0.w1.weight
... the reference's weights ...`; `verify --reference SRC` failed one by its twin (`twin last: top1 ...`),
the twin read again from the changed source (a helper's hunt)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_cli

from dsv41_convert.store.safetensors_header import read_header

WRITTEN = "layers.0.ffn.experts.0.w1.weight"  # a routed expert: its fp8 digest is computed after the run


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("made") / "src"
    subprocess.run([sys.executable, "-m", "dsv41_convert.cli", "make-tiny", str(out)], check=True, capture_output=True)
    return out


@pytest.fixture
def src(made, tmp_path) -> Path:
    """A copy of the tiny source this test may rewrite."""
    return Path(shutil.copytree(made, tmp_path / "src", symlinks=True))


def _rewrite(src: Path, name: str = WRITTEN) -> str:
    """One byte of `name` changed, the shard replaced as a download replaces it; -> the shard's name."""
    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    header = read_header(shard)
    data = bytearray(shard.read_bytes())
    data[header.tensors[name].begin] ^= 0x11
    (shard.parent / (shard.name + ".new")).write_bytes(data)
    os.replace(shard.parent / (shard.name + ".new"), shard)
    return shard.name


def _rewritten_before(monkeypatch, target: str, src: Path) -> list[str]:
    """Rewrite `src`'s shard of WRITTEN once, as `target` (module.function) is first called; -> [its name]."""
    module, fn = target.rsplit(".", 1)
    real, done = getattr(__import__(module, fromlist=[fn]), fn), []

    def first(*args, **kwargs):
        if not done:
            done.append(_rewrite(src))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, first)
    return done


@pytest.mark.parametrize(
    "target,flags",
    [
        ("dsv41_convert.verify.weight_digests.weights_as_other", ()),  # after the model ran, before the fp8 digests
        ("dsv41_convert.verify.weight_digests.of_source", ("--stream-layers",)),  # after the units ran
    ],
)
def test_reference_logits_refuses_a_source_rewritten_while_it_runs(src, tmp_path, monkeypatch, capsys, target, flags):
    out = tmp_path / "refs" / "ref.safetensors"
    done = _rewritten_before(monkeypatch, target, src)
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--decode-steps", "1", *flags)
    assert done, "the rewrite did not happen"
    assert code == 2, err
    assert f"{done[0]} changed (size or modification time) while" in err
    assert f"nothing written to {out}" in err
    assert not out.parent.exists()  # the folders it made for OUT went again


def test_verify_against_a_source_rewritten_before_the_twin_gives_no_verdict(src, tmp_path, monkeypatch, capsys):
    conv = tmp_path / "conv"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2", "--expert-dtype", "fp8")
    assert code == 0, err
    done = _rewritten_before(monkeypatch, "dsv41_convert.verify.source.expected_shards", src)
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference", str(src), "--decode-steps", "1")
    assert done, "the rewrite did not happen"
    assert code == 2, out + err
    assert f"{done[0]} changed (size or modification time) while" in err
    assert "FAIL" not in out and "PASS" not in out


def test_verify_of_rank_files_rewritten_while_it_runs_gives_no_verdict(src, tmp_path, monkeypatch, capsys):
    """`shard --overwrite` into CONVERTED once verify has begun (the lock refuses it only while a writer holds the
    folder as verify starts): the ranks ran the new files, the manifest check read the new manifest and files,
    the weights check and the replay the old files through the descriptors opened first, and verify said PASS
    of a set a fresh verify FAILS (a helper's hunt)."""
    other = Path(shutil.copytree(src, tmp_path / "other", symlinks=True))
    _rewrite(other)  # a routed expert the default prompts reach: its conversion fails against src's reference
    conv, ref = tmp_path / "conv", tmp_path / "ref.safetensors"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")[0] == 0
    assert run_cli(monkeypatch, capsys, "reference-logits", str(src), str(ref), "--decode-steps", "1")[0] == 0
    real, done = __import__("dsv41_convert.verify.launch", fromlist=["launch"]).launch, []

    def rewritten_first(*args, **kwargs):
        if not done:
            cmd = ["shard", str(other), str(conv), "--tp", "2", "--overwrite"]
            done.append(subprocess.run([sys.executable, "-m", "dsv41_convert.cli", *cmd], capture_output=True))
        return real(*args, **kwargs)

    monkeypatch.setattr("dsv41_convert.verify.launch.launch", rewritten_first)
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref))
    assert done and done[0].returncode == 0, done and done[0].stderr
    assert code == 2, out + err
    assert "model0-mp2.safetensors" in err and "changed (size or modification time) while this run read it" in err
    assert "PASS" not in out
    monkeypatch.undo()
    code, out, _ = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref))
    assert code == 1 and "FAIL" in out  # what the folder holds now


def test_check_of_rank_files_rewritten_while_it_reads_gives_no_verdict(src, tmp_path, monkeypatch, capsys):
    """`shard --overwrite` into OUT once `check OUT` has begun (the lock refuses it only while held as check starts):
    landing mid-read, check named the rank file corrupt ("sha256 ..., manifest says ...; corrupt?"), FAILED, exit 1,
    on a folder whole once the writer ends (a helper's hunt). Now no verdict (exit 2, the file named). Here the
    rewrite lands before the reads (exit 0 before: check cannot tell which version it read); check again passes."""
    other = Path(shutil.copytree(src, tmp_path / "other", symlinks=True))
    _rewrite(other)
    conv = tmp_path / "conv"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")[0] == 0
    import dsv41_convert.store.manifest_check as manifest_check

    real, done = manifest_check.check_folder, []

    def rewritten_first(*args, **kwargs):
        if not done:
            cmd = ["shard", str(other), str(conv), "--tp", "2", "--overwrite"]
            done.append(subprocess.run([sys.executable, "-m", "dsv41_convert.cli", *cmd], capture_output=True))
        return real(*args, **kwargs)

    monkeypatch.setattr(manifest_check, "check_folder", rewritten_first)
    code, out, err = run_cli(monkeypatch, capsys, "check", str(conv))
    assert done and done[0].returncode == 0, done and done[0].stderr
    assert code == 2 and "model0-mp2.safetensors" in err and "changed (size or modification time) while" in err, err
    assert "FAILED" not in out and "ok" not in out
    monkeypatch.undo()
    assert run_cli(monkeypatch, capsys, "check", str(conv))[0] == 0
