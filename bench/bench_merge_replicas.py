"""`manifest` (store.manifest_merge.merge) of rank files gathered from two shares, with and without the
comparison of the replicated tensors across the rank files (convert.unshard.shares_agree), in alternating
rounds, the files cached.

    python bench/bench_merge_replicas.py WORK [--preset medium] [--tp 8] [--rounds 2]

Writes `make-tiny WORK/src --preset P --seed 0`, converts it as two shares (`shard --ranks` of the first and
the second half of the ranks, into two folders), hard-links both into WORK/gathered, reads the rank files once
(cached), then per round removes manifest.json and the done records and times merge in this process, with the
comparison and without (the order alternating). Prints wall and CPU seconds of each run, shares_agree alone,
and the replicated share of the rank files' bytes. This checkout's code, wherever it is started from: the CLI
as bench_shard.CLI (`python -P -m` with PYTHONPATH set to it), and in this process.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # this checkout's package, in this process too
from bench_shard import CLI  # noqa: E402

from dsv41_convert.convert.rules import Split, match_rule  # noqa: E402
from dsv41_convert.convert.unshard import RankFiles, shares_agree  # noqa: E402
from dsv41_convert.store.manifest import DONE_DIR, MANIFEST  # noqa: E402
from dsv41_convert.store.manifest_merge import merge  # noqa: E402
from dsv41_convert.store.safetensors_header import nbytes  # noqa: E402


def gathered(work: Path, preset: str, tp: int) -> Path:
    """WORK/gathered: the tp-`tp` rank files of two shares, hard links into their own folders."""
    src, out = work / "src", work / "gathered"
    if out.is_dir():
        return out
    subprocess.run([*CLI, "make-tiny", str(src), "--preset", preset, "--seed", "0"], check=True, capture_output=True)
    half = tp // 2
    for name, ranks in (("a", range(half)), ("b", range(half, tp))):
        cmd = [*CLI, "shard", str(src), str(work / name), "--tp", str(tp), "--ranks", ",".join(map(str, ranks))]
        subprocess.run(cmd, check=True, capture_output=True)
    out.mkdir()
    for name in ("a", "b"):
        for p in (work / name).iterdir():
            if p.is_file() and not (out / p.name).exists():
                (out / p.name).hardlink_to(p)
    return out


def replicated_share(folder: Path, tp: int) -> tuple[int, int]:
    """(bytes of replicated tensors over all rank files, bytes of all tensors)"""
    rep = total = 0
    with RankFiles(folder, tp) as ranks:
        for h in ranks.headers:
            for name, info in h.tensors.items():
                size = nbytes(info.dtype, info.shape)
                total += size
                rep += size if match_rule(name).split is Split.NONE else 0
    return rep, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folder = gathered(args.work, args.preset, args.tp)
    for p in folder.glob("model*.safetensors"):  # cached
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass
    for rnd in range(args.rounds):
        for compare in (True, False) if rnd % 2 == 0 else (False, True):
            (folder / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(folder / DONE_DIR, ignore_errors=True)
            t, c = time.perf_counter(), time.process_time()
            merge(folder, shares_agree=shares_agree if compare else None)
            print(f"round {rnd + 1}, replicas compared {compare}: wall {time.perf_counter() - t:.1f} s, "
                  f"CPU {time.process_time() - c:.1f} s", flush=True)  # fmt: skip
    t, c = time.perf_counter(), time.process_time()
    differ = shares_agree(folder, args.tp)
    print(f"shares_agree alone: wall {time.perf_counter() - t:.1f} s, CPU {time.process_time() - c:.1f} s, {differ}")
    rep, total = replicated_share(folder, args.tp)
    print(f"replicated tensors: {rep / 1e9:.2f} GB of {total / 1e9:.2f} GB ({100 * rep / total:.0f}%)")


if __name__ == "__main__":
    main()
