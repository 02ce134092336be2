"""Time `dsv41-convert plan` on the published V4.1-Flash layout (96,085 tensors, 510 GB as sparse files).

    python bench/bench_plan.py WORK [--tp 8] [--repeat 3] [--code DIR]...

Builds the sparse source of tests/integration/reference_src.py in WORK (real headers, holes for the
data), then runs, each in a fresh process as a user would, `plan SRC --tp N` (the table), `plan --json`
and `plan --json --with-headers` (where the CLI has it), and reports per run the wall time, the CPU time
(user + sys, which a busy machine inflates far less than wall time) and the bytes written to stdout.
`--code DIR` (repeatable) times another checkout of the package (e.g. `git archive` of an older commit);
with several, their runs alternate, so a before/after shares one run and its machine load, and
`same_stdout` says per command whether every checkout wrote the same bytes (sha256 of stdout, every run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def run_once(code: Path, args: list[str]) -> dict:
    """One run of `dsv41-convert ARGS` with the package of checkout `code` (relative to the working directory;
    -P: not the working directory's package, which `python -c` would put first). -> wall and CPU seconds, the
    bytes and sha256 of its stdout; or {"error": its stderr's tail}"""
    env = os.environ | {"PYTHONPATH": str(code.resolve())}
    cmd = [sys.executable, "-P", "-c", "from dsv41_convert.cli import main; main()", *args]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        return {"error": proc.stderr.decode()[-400:]}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall": wall,
        "cpu": cpu,
        "stdout_bytes": len(proc.stdout),
        "sha256": hashlib.sha256(proc.stdout).hexdigest(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--code", type=Path, action="append", help="folder holding a dsv41_convert package to time")
    opts = ap.parse_args()
    codes = opts.code or [HERE]
    sys.path.insert(0, str(HERE / "tests" / "integration"))
    from reference_src import build_reference_src

    src = opts.work / "v41-flash"
    if not (src / "config.json").exists():
        build_reference_src(src)
    variants = {
        "plan": ["plan", str(src), "--tp", str(opts.tp)],
        "plan --json": ["plan", str(src), "--tp", str(opts.tp), "--json"],
        "plan --json --with-headers": ["plan", str(src), "--tp", str(opts.tp), "--json", "--with-headers"],
    }
    runs: dict[tuple[str, str], list[dict]] = {(str(c), v): [] for c in codes for v in variants}
    for _ in range(opts.repeat):
        for label, args in variants.items():
            for code in codes:
                runs[str(code), label].append(run_once(code, args))
    results: dict[str, dict] = {str(c): {} for c in codes}
    same_stdout = {label: len({r.get("sha256") for c in codes for r in runs[str(c), label]}) == 1 for label in variants}
    for (code, label), done in runs.items():
        if any("error" in r for r in done):
            results[code][label] = {"error": next(r["error"] for r in done if "error" in r).strip().splitlines()[-1]}
            continue
        results[code][label] = {
            "wall_median_s": round(statistics.median(r["wall"] for r in done), 2),
            "cpu_median_s": round(statistics.median(r["cpu"] for r in done), 2),
            "walls": [round(r["wall"], 2) for r in done],
            "stdout_bytes": done[0]["stdout_bytes"],
        }
    load = os.getloadavg()
    print(
        json.dumps(
            {
                "tp": opts.tp,
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "load_avg_1m": round(load[0], 2),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "results": results,
                "same_stdout": same_stdout,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
