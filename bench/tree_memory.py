"""Run one command and print the peaks of its process tree's memory, summed over the tree every 0.1 s from
/proc/PID/smaps_rollup (Linux): RSS (file pages mapped included), PSS (shared pages split between their
processes) and anonymous memory (what the kernel cannot drop and read again), in GiB, and the exit code.
A run of spawned ranks counts them all: `ru_maxrss` (timed_run.py) gives the largest process alone.

    python bench/tree_memory.py -- CMD ARGS...      (its stdout is dropped; the last 2,000 characters of its
                                                     stderr are printed when it fails)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

GIB = 1 << 30
FIELDS = ("Rss", "Pss", "Anonymous")


def tree(pid: int) -> list[int]:
    """pid and its descendants (each thread's children: /proc/PID/task/TID/children)."""
    out = [pid]
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return out
    for tid in tids:
        try:
            children = open(f"/proc/{pid}/task/{tid}/children").read().split()
        except OSError:
            continue
        for child in children:
            out += tree(int(child))
    return out


def memory(pid: int) -> dict[str, int]:
    """FIELDS of one process in bytes (0 for a process gone meanwhile)."""
    out = dict.fromkeys(FIELDS, 0)
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            key, _, rest = line.partition(":")
            if key in out:
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def main() -> int:
    sep, *cmd = sys.argv[1:] or [""]
    if sep != "--" or not cmd:
        sys.exit(__doc__)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peaks = dict.fromkeys(FIELDS, 0)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        each = [memory(p) for p in tree(proc.pid)]
        for key in FIELDS:
            peaks[key] = max(peaks[key], sum(m[key] for m in each))
        time.sleep(0.1)
    reader.join()
    said = ", ".join(f"{key} {peaks[key] / GIB:.2f} GiB" for key in FIELDS)
    print(f"exit {proc.returncode}; peak of the tree: {said}", flush=True)
    if proc.returncode:
        print(b"".join(err).decode(errors="replace")[-2000:])
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
