"""CPU cost of each quant/ function on one row chunk as `export` hands it over (one torch thread).

    python bench/bench_quant_cpu.py [--old DIR] [--repeat 20]

For each function, the median thread CPU time over --repeat calls on a chunk of the medium preset's
shapes (a routed expert's 768 rows, an fp8 weight's 2 MiB), as MB/s of input and output per core.
--old DIR (a dsv41_convert/quant folder of another checkout, e.g. from `git worktree add`) times that
folder's fp8.py, fp4.py and cast.py on the same inputs, the two codes called in turn, and checks that
both give the same bytes.
Prints JSON (machine, date, load) for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dsv41_convert.quant import cast, fp4, fp8  # noqa: E402


def _load(path: Path, name: str) -> ModuleType:
    """A quant module from another checkout (its own imports resolve to this package's quant/)."""
    spec = importlib.util.spec_from_file_location(f"old_{name}", path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cases(mods: dict[str, ModuleType]) -> dict:
    """name -> (callable, input bytes, output bytes)."""
    gen = torch.Generator().manual_seed(0)
    expert = (torch.randn(768, 5120, generator=gen) * 0.02).bfloat16()  # [out rows of a chunk, in]
    dense = (torch.randn(256, 4096, generator=gen) * 0.02).bfloat16()  # 2 MiB of bf16
    packed, s4 = fp4.encode_mxfp4(expert)
    q8, s8 = fp8.encode_fp8_blocks(dense.repeat(2, 1))  # 2 MiB of e4m3
    m4, m8, mc = mods["fp4"], mods["fp8"], mods["cast"]
    return {
        "decode_fp8_blocks (e4m3 -> bf16)": (
            lambda: m8.decode_fp8_blocks(q8, s8, (32, 32)),
            q8.numel(),
            2 * q8.numel(),
        ),
        "decode_mxfp4 (e2m1 -> bf16)": (lambda: m4.decode_mxfp4(packed, s4), packed.numel(), 2 * expert.numel()),
        "fp4_to_fp8 (e2m1 -> e4m3)": (lambda: mc.fp4_to_fp8(packed, s4), packed.numel(), expert.numel()),
        "encode_fp8_blocks (bf16 -> e4m3)": (lambda: m8.encode_fp8_blocks(dense), 2 * dense.numel(), dense.numel()),
        "encode_mxfp4 (bf16 -> e2m1)": (lambda: m4.encode_mxfp4(expert), 2 * expert.numel(), expert.numel() // 2),
    }


def _bytes(result) -> list[bytes]:
    items = result if isinstance(result, tuple) else (result,)
    return [x.contiguous().view(torch.uint8).numpy().tobytes() for x in items]


def _times(fns: list, repeat: int) -> list[float]:
    """Median thread CPU seconds of each function, the functions called in turn (the first one first in even
    rounds, last in odd ones) so that a change of load between rounds reaches them all alike."""
    for fn in fns:
        fn()  # warm: tables, allocator
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeat):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            t0 = time.thread_time()
            fns[i]()
            times[i].append(time.thread_time() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, help="a dsv41_convert/quant folder to compare with")
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(1)  # as export's workers
    new = _cases({"fp4": fp4, "fp8": fp8, "cast": cast})
    old = _cases({n: _load(a.old, n) for n in ("fp4", "fp8", "cast")}) if a.old else {}
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "torch": torch.__version__,
        "functions": {},
    }
    for name, (fn, nin, nout) in new.items():
        old_fn = old[name][0] if name in old else None
        sec, *old_sec = _times([fn] if old_fn is None else [fn, old_fn], a.repeat)
        row = {"cpu_ms": round(sec * 1e3, 2), "in_mb_s": round(nin / sec / 1e6), "out_mb_s": round(nout / sec / 1e6)}
        if old_fn is not None:
            row["same_bytes_as_old"] = _bytes(fn()) == _bytes(old_fn())
            row["old_cpu_ms"] = round(old_sec[0] * 1e3, 2)
            row["speedup"] = round(old_sec[0] / sec, 2)
        result["functions"][name] = row
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
