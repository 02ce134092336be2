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


def _documents_of_ranks(ranks: int, documents: int, size: int | list[int]) -> list[bytes]:
    """Every line the `ranks` processes wrote to one pipe (documents of `size` bytes, or of size[r] for rank
    r), read slowly, so that the pipe fills and a long write waits part-way (where another write can land)."""
    sizes = size if isinstance(size, list) else [size] * ranks
    argv = [[sys.executable, "-c", WRITER, str(documents), str(sizes[r])] for r in range(ranks)]
    return _read_slowly(argv).splitlines()


def _read_slowly(argv: list[list[str]]) -> bytes:
    """What the processes (one per command line in `argv`, RANK r of WORLD_SIZE len(argv)) wrote to one pipe, read
    slowly, so that the pipe fills and a long write waits part-way (where another write can land)."""
    read_end, write_end = os.pipe()
    env = [os.environ | {"RANK": str(r), "WORLD_SIZE": str(len(argv))} for r in range(len(argv))]
    procs = [subprocess.Popen(a, stdout=write_end, env=e) for a, e in zip(argv, env, strict=True)]
    os.close(write_end)
    chunks = []
    with os.fdopen(read_end, "rb") as stream:
        while chunk := stream.read1(4096):
            chunks.append(chunk)
            time.sleep(0.0002)
    assert [p.wait(timeout=60) for p in procs] == [0] * len(argv)
    return b"".join(chunks)


MIXED = [100_000, 200, 200, 200]  # a long document of one rank, short ones of the others (an audit: 7-9 in 120 cut)


@pytest.mark.parametrize("size", [100, 100_000, MIXED], ids=["short", "long", "mixed"])
def test_documents_of_ranks_past_pipe_buf_stay_whole_lines(size):
    lines = _documents_of_ranks(4, 30, size)
    sizes = size if isinstance(size, list) else [size] * 4
    docs = [json.loads(line) for line in lines]
    assert sorted((d["rank"], d["i"]) for d in docs) == [(r, i) for r in range(4) for i in range(30)]
    assert all(d["payload"] == chr(97 + d["rank"]) * sizes[d["rank"]] for d in docs)


@pytest.mark.parametrize("size", [100_000, MIXED], ids=["long", "mixed"])
def test_without_the_lock_documents_of_ranks_are_cut(tmp_path, monkeypatch, size):
    """The fault the lock is for, shown on this machine: the same writes with lockf made a no-op interleave
    (mixed sizes cut a line in about 4 runs of 5 here: up to three runs are given to show it)."""
    (tmp_path / "sitecustomize.py").write_text("import fcntl\nfcntl.lockf = lambda *a, **k: None\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    assert any(_broken(_documents_of_ranks(4, 30, size)) for _ in range(3))


def _broken(lines: list[bytes]) -> int:
    """How many of `lines` are not JSON."""
    broken = 0
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            broken += 1
    return broken


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def test_a_document_with_non_finite_numbers_is_valid_json(capsys):
    """A metric of a NaN logit is an infinity: `verify --json` wrote `"kl_mean": Infinity`, which JSON parsers
    other than Python's refuse (an audit: node's JSON.parse). Written as the strings "inf", "-inf", "nan"."""
    from dsv41_convert.app import report

    doc = {"a": float("inf"), "b": [float("nan"), 1.5], "c": {"d": float("-inf"), "e": (2.0, float("inf"))}}
    for compact in (False, True):
        report.print_json(doc, compact=compact)
        out = capsys.readouterr().out
        assert json.loads(out, parse_constant=_refuse) == {
            "a": "inf",
            "b": ["nan", 1.5],
            "c": {"d": "-inf", "e": [2.0, "inf"]},
        }
    report.print_json({"a": 1.0, "b": [2, "x"]})  # finite: as before
    assert json.loads(capsys.readouterr().out, parse_constant=_refuse) == {"a": 1.0, "b": [2, "x"]}


def test_a_document_in_pieces_under_torchrun_has_its_rank_first(capsys, monkeypatch):
    """`plan --json` writes its document in pieces; under torchrun it had no `rank`, unlike every other."""
    from dsv41_convert.app import report

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    report.write_json_pieces(iter(['{"src":"x",', '"files":[]}']))
    assert list(json.loads(capsys.readouterr().out).items()) == [("rank", 1), ("src", "x"), ("files", [])]
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    report.write_json_pieces(iter(['{"src":"x",', '"files":[]}']))
    assert json.loads(capsys.readouterr().out) == {"src": "x", "files": []}


def test_an_error_that_names_its_rank_is_not_named_twice(monkeypatch):
    """A torchrun process's error that begins with its rank was said "rank 1: rank 1: ..." (an audit), and one
    gathered from another rank "rank 1: rank 0: ...", as if rank 1 blamed rank 0 (a re-check)."""
    from dsv41_convert import torchrun

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torchrun.by_rank("rank 1: the launch lost a peer") == "rank 1: the launch lost a peer"
    assert torchrun.by_rank("rank 0: a.safetensors: nan") == "rank 0: a.safetensors: nan"  # gathered from rank 0
    assert torchrun.by_rank("a.safetensors: truncated") == "rank 1: a.safetensors: truncated"


def test_every_line_on_stderr_names_its_torchrun_process(monkeypatch, capsys):
    """Errors and warnings said their rank, the other lines on stderr not (`wrote 1 file(s) ... manifest:
    pending` twice, from whom? an audit)."""
    from dsv41_convert.app import report

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    report.info("wrote 1 file(s)")
    report.warn("no tokenizer")
    assert capsys.readouterr().err.splitlines() == ["rank 1: wrote 1 file(s)", "warning: rank 1: no tokenizer"]
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    report.info("wrote 1 file(s)")
    assert capsys.readouterr().err == "wrote 1 file(s)\n"


TABLES = """
import os, sys
from rich.table import Table
from dsv41_convert.app import report
rank = int(os.environ["RANK"])
for i in range(int(sys.argv[1])):
    tables = []
    for what in ("files", "rules"):
        table = Table(title=f"r{rank} i{i} {what}")
        table.add_column("cell")
        for _ in range(40):
            table.add_row(chr(97 + rank) * 60)
        tables.append(table)
    report.tables(*tables)  # as a share's `shard --dry-run` prints its files and its rules
"""


def test_tables_of_ranks_stay_whole(tmp_path):
    """`shard --dry-run` / `export --dry-run` under torchrun (one table of files and one of rules per share, no
    `--json`): the processes' tables came out interleaved, the titles of four shares in a row and then their
    rules tables, whose columns (rank or shard 1, 2, ...) no longer said whose they were (seen with the real
    layout at --nproc-per-node 4). Each process's tables are now one write under the stream's lock."""
    script = tmp_path / "tables.py"
    script.write_text(TABLES)
    lines = _read_slowly([[sys.executable, str(script), "20"]] * 4).decode().splitlines()
    starts = [n for n, line in enumerate(lines) if line.strip().endswith(" files")]
    assert len(starts) == 80
    for start, end in zip(starts, [*starts[1:], len(lines)], strict=True):
        rank, i = (int(word[1:]) for word in lines[start].split()[:2])
        block = lines[start:end]
        rows = [line for line in block if line.startswith(("│", "┃"))]  # a header and 40 rows per table
        assert f"r{rank} i{i} rules" in [line.strip() for line in block], block
        assert len(rows) == 82 and all(chr(97 + rank) * 60 in row or "cell" in row for row in rows), block
