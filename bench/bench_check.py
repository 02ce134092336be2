"""`check OUT` against plain reads of the same files and coreutils `sha256sum`, in alternating rounds, from a
cached or (--cold) an evicted page cache.

    python bench/bench_check.py OUT [--rounds 3] [--cold] [--workers 1,auto] [--sha256sum]

OUT: a folder written by `shard` (its manifest.json lists the files). Each round runs, in an order that
rotates from round to round:
  cat           `cat` of every listed file to /dev/null: one reader, the disk's speed to one stream
  cat x T       the files read by T `cat`s at once (xargs -P T), T = the threads `check` picks
  check W       `dsv41-convert check OUT --workers W` for each W of --workers (auto: one thread per usable
                core, at most 8 and the number of files)
  sha256sum     with --sha256sum: coreutils `sha256sum` of every listed file, one at a time (a check by hand)
Prints one JSON line per run (wall, user, system, GB/s) and a table of medians with each run's wall time
against `cat x T` of the same round.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shard import _cli, evict, measure, warm

ROOT = Path(__file__).resolve().parents[1]


def runs(out: Path, threads: int, workers: list[str], with_sha256sum: bool) -> dict[str, tuple[list[str], Path | None]]:
    """label -> (command, where its stdout goes)."""
    files = [str(out / name) for name in sorted(json.loads((out / "manifest.json").read_text())["files"])]
    parallel = f'printf "%s\\0" "$@" | xargs -0 -P {threads} -n 1 cat > /dev/null'
    check = [*_cli(ROOT), "check", str(out), "--json"]
    jobs = {
        "cat": (["cat", *files], Path("/dev/null")),
        f"cat x {threads}": (["sh", "-c", parallel, "sh", *files], None),
    }
    for w in workers:
        jobs[f"check {w}"] = ([*check, "--workers", w], Path("/dev/null"))
    if with_sha256sum:
        jobs["sha256sum"] = (["sha256sum", *files], Path("/dev/null"))
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="1,auto", help="check's --workers values to time (comma-separated)")
    parser.add_argument("--sha256sum", action="store_true", help="time coreutils sha256sum too (slow on some boxes)")
    parser.add_argument("--cold", action="store_true", help="evict OUT's files from the page cache before each run")
    a = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from dsv41_convert.store.file_digest import hash_threads

    names = json.loads((a.out / "manifest.json").read_text())["files"]
    gb = sum((a.out / name).stat().st_size for name in names) / 1e9
    threads = hash_threads(len(names))
    jobs = runs(a.out, threads, a.workers.split(","), a.sha256sum)
    results = []
    for r in range(a.rounds):
        labels = list(jobs)
        labels = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in labels:
            evict(a.out) if a.cold else warm(a.out)
            cmd, stdout = jobs[label]
            m = measure(cmd, stdout)
            row = {"round": r, "run": label, "gb": round(gb, 3), **m}
            row["system_s"] = round(m["cpu_s"] - m["user_s"], 2)
            row["gb_per_s"] = round(gb / m["seconds"], 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "machine": platform.node(),
            "cpus": os.cpu_count(), "threads": threads, "files": len(names), "gb": round(gb, 3),
            "cold": a.cold}  # fmt: skip
    print(json.dumps(meta))
    base = f"cat x {threads}"
    print(f"| run | wall s (median; by round) | user s | system s | GB/s | wall / {base} (by round) |")
    print("|---|---|---|---|---|---|")
    for label in jobs:
        rows = [x for x in results if x["run"] == label]
        walls = [x["seconds"] for x in rows]
        ratio = [x["seconds"] / next(b["seconds"] for b in results if b["run"] == base and b["round"] == x["round"])
                 for x in rows]  # fmt: skip
        wall = statistics.median(walls)
        user = statistics.median(x["user_s"] for x in rows)
        system = statistics.median(x["system_s"] for x in rows)
        print(
            f"| {label} | {wall:.2f} ({' / '.join(f'{w:.2f}' for w in walls)}) | {user:.1f} | {system:.1f} "
            f"| {gb / wall:.2f} | {statistics.median(ratio):.2f}x ({' / '.join(f'{v:.2f}' for v in ratio)}) |"
        )


if __name__ == "__main__":
    main()
