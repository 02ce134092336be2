"""Reference and verify times on the CPU: the decisive paths against today's statistical one.

    python bench/bench_verify.py /tmp/verify-bench [--preset tiny] [--tps 2,4,8] [--repeat 2]

For each tp: `shard`, `reference-logits --tp 1` and `--tp N`, then `verify` against the tp-N file (the
reference check is exact), against the tp-1 file (the N-rank run plus the tp-1 replay) and with
`--reference SRC` (twin), and against the tp-1 file with `--no-replay` (teacher). "ranks only" is the
N-rank run inside the tp-1 verify (its `converted` seconds plus reading the file): what verify cost
before the replay existed. Wall times of the CLI in a
subprocess (Python and torch start-up included), best of --repeat; prints a Markdown table. --baseline DIR
times that checkout's verify the same way: every CLI runs as `python -P -m dsv41_convert.cli` with PYTHONPATH
set to its checkout (this one, or DIR), wherever the bench is started from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_shard import _cli  # noqa: E402


def run(*args: str, code: Path = ROOT) -> tuple[float, dict]:
    """Wall seconds and the --json document of `dsv41-convert ARGS --json`, the CLI of checkout `code` (-P: not
    the package of the working directory, which `-m` would put first, whatever PYTHONPATH says)."""
    t = time.perf_counter()
    res = subprocess.run([*_cli(code), *args, "--json"], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(args)}: exit {res.returncode}\n{res.stderr[-2000:]}")
    return wall, json.loads(res.stdout)


def best(repeat: int, *args: str, code: Path = ROOT) -> tuple[float, dict]:
    runs = [run(*args, code=code) for _ in range(repeat)]
    return min(runs, key=lambda r: r[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root", type=Path)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tps", default="2,4,8")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads per process, every command")
    p.add_argument("--baseline", type=Path, help="a checkout of the code before decisive verify (today's verify)")
    a = p.parse_args()
    th = ("--threads", str(a.threads)) if a.threads else ()
    load0 = os.getloadavg()[0]
    src = a.root / f"src-{a.preset}"
    if not src.exists():
        subprocess.run([*_cli(ROOT), "make-tiny", str(src), "--preset", a.preset, "--no-vision"], check=True)
    ref1 = a.root / "ref-tp1.safetensors"
    t_ref1, _ = best(a.repeat, "reference-logits", str(src), str(ref1), "--overwrite", *th)
    rows = [f"| reference-logits --tp 1 | {t_ref1:.1f} s | |"]
    for tp in [int(x) for x in a.tps.split(",")]:
        out = a.root / f"mp{tp}"
        if not out.exists():
            subprocess.run([*_cli(ROOT), "shard", str(src), str(out), "--tp", str(tp)], check=True, capture_output=True)
        ref_n = a.root / f"ref-tp{tp}.safetensors"
        t_refn, _ = best(a.repeat, "reference-logits", str(src), str(ref_n), "--tp", str(tp), "--overwrite", *th)
        t_same, j_same = best(a.repeat, "verify", str(out), "--reference-logits", str(ref_n), *th)
        t_rep, j_rep = best(a.repeat, "verify", str(out), "--reference-logits", str(ref1), *th)
        t_src, j_src = best(a.repeat, "verify", str(out), "--reference", str(src), *th)
        t_tf, j_tf = best(a.repeat, "verify", str(out), "--reference-logits", str(ref1), "--no-replay", *th)
        if a.baseline:
            old = a.baseline.resolve()
            t_old, j_old = best(a.repeat, "verify", str(out), "--reference-logits", str(ref1), *th, code=old)
            rows.append(f"| before: verify mp{tp} vs tp-1 file ({a.baseline}) | {t_old:.1f} s | ok {j_old['ok']} |")
        s = j_rep["seconds"]
        ranks_only = t_rep - s.get("replay", 0.0)
        rows += [
            f"| reference-logits --tp {tp} | {t_refn:.1f} s | |",
            f"| verify mp{tp} vs tp-{tp} file | {t_same:.1f} s | {j_same['verdict']}, decisive {j_same['decisive']} |",
            f"| verify mp{tp} vs tp-1 file | {t_rep:.1f} s (ranks {s['converted']:.1f} s, replay {s['replay']:.1f} s)"
            f" | {j_rep['verdict']}, decisive {j_rep['decisive']}; {t_rep / ranks_only:.2f}x the ranks-only run |",
            f"| verify mp{tp} --reference SRC | {t_src:.1f} s | {j_src['verdict']}, decisive {j_src['decisive']} |",
            f"| verify mp{tp} vs tp-1 file --no-replay | {t_tf:.1f} s"
            f" (teacher {j_tf['seconds'].get('teacher', 0):.1f} s)"
            f" | {j_tf['verdict']}, decisive {j_tf['decisive']}; {t_tf / ranks_only:.2f}x the ranks-only run |",
        ]
    print(f"{platform.node()}, {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"preset {a.preset}, best of {a.repeat}, threads {a.threads or 'default'}, "
          f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| step | wall | result |\n|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
