"""bench/tree_memory.py sums its command's whole process tree (verify's spawned ranks), not the largest process."""

from __future__ import annotations

import re
import subprocess
import sys

from bench_modules import BENCH

CHILDREN = """
import multiprocessing as mp, time
def hold():
    b = bytearray(200 << 20)
    b[::4096] = b"x" * len(b[::4096])
    time.sleep(1.5)
if __name__ == "__main__":
    ps = [mp.get_context("fork").Process(target=hold) for _ in range(2)]
    [p.start() for p in ps]
    [p.join() for p in ps]
"""


def test_the_peak_counts_every_process_of_the_tree():
    run = subprocess.run([sys.executable, str(BENCH / "tree_memory.py"), "--", sys.executable, "-c", CHILDREN],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    anonymous = float(re.search(r"Anonymous ([\d.]+) GiB", run.stdout).group(1))
    assert anonymous >= 0.39, run.stdout  # two children of 200 MiB each, held at once
    planted = [sys.executable, "-c", "import sys; sys.exit('planted')"]
    failing = subprocess.run([sys.executable, str(BENCH / "tree_memory.py"), "--", *planted],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert failing.returncode == 1 and "exit 1" in failing.stdout and "planted" in failing.stdout
