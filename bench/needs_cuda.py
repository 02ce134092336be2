"""The GPU benches' first check: one line, not a traceback from deep inside torch or TileLang, where torch sees
no CUDA device."""

from __future__ import annotations

import sys
from pathlib import Path


def require_cuda() -> None:
    """SystemExit (status 1) naming the running script where torch sees no CUDA device; call it after the
    arguments are parsed (so --help works anywhere)."""
    import torch

    if not torch.cuda.is_available():
        script = Path(sys.argv[0]).name
        raise SystemExit(
            f"{script}: needs a CUDA device (torch {torch.__version__} sees none here); it times GPU kernels: run it "
            "on a machine with a card (docs/BENCHMARKS.md)"
        )
