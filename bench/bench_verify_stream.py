"""verify with the streamed replay against verify with the tp-N run and the whole replay, on the CPU.

    python bench/bench_verify_stream.py /tmp/vs [--preset medium] [--tp 2] [--decode-steps 1]
    python bench/bench_verify_stream.py /tmp/vf --preset full --tp 8 [--tokens 8]

Makes the preset (no vision), `shard --tp N`, `reference-logits --stream-layers` (the tp-1 file a model
larger than the machine gets), then, in a subprocess each: `verify --stream-layers` and `verify` (the N
ranks and the tp-1 replay in the launching process). Reports wall seconds, the verdict and its decisive
checks, verify's own per-check seconds, and the peak RSS of the largest single process (ru_maxrss of each
child from wait4: the launching process for the replay; a rank for the N-rank run), with the machine and date.

--preset full: the published layout at full size, hollow (`make-tiny --preset full --sparse`, all zeros),
its tp-N rank files written as shard would write them, without their zeros (tests/hollow_ranks.py: no
manifest), a reference of one prompt of --tokens ids with the weight digests but not the fp8 experts'
(--no-fp8-expert-digests: 13 more minutes on a 2-core box), and `verify --stream-layers` only (the tp-N
run would hold 537 GB).

This checkout's CLI, wherever the bench is started from (bench_shard.CLI: `python -P -m` with PYTHONPATH set to it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))  # this checkout's package, in this process too (tests/hollow_ranks.py)
from bench_shard import CLI  # noqa: E402


def timed(*args: str) -> tuple[float, dict, float]:
    """-> (wall seconds, the --json document, this child's peak RSS in GiB: the largest of it and the
    processes it reaped, from its own rusage; RUSAGE_CHILDREN's is the largest child so far, any run's)"""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        proc = subprocess.Popen([*CLI, *args, "--json"], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0), err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode(errors="replace")
    if proc.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(args)}: exit {proc.returncode}\n{stderr[-2000:]}")
    return wall, json.loads(stdout), usage.ru_maxrss / 2**20  # KiB -> GiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8, help="--preset full: the prompt's length")
    a = ap.parse_args()
    full = a.preset == "full"
    src, conv, ref = a.work / "src", a.work / f"mp{a.tp}", a.work / "ref-tp1.safetensors"
    if not src.exists():
        kind = ["--preset", "full", "--sparse"] if full else ["--preset", a.preset, "--no-vision"]
        subprocess.run([*CLI, "make-tiny", str(src), *kind], check=True)
    if not conv.exists():
        if full:
            from hollow_ranks import write_hollow_ranks

            write_hollow_ranks(src, conv, a.tp)
        else:
            subprocess.run([*CLI, "shard", str(src), str(conv), "--tp", str(a.tp)], check=True)
    if not ref.exists():
        extra = []
        if full:
            prompts = a.work / "prompts.jsonl"
            prompts.write_text(json.dumps({"input_ids": [1000 + 7919 * i for i in range(a.tokens)]}) + "\n")
            extra = ["--prompts", str(prompts), "--no-fp8-expert-digests"]
        wall, doc, rss = timed("reference-logits", str(src), str(ref), "--stream-layers", "--decode-steps",
                               str(a.decode_steps), *extra)  # fmt: skip
        print(f"reference-logits --stream-layers: {wall:.1f} s, peak RSS {rss:.2f} GiB")
    print(f"{platform.node()} {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| run | wall s | verdict (decisive) | seconds by check | peak RSS of one process, GiB |")
    print("|---|---:|---|---|---:|")
    runs = [("verify --stream-layers", ["--stream-layers"])]
    runs += [] if full else [(f"verify (tp-{a.tp} run + replay)", [])]
    for label, extra in runs:
        wall, doc, rss = timed("verify", str(conv), "--reference-logits", str(ref), *extra)
        secs = ", ".join(f"{k} {v:.1f}" for k, v in doc["seconds"].items())
        print(f"| {label} | {wall:.1f} | {doc['verdict']} ({', '.join(doc['decisive'])}) | {secs} | {rss:.2f} |")


if __name__ == "__main__":
    main()
