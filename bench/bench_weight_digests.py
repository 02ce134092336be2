"""The weights record's cost: the sha256 of every tp-1 weight of a source (what `reference-logits --stream-layers`
records, weight_digests.of_source) and, given converted rank files, the check verify makes against it (their
merge to tp 1, a block at a time, weight_digests.compare).

    python bench/bench_weight_digests.py SRC [--converted MP_FOLDER] [--experts-as] [--json OUT]

`--experts-as`: of_source again, also digesting each routed expert as fp8 (the record's `experts_as`, in the
same read), and the record of it compared with MP_FOLDER (which then holds fp8 experts); `--skip-plain`: only
that pass.

Prints one JSON document: bytes hashed, wall and CPU seconds, peak RSS of this process, threads, the machine.
The source may be `make-tiny --preset full --sparse` (510 GB apparent, holes read as zeros: the hashing and
the process's memory at real shapes, not the disk's speed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not PYTHONPATH's or a virtualenv's (another checkout)

from dsv41_convert.convert.unshard import RankFiles  # noqa: E402
from dsv41_convert.store.file_digest import hash_threads  # noqa: E402
from dsv41_convert.verify import weight_digests  # noqa: E402
from dsv41_convert.verify.source import SourceWeights, source_experts  # noqa: E402


def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def _say_every(step: float):
    """A progress callback that prints to stderr each `step` bytes."""
    last = [0.0]

    def progress(label: str, done: int, total: int) -> None:
        if done - last[0] >= step or done == total:
            last[0] = done
            print(f"{label}: {done / 1e9:.1f} of {total / 1e9:.1f} GB", file=sys.stderr, flush=True)

    return progress


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--converted", type=Path)
    ap.add_argument("--experts-as", action="store_true")
    ap.add_argument("--skip-plain", action="store_true", help="with --experts-as: only the pass that adds them")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.skip_plain and not a.experts_as:
        ap.error("--skip-plain goes with --experts-as (it skips the pass without them)")
    doc = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "cores": os.cpu_count(),
        "threads": hash_threads(1 << 20),
    }
    weights = SourceWeights(a.src)
    weights_as = SourceWeights(a.src, "fp8") if a.experts_as else None
    total = sum(t.end - t.begin for t in weights.plan.files[0].tensors)
    try:
        digests, as_fp8 = {}, None
        if not a.skip_plain:
            (digests, _), wall, cpu = timed(lambda: weight_digests.of_source(weights, _say_every(50e9)))
            doc["of_source"] = {"tensors": len(digests), "bytes": total, "wall_s": wall, "cpu_s": cpu,
                                "gb_per_s": total / wall / 1e9}  # fmt: skip
        if weights_as is not None:
            (digests, as_fp8), wall, cpu = timed(
                lambda: weight_digests.of_source(weights, _say_every(50e9), weights_as)
            )
            doc["of_source_experts_as"] = {"expert_tensors": len(as_fp8), "wall_s": wall, "cpu_s": cpu,
                                           "gb_per_s": total / wall / 1e9}  # fmt: skip
    finally:
        weights.close()
        if weights_as is not None:
            weights_as.close()
    if a.converted:
        record = weight_digests.record([digests], source_experts(a.src), as_fp8)
        with RankFiles(a.converted) as ranks:
            size = sum(h.file_size for h in ranks.headers)
            (found, note), wall, cpu = timed(lambda: weight_digests.compare(record, ranks))
        doc["compare"] = {"tp": ranks.tp, "rank_file_bytes": size, "failures": len(found), "wall_s": wall,
                          "cpu_s": cpu, "gb_per_s": size / wall / 1e9, "note": note}  # fmt: skip
    doc["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    text = json.dumps(doc, indent=1)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
