"""CPU time of the reference GEMMs (kernels/ref.py) at the full-size V4.1-Flash shapes, against an older ref.py.

    git show 2bde113:dsv41_convert/kernels/ref.py > /tmp/ref_old.py
    python bench/bench_ref_gemm.py --old /tmp/ref_old.py [--m 1 8 9 120]

Random e4m3 / e2m1 codes with e8m0 scales; CPU seconds of this process (all threads), best of 3 after
one warm call. Prints one line per op and shape, with whether old and new output bytes are equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not PYTHONPATH's or a virtualenv's (another checkout)

from dsv41_convert.kernels import ref  # noqa: E402
from dsv41_convert.quant.act import act_quant  # noqa: E402

FP8_SHAPES = [(32768, 1280), (5120, 8192), (1280, 5120), (2304, 5120)]  # wq_b, wo_b, wq_a, shared w1
FP4_SHAPES = [(2304, 5120), (5120, 2304)]  # routed expert w1 / w3, w2


def cpu_seconds(fn: Callable[[], object], reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best


def inputs(kind: str, m: int, n: int, k: int, g: torch.Generator) -> tuple[tuple, dict]:
    """(args, kwargs) of one fp8_gemm / fp4_gemm call: activations [m, k], weight [n, k]."""
    e8m0 = torch.float8_e8m0fnu
    xq, xs = act_quant(torch.randn(m, k, generator=g).bfloat16() * 3)
    if kind == "fp8":
        u = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        w = torch.where((u & 0x7F) == 0x7F, u - 1, u).view(torch.float8_e4m3fn)  # no NaN weights
        ws = torch.randint(110, 140, (n // 32, k // 32), dtype=torch.uint8, generator=g).view(e8m0)
        return (xq, xs, w, ws, e8m0), {"block_size": 32}
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2)
    ws = torch.randint(110, 140, (n, k // 32), dtype=torch.uint8, generator=g).view(e8m0)
    return (xq, xs, w, ws, e8m0), {"act_block_size": 32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="an older kernels/ref.py")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 120])
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("ref_old", a.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    g = torch.Generator().manual_seed(0)
    for m in a.m:
        for kind, shapes in (("fp8", FP8_SHAPES), ("fp4", FP4_SHAPES)):
            for n, k in shapes:
                args, kwargs = inputs(kind, m, n, k, g)
                calls = [partial(getattr(f, f"{kind}_gemm"), *args, **kwargs) for f in (old, ref)]
                same = torch.equal(calls[0]().view(torch.int16), calls[1]().view(torch.int16))
                t_old, t_new = (cpu_seconds(c) for c in calls)
                print(
                    f"{kind} M={m} N={n} K={k}: old {t_old * 1e3:.0f} ms, new {t_new * 1e3:.0f} ms "
                    f"(x{t_old / t_new:.2f}), bytes equal: {same}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
