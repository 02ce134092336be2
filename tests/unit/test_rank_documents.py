"""Documents of the ranks of a torchrun launch, which share one stdout: each stays one whole line, also past
PIPE_BUF (4096 bytes), the most a pipe keeps whole by itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

WRITER = """
import os, sys
from dsv41_convert.app import report
rank = int(os.environ["RANK"])
for i in range(int(sys.argv[1])):
    report.print_json({"i": i, "payload": chr(97 + rank) * int(sys.argv[2])})
"""


def _documents_of_ranks(ranks: int, documents: int, size: int) -> list[bytes]:
    """Every line the `ranks` processes wrote to one pipe, read slowly, so that the pipe fills and a long
    write waits part-way (where another process's write can land)."""
    read_end, write_end = os.pipe()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(documents), str(size)],
            stdout=write_end,
            env=os.environ | {"RANK": str(r), "WORLD_SIZE": str(ranks)},
        )
        for r in range(ranks)
    ]
    os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as stream:
        while chunk := stream.read1(4096):
            chunks.append(chunk)
            time.sleep(0.0002)
    assert [p.wait(timeout=60) for p in procs] == [0] * ranks
    return b"".join(chunks).splitlines()


@pytest.mark.parametrize("size", [100, 100_000])
def test_documents_of_ranks_past_pipe_buf_stay_whole_lines(size):
    lines = _documents_of_ranks(4, 12, size)
    docs = [json.loads(line) for line in lines]
    assert sorted((d["rank"], d["i"]) for d in docs) == [(r, i) for r in range(4) for i in range(12)]
    assert all(d["payload"] == chr(97 + d["rank"]) * size for d in docs)


def test_without_the_lock_long_documents_of_ranks_are_cut(tmp_path, monkeypatch):
    """The fault the lock is for, shown on this machine: the same writes with lockf made a no-op interleave."""
    (tmp_path / "sitecustomize.py").write_text("import fcntl\nfcntl.lockf = lambda *a, **k: None\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    lines = _documents_of_ranks(4, 12, 100_000)
    broken = 0
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            broken += 1
    assert broken > 0
