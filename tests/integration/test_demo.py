"""The CLI of verify, reference-logits, check and demo: exit codes 0 / 1 / 2 and what they print."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint

CLI = [sys.executable, "-m", "dsv41_convert.cli"]
pytestmark = pytest.mark.slow  # subprocesses importing torch, a tiny checkpoint per module


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    write_checkpoint(root / "src", TINY, seed=1, quantized=True, vision=False)
    execute(build_plan(root / "src", 1), root / "mp1")
    return root


def test_check_passes_then_names_the_corrupt_file(converted, tmp_path):
    ok = _cli("check", str(converted / "mp1"), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    bad = tmp_path / "mp1"
    subprocess.run(["cp", "-r", str(converted / "mp1"), str(bad)], check=True)
    shard = bad / "model0-mp1.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    res = _cli("check", str(bad))
    assert res.returncode == 1
    assert "model0-mp1.safetensors: sha256" in res.stderr
    assert _cli("check", str(tmp_path / "nowhere")).returncode == 2


def test_verify_usage_errors_exit_2(converted):
    res = _cli("verify", str(converted / "mp1"))
    assert res.returncode == 2 and "exactly one of --reference" in res.stderr
    res = _cli("verify", str(converted / "mp1"), "--reference", str(converted / "src"), "--tp", "2")
    assert res.returncode == 2 and "no model*-mp2.safetensors" in res.stderr


@pytest.mark.slow
def test_reference_logits_then_verify_pass_and_fail(converted, tmp_path):
    ref = tmp_path / "ref.safetensors"
    res = _cli("reference-logits", str(converted / "src"), str(ref), "--decode-steps", "1", "--threads", "1")
    assert res.returncode == 0, res.stderr
    ok = _cli("verify", str(converted / "mp1"), "--reference-logits", str(ref), "--json", "--threads", "1")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] and report["mode"] == "exact" and report["overall"]["all"]["max_abs"] == 0
    tensors = load_file(str(ref))
    with safe_open(str(ref), "pt") as f:
        meta = f.metadata()
    tensors["logits"] = tensors["logits"] + torch.linspace(0, 1, tensors["logits"].shape[-1])
    save_file(tensors, str(ref), metadata=meta)
    bad = _cli("verify", str(converted / "mp1"), "--reference-logits", str(ref), "--threads", "1")
    assert bad.returncode == 1
    assert "FAIL" in bad.stdout and "last: " in bad.stdout


@pytest.mark.slow
@pytest.mark.dist
def test_demo(tmp_path):
    res = _cli("demo", str(tmp_path / "demo"), "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] and report["tp"] == 8
    assert report["verdict"] == "PASS" and report["decisive"] == ["weights", "replay"]
    assert set(report["stage_seconds"]) == {"make-tiny", "shard", "reference", "verify"}
    # SIGTERM while the run imported its modules (postponed to the next check) let `--overwrite` remove the
    # earlier demo's conversion and reference before it stopped (an audit): now the folder stays as it was
    from cli_run import run_cli_with_a_signal_in_an_import

    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "demo").rglob("*")}
    args = ("demo", str(tmp_path / "demo"), "--overwrite", "--json")
    run = run_cli_with_a_signal_in_an_import("dsv41_convert.verify.run", *args)
    assert run.returncode == 143, run.stderr
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "demo").rglob("*")} == before


@pytest.mark.parametrize(("verdict", "code"), [("PASS", 0), ("FAIL", 1), ("INCONCLUSIVE", 3)])
def test_demo_exits_as_verify_does(verdict, code, tmp_path, monkeypatch, capsys):
    """demo's exit code is verify's for the same verdict (README: 3 inconclusive); it was 1 for INCONCLUSIVE."""
    from cli_run import run_cli

    class Result:
        def __init__(self, verdict: str) -> None:
            self.verdict = verdict

        def to_json(self) -> dict:
            return {"verdict": self.verdict}

    monkeypatch.setattr("dsv41_convert.app.demo.run_demo", lambda *a, **k: (Result(verdict), {"verify": 1.0}))
    got, out, _ = run_cli(monkeypatch, capsys, "demo", str(tmp_path / "demo"), "--json")
    assert got == code and json.loads(out)["verdict"] == verdict


@pytest.mark.parametrize("env", [{"RANK": "0"}, {"RANK": "3", "WORLD_SIZE": "2"}, {"RANK": "1", "WORLD_SIZE": "2"}])
def test_demo_in_a_launch_or_a_broken_one_is_refused_before_it_writes(env, tmp_path, monkeypatch, capsys):
    """A broken RANK/WORLD_SIZE pair was refused only by the shard stage, after make-tiny had written the source
    (an audit); a launch of several processes would each write one share. Exit 2, nothing written."""
    from cli_run import run_cli

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(tmp_path / "demo"))
    assert code == 2 and ("RANK" in err or "torchrun" in err), err
    assert not (tmp_path / "demo").exists()


def test_demo_in_a_launch_of_one_process_is_not_refused_as_torchrun(tmp_path, monkeypatch, capsys):
    """README: demo refuses a launch of several processes; `torchrun --nproc-per-node 1` (RANK 0, WORLD_SIZE 1)
    runs it as one process would. Stopped here by its folder (not empty, no --overwrite), the check after
    the launch's."""
    from cli_run import run_cli

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "notes.txt").write_text("mine")
    code, out, err = run_cli(monkeypatch, capsys, "demo", str(tmp_path / "demo"))
    assert code == 2 and f"{tmp_path / 'demo'}: not a folder an earlier demo wrote" in err, err
    assert "torchrun" not in err and out == ""
    assert [p.name for p in (tmp_path / "demo").iterdir()] == ["notes.txt"]
