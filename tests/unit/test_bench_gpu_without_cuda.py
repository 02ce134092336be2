"""The GPU benches, started where torch sees no CUDA device, ended in a traceback from deep inside torch or
TileLang ("Cannot get CUDA generator without ATen_cuda library", "No registered target detector found an
available target", "Torch not compiled with CUDA enabled"): now one line says what they need."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_BENCHES = [
    "bench_kernels", "fp4_route", "gemm_bf16_route", "gemm_graphed", "gemm_host", "gemm_tiles", "gemm_variants",
    "gemm_ws", "wrapper_parts",
]  # fmt: skip


@pytest.mark.parametrize("name", GPU_BENCHES)
def test_a_gpu_bench_without_cuda_says_so(name, tmp_path):
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}  # none, on a machine with cards too
    cmd = [sys.executable, str(ROOT / "bench" / f"{name}.py")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"{name}.py: needs a CUDA device" in done.stderr, done.stderr[-2000:]


def test_bench_quant_stream_on_cuda_without_cuda_says_so_before_writing(tmp_path):
    """Its default --device cuda, without CUDA: a traceback ('pin_memory=True requires a CUDA ...') after it
    had copied the source and left OUT.warm behind."""
    from tiny_ckpt import make_tiny

    src = make_tiny(tmp_path / "src", quantized=False, vision=False)
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, str(ROOT / "bench" / "bench_quant_stream.py"), str(src), str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "bench_quant_stream.py: needs a CUDA device" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written
