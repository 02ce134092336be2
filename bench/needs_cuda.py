"""The GPU benches' first check: one line, not a traceback from deep inside torch or TileLang, where torch sees
no CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path


def require_cuda() -> None:
    """SystemExit (status 1) naming the running script where torch sees no CUDA device; call it after the
    arguments are parsed (so --help works anywhere). The check asks NVML, which leaves CUDA uninitialised: torch's
    own (cudaGetDeviceCount) did not, and bench_kernels' compile workers, forked after it, ended in "Cannot
    re-initialize CUDA in forked subprocess" (H100, 2026-12-07)."""
    import os

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if not torch.cuda.is_available():
        script = Path(sys.argv[0]).name
        raise SystemExit(
            f"{script}: needs a CUDA device (torch {torch.__version__} sees none here); it times GPU kernels: run it "
            "on a machine with a card (docs/BENCHMARKS.md)"
        )
