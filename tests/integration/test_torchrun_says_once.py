"""What a torchrun launch of `shard` and `export` says once: its processes share one stdout and stderr, so the
result line (OUT, for `MP=$(torchrun ... shard ...)`) and the warnings about the common input (SRC without a
tokenizer, files export does not carry) come from one process of each host, not from every one; what a process
says of its own share (its progress, its counts, an error) still comes from each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A source without tokenizer.json (a warning) and with a file export does not carry (another)."""
    folder = make_tiny(tmp_path_factory.mktemp("says-once") / "src", vision=False)
    (folder / "tokenizer.json").unlink()
    (folder / "README.md").write_text("notes\n")
    return folder


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node 2 -m dsv41_convert.cli *args` (a free port of its own)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "-m", "dsv41_convert.cli", *args]  # fmt: skip
    return subprocess.run(launch, capture_output=True, text=True, timeout=300)


@pytest.mark.dist
@pytest.mark.parametrize("command", [["shard", "--tp", "2"], ["export", "--format", "bf16"]])
def test_a_torchrun_launch_prints_out_and_its_warnings_once(src, tmp_path, command):
    """Both processes printed OUT on stdout (a script's `$(...)` read two lines) and each warning about SRC
    (once per process: N times under --nproc-per-node N)."""
    verb, *options = command
    out = tmp_path / "out"
    run = _torchrun(verb, str(src), str(out), *options)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == [str(out.resolve())]
    err = " ".join(run.stderr.split())
    assert err.count(": no tokenizer.json, so ") == 1, err
    assert err.count(": not carried into ") == (verb == "export"), err
    # each process still says what its own share did
    assert err.count("rank 0: wrote ") == 1 and err.count("rank 1: wrote ") == 1, err
