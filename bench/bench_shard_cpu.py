"""CPU seconds per GB written of `shard --tp N --workers W` (default 1), this code against another
checkout, buffered and --direct-io, in alternating rounds, with `cp` of the source in each round (issue 19
goal 1: <= 1.0 CPU s per GB written with one worker; which write mode to make the default).

    python bench/bench_shard_cpu.py SRC WORK --old DIR [--tp 8] [--workers 1|N|auto] [--rounds 3] [--cold]
                                    [--export FORMAT]
    python bench/bench_shard_cpu.py SRC WORK --chunk-mib 4,16 [...]

--export FORMAT times `export SRC OUT --format FORMAT` instead of shard (the same writer).
--chunk-mib LIST times this code only, in its default write mode, with each copy step of LIST (MiB; through
bench/with_chunk.py) instead of the two codes and write modes.

SRC: a published-format checkpoint (e.g. make-tiny --preset medium). Each round runs, in an order that
rotates from round to round: cp -r SRC + sync, then every (code, write mode) pair, each into a fresh
WORK/out that is deleted after. The source is read into the page cache before each run, or dropped from
it with --cold (bench_shard.evict). Each CLI runs as `python -P -m dsv41_convert.cli` with PYTHONPATH
set to its checkout. Prints one JSON line per run (wall, user, system, CPU s per GB written, peak RSS)
and a table of medians; rank files of the two codes are compared by their manifest's sha256s.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_export import _bytes  # noqa: E402
from bench_shard import _cli, evict, measure, warm  # noqa: E402


def _mode_flags(checkout: Path, command: str, mode: str) -> list[str] | None:
    """The flags for a write mode ("buffered" or "--direct-io") of `command` in that checkout, or None where
    it cannot write so: before session 10 buffered writes were the default (no --buffered-io), and export
    had no --direct-io (buffered only)."""
    flags = _flags(checkout, command)
    if mode != "buffered":
        return [mode] if mode in flags else None
    return ["--buffered-io"] if "--buffered-io" in flags else []  # without it, buffered was the default


@functools.cache
def _flags(checkout: Path, command: str) -> str:
    """`command --help` of that checkout (its options)."""
    done = subprocess.run([*_cli(checkout), command, "--help"], capture_output=True, text=True, env=_NO_COLOR)
    return done.stdout


_NO_COLOR = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("--old", type=Path, help="another checkout (a folder holding dsv41_convert/)")
    ap.add_argument("--chunk-mib", help="copy steps to compare (MiB, comma-separated) instead of --old")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--workers", default="1", help="a number, or auto")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the source from the page cache before each run")
    ap.add_argument("--export", metavar="FORMAT", help="time export --format FORMAT instead of shard")
    a = ap.parse_args()
    if (a.old is None) == (a.chunk_mib is None):
        ap.error("give --old or --chunk-mib")
    if a.old is not None:  # "" is the working directory: often this checkout, whose rows would pass by construction
        if not (a.old / "dsv41_convert").is_dir():
            ap.error(f"--old {str(a.old)!r}: no dsv41_convert/ in it; give another checkout's root")
        if a.old.resolve() == ROOT:
            ap.error(f"--old {str(a.old)!r}: this checkout ({ROOT}), which the bench would compare with itself")
    a.work.mkdir(parents=True, exist_ok=True)
    out = a.work / "out"
    src_bytes = sum(p.stat().st_size for p in a.src.iterdir() if p.is_file())
    # (label, checkout, write mode, copy step in MiB): a checkout's write modes, or this code's copy steps
    if a.chunk_mib:
        runs = [("cp", None, None, None)] + [(f"{m} MiB", ROOT, None, int(m)) for m in a.chunk_mib.split(",")]
    else:
        codes = (("new", ROOT), ("old", a.old))
        modes = ("buffered", "--direct-io")
        runs = [("cp", None, None, None)] + [(f"{c} {io}", path, io, None) for c, path in codes for io in modes]
    results: list[dict] = []
    manifests: dict[str, dict] = {}
    for r in range(a.rounds):
        for label, code, io, mib in runs[r % len(runs) :] + runs[: r % len(runs)]:
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            evict(a.src) if a.cold else warm(a.src)
            if code is None:
                m = measure(["sh", "-c", f"cp -r '{a.src}' '{out}' && sync"])
                written = src_bytes
            else:
                job = ["export", "--format", a.export] if a.export else ["shard", "--tp", str(a.tp)]
                flags = [] if mib else _mode_flags(code, job[0], io)
                if flags is None:
                    continue
                cli = _cli(code)
                if mib:  # the CLI's module swapped for the script that sets the step first
                    cli = [*cli[:-2], str(Path(__file__).with_name("with_chunk.py")), str(mib)]
                cmd = [*cli, job[0], str(a.src), str(out), *job[1:], "--workers", a.workers]
                m = measure(cmd + flags)
                written = _bytes(out)
                manifests.setdefault(label, json.loads((out / "manifest.json").read_text())["files"])
            row = {"round": r, "run": label, "written_gb": round(written / 1e9, 3), **m}
            row["system_s"] = round(m["cpu_s"] - m["user_s"], 2)
            row["cpu_s_per_gb"] = round(m["cpu_s"] / (written / 1e9), 3)
            row["wall_s_per_gb"] = round(m["seconds"] / (written / 1e9), 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    same = len({json.dumps(files, sort_keys=True) for files in manifests.values()}) == 1
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "machine": platform.node(),
            "cpus": os.cpu_count(), "load": os.getloadavg(), "src_gb": round(src_bytes / 1e9, 3), "tp": a.tp,
            "cold": a.cold, "workers": a.workers, "export": a.export, "chunk_mib": a.chunk_mib,
            "same_rank_files_all_runs": same}  # fmt: skip
    print(json.dumps(meta))
    print("| run | wall s (median) | user s | system s | CPU s per GB written | wall s per GB | peak RSS GiB |")
    print("|---|---|---|---|---|---|---|")
    for label in dict.fromkeys(r["run"] for r in results):
        rows = [r for r in results if r["run"] == label]

        def med(key: str, rows: list = rows) -> float:
            return statistics.median(r[key] for r in rows)

        walls = " / ".join(f"{r['seconds']:.1f}" for r in rows)
        cpus = " / ".join(f"{r['cpu_s_per_gb']:.2f}" for r in rows)
        print(f"| {label} | {med('seconds'):.1f} ({walls}) | {med('user_s'):.1f} | {med('system_s'):.1f} | "
              f"{med('cpu_s_per_gb'):.2f} ({cpus}) | {med('wall_s_per_gb'):.2f} "
              f"| {med('max_process_rss_gib'):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
