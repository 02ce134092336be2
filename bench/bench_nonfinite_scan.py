"""The cost of refusing NaN and infinity in copied tensors, against the sha256 every written byte gets anyway.

    python bench/bench_nonfinite_scan.py SRC [--tp 8] [--chunk-mib 4] [--rounds 3]

For every tensor that `shard SRC --tp N` copies unchanged (write.COPIED), reads its source bytes in the
writer's chunks (the page cache warmed by a first pass) and times, chunk by chunk in one run,
quant/byte_checks.first_nonfinite (the scan write._copy makes) against hashlib.sha256 of the same chunk.
Prints one JSON document: bytes per dtype, seconds of each, and the scan as a fraction of sha256's time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not PYTHONPATH's or a virtualenv's (another checkout)

from dsv41_convert.convert.plan import build_plan  # noqa: E402
from dsv41_convert.convert.write import COPIED  # noqa: E402
from dsv41_convert.quant.byte_checks import first_nonfinite  # noqa: E402
from dsv41_convert.store.safetensors_header import nbytes  # noqa: E402


def copied_regions(src: Path, tp: int):
    """(file, dtype, offset, rows, row bytes, column byte range or None) of every source region the tp-N shard
    copies unchanged: whole rows, or for a dim-1 split the columns it takes of them (as write._copy)."""
    for rf in build_plan(src, tp).files:
        for t in rf.tensors:
            if t.action in COPIED:
                rd = t.reads[0]
                row = nbytes(rd.dtype, rd.shape[1:])
                cols = None if rd.c1 < 0 else (nbytes(rd.dtype, (rd.c0,)), nbytes(rd.dtype, (rd.c1,)))
                yield rd.file, rd.dtype, rd.offset + rd.r0 * row, rd.r1 - rd.r0, row, cols


def chunks(fd: int, pos: int, rows: int, row: int, cols, chunk: int):
    """The bytes write._copy hands on, chunk by chunk: `chunk` bytes, or for columns the rows of about `chunk`
    bytes with the columns picked from them."""
    if cols is None:
        left = rows * row
        while left:
            n = min(chunk, left)
            yield os.pread(fd, n, pos)
            pos, left = pos + n, left - n
        return
    step = max(1, chunk // max(row, 1))
    for a in range(0, rows, step):
        b = min(rows, a + step)
        whole = np.frombuffer(os.pread(fd, (b - a) * row, pos + a * row), np.uint8).reshape(b - a, row)
        yield np.ascontiguousarray(whole[:, cols[0] : cols[1]]).tobytes()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    chunk = a.chunk_mib << 20
    regions = list(copied_regions(a.src, a.tp))
    fds = {f: os.open(a.src / f, os.O_RDONLY) for f in {r[0] for r in regions}}
    rounds = []
    for _ in range(a.rounds + 1):  # the first warms the page cache and is not reported
        scan, digest, nbytes_by = defaultdict(float), defaultdict(float), defaultdict(int)
        for file, dtype, pos, rows, row, cols in regions:
            for buf in chunks(fds[file], pos, rows, row, cols, chunk):
                t0 = time.perf_counter()
                assert first_nonfinite(buf, dtype) is None, (file, pos)
                t1 = time.perf_counter()
                hashlib.sha256(buf).digest()
                t2 = time.perf_counter()
                scan[dtype] += t1 - t0
                digest[dtype] += t2 - t1
                nbytes_by[dtype] += len(buf)
        rounds.append({"scan_s": dict(scan), "sha256_s": dict(digest), "bytes": dict(nbytes_by)})
    rounds = rounds[1:]
    total = [(sum(r["scan_s"].values()), sum(r["sha256_s"].values())) for r in rounds]
    print(json.dumps({
        "machine": platform.node(), "cpus": os.cpu_count(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "src": str(a.src), "tp": a.tp, "chunk_mib": a.chunk_mib, "bytes_copied": sum(rounds[0]["bytes"].values()),
        "rounds": rounds,
        "scan_over_sha256": [round(s / d, 4) for s, d in total],
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
