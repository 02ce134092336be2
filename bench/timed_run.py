"""Run one command and print one line: label, wall s, CPU s (user + sys of it and its children), peak RSS
of its largest process, exit code, and how many lines of its stderr mention compiling (TileLang's
"compil..." log lines: kernels built rather than loaded from the cache).

    python bench/timed_run.py LABEL LOGDIR -- CMD ARGS...

Its stdout and stderr go to LOGDIR/LABEL.out and LOGDIR/LABEL.err.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    label, logdir, sep, *cmd = sys.argv[1:]
    if sep != "--" or not cmd:
        sys.exit(__doc__)
    logs = Path(logdir)
    logs.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(logs / f"{label}.out", "wb") as out, open(logs / f"{label}.err", "wb") as err:
        rc = subprocess.run(cmd, stdout=out, stderr=err).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    err_text = (logs / f"{label}.err").read_text(errors="replace")
    compiles = sum("compil" in line.lower() for line in err_text.splitlines())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(
        f"{label}: wall {wall:.1f} s, cpu {cpu:.1f} s (user {after.ru_utime - before.ru_utime:.1f}), "
        f"peak rss {after.ru_maxrss / 2**20:.2f} GiB, rc {rc}, compile lines {compiles}",
        flush=True,
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
