"""Does one export worker's CPU work slow down when N run at once? Per-call CPU of the fp8 export's
per-chunk work in N concurrent processes (one torch thread each), for N in --procs.

    python bench/bench_cast_contention.py [--procs 1,4,8] [--repeat 30]

Work items, each on one chunk as `export --format fp8` hands it over (a routed expert's 768 x 5120):
  cast_quads   quant.cast.fp4_to_fp8 as shipped (two packed bytes per gather, a 3.9 MB table)
  cast_pairs   the same cast forced through the one-byte path (a 9 KB table, twice the gathers)
  sha256       hashlib.sha256 of the 3.9 MB output chunk
  copy         a 3.9 MB numpy copy (memory bandwidth)
Prints JSON: per item and N, the median thread-CPU ms per call across all processes, and its ratio to
N = 1. A ratio that grows with N is contention for something the processes share (caches, memory).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ITEMS = ("cast_quads", "cast_pairs", "sha256", "copy")


def _work(item: str, repeat: int, start, out) -> None:
    import numpy as np
    import torch

    from dsv41_convert.quant import cast, cast_bytes, fp4

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(os.getpid())
    expert = (torch.randn(768, 5120, generator=gen) * 0.02).bfloat16()
    packed, s4 = fp4.encode_mxfp4(expert)
    w8, _ = cast.fp4_to_fp8(packed, s4)
    chunk = w8.view(torch.uint8).numpy()
    if item == "cast_pairs":
        cast_bytes.K_ALL_EXACT = 1 << 30  # no offset passes the quad path's test
    fn = {
        "cast_quads": lambda: cast.fp4_to_fp8(packed, s4),
        "cast_pairs": lambda: cast.fp4_to_fp8(packed, s4),
        "sha256": lambda: hashlib.sha256(chunk).digest(),
        "copy": lambda: np.copy(chunk),
    }[item]
    for _ in range(3):
        fn()
    start.wait()
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    out.put(times)


def _round(item: str, procs: int, repeat: int) -> float:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_work, args=(item, repeat, start, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    times = [t for _ in ps for t in out.get()]
    for p in ps:
        p.join()
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", default="1,4,8")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--items", default=",".join(ITEMS))
    a = ap.parse_args()
    counts = [int(n) for n in a.procs.split(",")]
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "cpu_ms_per_call": {},
    }
    for item in a.items.split(","):
        row = {n: round(_round(item, n, a.repeat), 2) for n in counts}
        row["ratio_to_first"] = {n: round(row[n] / row[counts[0]], 2) for n in counts}
        result["cpu_ms_per_call"][item] = row
        print(item, row, file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
