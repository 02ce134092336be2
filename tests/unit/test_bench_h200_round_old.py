"""bench/h200_round.sh's `cli` step with OLD=<checkout> times OLD's shard: it ran `env PYTHONPATH=$OLD:...
python3 -m dsv41_convert.cli` from the repository's root, and `-m` puts the working directory first, so the
"old code" line timed this checkout a second time. The script's own CPU dry run (DEV=cpu), tiny source."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tiny_ckpt import make_tiny

ROOT = Path(__file__).resolve().parents[2]

FAKE_CLI = 'import json\nprint(json.dumps({"which": "old checkout"}))\n'


def test_the_cli_step_runs_the_old_checkouts_cli(tmp_path):
    old = tmp_path / "old"
    (old / "dsv41_convert").mkdir(parents=True)
    (old / "dsv41_convert" / "__init__.py").write_text("")
    (old / "dsv41_convert" / "cli.py").write_text(FAKE_CLI)
    # a checkout's root without .device/ (whose setup.sh would unpack tilelang onto the path): the script, the
    # timer it calls, and this package, where `-m` finds it first
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    for name in ("h200_round.sh", "timed_run.py"):
        shutil.copy(ROOT / "bench" / name, repo / "bench" / name)
    (repo / "dsv41_convert").symlink_to(ROOT / "dsv41_convert")
    work = tmp_path / "w"
    make_tiny(work / "m", quantized=False, vision=False)
    env = os.environ | {
        "STEPS": "cli", "OLD": str(old), "PRESET": "tiny", "DEV": "cpu", "DROP": "0", "W": str(work),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # python3: this interpreter's
    }  # fmt: skip
    cmd = ["bash", "bench/h200_round.sh", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert '"which": "old checkout"' in (work / "logs" / "cli_shard_old.out").read_text()
    assert '"which"' not in (work / "logs" / "cli_shard.out").read_text()  # this checkout's shard
