"""bench/bench_io_path.py runs on a small bf16 source: its stand-in quantizers returned torch.empty, whose
leftover bytes the converter's output checks (transform._require_finite_encoding, added after the bench)
refused as NaN or infinite blocks, so the bench ended in a FormatError traceback on the tiny preset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_modules import fresh_bench_module
from tiny_ckpt import make_tiny

ROOT = Path(__file__).resolve().parents[2]


def test_bench_io_path_runs_on_a_tiny_bf16_source(tmp_path):
    src = make_tiny(tmp_path / "src", quantized=False, vision=False)
    cmd = [sys.executable, str(ROOT / "bench" / "bench_io_path.py"), str(src), str(tmp_path / "out"), "--tp", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["wall_s"] >= 0 and result["stages_s"]
    assert not (tmp_path / "out").exists()  # the bench removes what it wrote


def test_bench_io_path_runs_on_its_own_made_source(tmp_path, monkeypatch):
    """--make-source filled every tensor with os.urandom bytes, NaN or infinite as bf16 and f32, and the writer
    refuses a non-finite value it copies unchanged (f32 and bf16 tensors of a bf16 source: quant/byte_checks),
    so `bench_io_path.py SRC OUT --make-source` ended in 'found nan at index ...'. The tiny preset stands in for
    the medium one here (13 GB)."""
    import dsv41_convert.synth.write as synth
    from dsv41_convert.synth.presets import PRESETS

    bench_io_path = fresh_bench_module(monkeypatch, "bench_io_path")

    monkeypatch.setattr(synth, "write_shard", synth.write_shard)  # make_source replaces it: restored after
    monkeypatch.setitem(PRESETS, "medium", PRESETS["tiny"])
    bench_io_path.make_source(tmp_path / "src")
    cmd = [sys.executable, str(ROOT / "bench" / "bench_io_path.py"), str(tmp_path / "src"), str(tmp_path / "out")]
    done = subprocess.run([*cmd, "--tp", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["wall_s"] >= 0
