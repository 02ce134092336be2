"""Benchmark `dsv41-convert export` in each format against `cp` of the source, per byte written, with peak RSS.

    python bench/bench_export.py /tmp/export-bench [--preset medium] [--workers 1] [--repeat N] [--keep]

1. `make-tiny WORK/pub --preset medium --no-vision` (4.79 GB, real hidden sizes, canonical fp8/fp4 values);
2. for each format (bf16, fp8, fp8-fp4), alternating, each from a cold page cache for its files:
   `cp` of the source shards + sync, then `export WORK/pub WORK/out --format F` (it fsyncs every file);
   per byte written = (export s / output bytes) / (cp s / source bytes), in wall and in CPU seconds;
3. the quantizing direction and the round trip: `export WORK/bf16 --format fp8-fp4` (every weight
   quantized on the CPU), timed the same way, then every file compared with WORK/pub byte for byte (where
   files differ, verify/roundtrip.py lists the tensors and why);
4. prints a JSON result (machine, date) for docs/BENCHMARKS.md; deletes WORK unless --keep.
"""

from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shard import _median_run, evict, measure

from dsv41_convert.verify.roundtrip import compare_checkpoints

CLI = [sys.executable, "-m", "dsv41_convert.cli"]


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("model-*.safetensors"))


def _cp(src: Path, work: Path) -> dict:
    dst = work / "cp"
    dst.mkdir()
    evict(src)
    shards = sorted(str(p) for p in src.glob("*.safetensors"))
    run = measure(["sh", "-c", f'cp "$@" {dst} && sync', "cp", *shards])
    shutil.rmtree(dst)
    return run


def _export(src: Path, out: Path, fmt: str, workers: int) -> dict:
    evict(src)
    return measure([*CLI, "export", str(src), str(out), "--format", fmt, "--workers", str(workers), "--json"])


def _compare(a: Path, b: Path) -> list[str]:
    """Names of the files of `a` (shards, index, config, tokenizer) that differ in `b`."""
    names = [p.name for p in sorted(a.iterdir()) if p.is_file()]
    return [n for n in names if not filecmp.cmp(a / n, b / n, shallow=False)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="cp and export alternate this many times per format")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    work = a.work
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    pub = work / "pub"
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM, "
        f"load {os.getloadavg()[0]:.1f}",
        "preset": a.preset,
        "workers": a.workers,
        "formats": {},
    }
    try:
        t0 = time.perf_counter()
        measure([*CLI, "make-tiny", str(pub), "--preset", a.preset, "--no-vision"])
        result["make_tiny_s"] = round(time.perf_counter() - t0, 1)
        src_bytes = result["source_bytes"] = _bytes(pub)
        for fmt, src, out in (
            ("bf16", pub, work / "bf16"),
            ("fp8", pub, work / "out"),
            ("fp8-fp4", pub, work / "out"),
            ("bf16 -> fp8-fp4", work / "bf16", work / "back"),
        ):
            cps, runs = [], []
            for _ in range(a.repeat):
                cps.append(_cp(pub, work))
                if out.exists():
                    shutil.rmtree(out)
                runs.append(_export(src, out, fmt.split()[-1], a.workers))
            out_bytes = _bytes(out)
            cp, ours = _median_run(cps), _median_run(runs)
            row = {
                "output_bytes": out_bytes,
                "cp": cp,
                "export": ours,
                "cp_runs_s": [r["seconds"] for r in cps],
                "export_runs_s": [r["seconds"] for r in runs],
                "export_vs_cp": round(ours["seconds"] / cp["seconds"], 2),
                "export_vs_cp_per_byte": round(ours["seconds"] / out_bytes / (cp["seconds"] / src_bytes), 2),
                # CPU seconds (user + system) per byte written: on a machine shared with other jobs the
                # wall ratio follows their load, the CPU ratio much less
                "export_vs_cp_cpu_per_byte": round(ours["cpu_s"] / out_bytes / (cp["cpu_s"] / src_bytes), 2),
                "load_after": round(os.getloadavg()[0], 1),
            }
            if src != pub:
                row["files_differing_from_pub"] = _compare(pub, out)
                if row["files_differing_from_pub"]:  # which tensors, and why
                    row["tensors_differing"] = [asdict(d) for d in compare_checkpoints(pub, out)]
            result["formats"][fmt] = row
            print(json.dumps({fmt: row}), file=sys.stderr)
            if out.name in ("out", "back"):
                shutil.rmtree(out)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
