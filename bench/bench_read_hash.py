"""CPU seconds per GB of what one shard worker does to every copied byte at least: pread it out of the page
cache and sha256 it (issue 19 goal 1, docs/BENCHMARKS.md "session 45").

Reads FILE (cached first by one plain read) in STEP-byte preads, each hashed right after it is read, either
whole or SUB bytes at a time (pread SUB, hash SUB: the bytes still in the core's cache when hashed); then
the pread alone and the sha256 alone of a hot buffer, for the split. CPU time is this process's
(time.process_time), so other jobs on the machine matter less than to wall time.

    python bench/bench_read_hash.py FILE [--step-mib 4] [--sub-kib 128 256 1024] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time


def _per_gb(seconds: float, nbytes: int) -> float:
    return seconds / (nbytes / 1e9)


def read_and_hash(fd: int, size: int, step: int, sub: int | None) -> float:
    """CPU s per GB of pread + sha256 over the file, `sub` bytes at a time inside each step (None: whole)."""
    view = memoryview(bytearray(step))
    digest = hashlib.sha256()
    start, pos = time.process_time(), 0
    while pos < size:
        n = min(step, size - pos)
        piece = sub or n
        for off in range(0, n, piece):
            k = min(piece, n - off)
            os.preadv(fd, [view[off : off + k]], pos + off)
            digest.update(view[off : off + k])
        pos += n
    return _per_gb(time.process_time() - start, size)


def read_only(fd: int, size: int, step: int) -> float:
    view = memoryview(bytearray(step))
    start, pos = time.process_time(), 0
    while pos < size:
        os.preadv(fd, [view[: min(step, size - pos)]], pos)
        pos += step
    return _per_gb(time.process_time() - start, size)


def hash_only(size: int, step: int) -> float:
    """sha256 of one hot `step`-byte buffer, size // step times."""
    buf, digest = os.urandom(step), hashlib.sha256()
    start = time.process_time()
    for _ in range(max(size // step, 1)):
        digest.update(buf)
    return _per_gb(time.process_time() - start, max(size // step, 1) * step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--step-mib", type=int, default=4, help="pread size (the shard copy step: 4 MiB)")
    ap.add_argument("--sub-kib", type=int, nargs="*", default=[128, 256, 1024], help="hash-after-read sizes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the rows here too")
    a = ap.parse_args()
    fd = os.open(a.file, os.O_RDONLY)
    size, step = os.fstat(fd).st_size, a.step_mib << 20
    read_only(fd, size, step)  # into the page cache
    rows = []
    for r in range(a.rounds):
        row = {"round": r, f"whole {a.step_mib} MiB": read_and_hash(fd, size, step, None)}
        for kib in a.sub_kib:
            row[f"in {kib} KiB"] = read_and_hash(fd, size, step, kib << 10)
        row["pread alone"] = read_only(fd, size, step)
        row[f"sha256 alone ({a.step_mib} MiB hot)"] = hash_only(size, step)
        row["sha256 alone (256 KiB hot)"] = hash_only(size, 256 << 10)
        rows.append(row)
        print(" | ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"file": a.file, "bytes": size, "cpu_s_per_gb": rows}, f, indent=1)


if __name__ == "__main__":
    main()
