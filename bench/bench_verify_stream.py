"""verify with the streamed replay against verify with the tp-N run and the whole replay, on the CPU.

    python bench/bench_verify_stream.py /tmp/vs [--preset medium] [--tp 2] [--decode-steps 1]

Makes the preset (no vision), `shard --tp N`, `reference-logits --stream-layers` (the tp-1 file a model
larger than the machine gets), then, in a subprocess each: `verify --stream-layers` and `verify` (the N
ranks and the tp-1 replay in the launching process). Reports wall seconds, the verdict and its decisive
checks, verify's own per-check seconds, and the peak RSS of the largest single process (ru_maxrss of the
children: the launching process for the replay; a rank for the N-rank run), with the machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "dsv41_convert.cli"]


def timed(*args: str) -> tuple[float, dict, float]:
    """-> (wall seconds, the --json document, this child's peak RSS in GiB)"""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    res = subprocess.run([*CLI, *args, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(args)}: exit {res.returncode}\n{res.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, json.loads(res.stdout), (peak if peak > before else float("nan")) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=1)
    a = ap.parse_args()
    src, conv, ref = a.work / "src", a.work / f"mp{a.tp}", a.work / "ref-tp1.safetensors"
    if not src.exists():
        subprocess.run([*CLI, "make-tiny", str(src), "--preset", a.preset, "--no-vision"], check=True)
    if not conv.exists():
        subprocess.run([*CLI, "shard", str(src), str(conv), "--tp", str(a.tp)], check=True)
    if not ref.exists():
        wall, doc, rss = timed("reference-logits", str(src), str(ref), "--stream-layers", "--decode-steps",
                               str(a.decode_steps))  # fmt: skip
        print(f"reference-logits --stream-layers: {wall:.1f} s, peak RSS {rss:.2f} GiB")
    print(f"{platform.node()} {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| run | wall s | verdict (decisive) | seconds by check | peak RSS of one process, GiB |")
    print("|---|---:|---|---|---:|")
    for label, extra in (("verify --stream-layers", ["--stream-layers"]), (f"verify (tp-{a.tp} run + replay)", [])):
        wall, doc, rss = timed("verify", str(conv), "--reference-logits", str(ref), *extra)
        secs = ", ".join(f"{k} {v:.1f}" for k, v in doc["seconds"].items())
        print(f"| {label} | {wall:.1f} | {doc['verdict']} ({', '.join(doc['decisive'])}) | {secs} | {rss:.2f} |")


if __name__ == "__main__":
    main()
