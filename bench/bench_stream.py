"""Time and peak RSS of `reference-logits --stream-layers`, beside the `plan` memory figure.

    python bench/bench_stream.py WORK [--src FOLDER] [--tokens 8] [--decode-steps 1] [--prompts 1]

Without --src, writes the full-size hollow layout (`make-tiny WORK/hollow --preset full --sparse`, 510 GB
apparent, ~20 MB on disk) and runs on it. Each command is a fresh CLI process under /usr/bin/time -v
(torch import and planning included), this checkout's CLI wherever the bench is started from (bench_shard.CLI);
prints one markdown row for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # this checkout's package, in this process too
from bench_shard import CLI  # noqa: E402


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """-> (wall seconds, peak RSS bytes, stdout) of one command."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return wall, rss_kb * 1024, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--src", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=1)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    src = a.src
    if src is None:
        src = a.work / "hollow"
        if not (src / "model.safetensors.index.json").exists():
            timed([*CLI, "make-tiny", str(src), "--preset", "full", "--sparse", "--overwrite", "--json"])
    vocab = json.loads((src / "config.json").read_text())["text_config"]["vocab_size"]
    lines = [
        json.dumps({"input_ids": [(1000 + 7919 * (p * a.tokens + i)) % (vocab - 16) + 3 for i in range(a.tokens)]})
        for p in range(a.prompts)
    ]
    prompts = a.work / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")

    from dsv41_convert.config import load_model_args
    from dsv41_convert.convert.memory import memory_figures
    from dsv41_convert.convert.plan import build_plan

    tp1 = build_plan(src, 1)
    args = load_model_args(src / "config.json")
    figure = memory_figures(tp1, args, a.prompts, a.tokens, a.decode_steps)["streamed"]
    del tp1
    out = a.work / "ref.safetensors"
    cmd = [*CLI, "reference-logits", str(src), str(out), "--stream-layers", "--prompts", str(prompts),
           "--decode-steps", str(a.decode_steps), "--overwrite", "--json"]  # fmt: skip
    wall, rss, stdout = timed(cmd)
    s = json.loads(stdout)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M")
    split = f"read {s['read_s']:.0f} s ({s['bytes_read'] / 2**30:.1f} GiB), transfer {s['transfer_s']:.0f} s"
    print(
        f"| {when} | {platform.node()} | {src.name} | {a.prompts} x {a.tokens} tokens, {a.decode_steps} decode |"
        f" {wall:.0f} s | {split}, compute {s['compute_s']:.0f} s | {rss / 2**30:.2f} GiB |"
        f" {figure['peak'] / 2**30:.2f} GiB ({figure['largest_unit']}) |"
    )


if __name__ == "__main__":
    main()
