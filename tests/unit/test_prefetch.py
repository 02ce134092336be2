"""prefetch.Prefetch: source pieces read ahead across tensors into the buffers the converter computes from.
Planted faults: a reader that runs past its byte budget, one that reads a piece the converter passed or
took over, a failed read that hangs or hides the error, a schedule (write._prefetch) that lists pieces the
converter never asks for or misses pieces it asks for, and bytes that change with the prefetch on."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quant_testing import CountingQuantizer

from dsv41_convert.convert import prefetch, write
from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import Read, build_plan
from dsv41_convert.convert.prefetch import Prefetch
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.convert.write import _Reader, write_partial, write_rank_file
from dsv41_convert.errors import HeaderError

PIECE = 8192


@pytest.fixture()
def src(tmp_path) -> tuple[Path, bytes]:
    data = os.urandom(8 * PIECE)
    (tmp_path / "f.bin").write_bytes(data)
    return tmp_path, data


class Recorder:
    """Wraps prefetch.pread_exact: the offsets read, and the most reads in flight at once."""

    def __init__(self, delay: float = 0.0):
        self.reads: list[int] = []
        self.inflight = self.most = 0
        self.lock = threading.Lock()
        self.delay = delay
        self.real = prefetch.pread_exact

    def __call__(self, fd, buf, offset, path="?"):
        with self.lock:
            self.reads.append(offset)
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        time.sleep(self.delay)
        try:
            self.real(fd, buf, offset, path)
        finally:
            with self.lock:
                self.inflight -= 1


def _settle(pf: Prefetch, rec: Recorder, n: int) -> None:
    """Wait until `n` reads happened and none is in flight (or 10 s), then a little longer."""
    deadline = time.monotonic() + 10
    while (len(rec.reads) < n or pf._reading) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)


def test_reads_ahead_within_its_budget_and_hands_over_the_bytes(src, monkeypatch):
    folder, data = src
    rec = Recorder()
    monkeypatch.setattr(prefetch, "pread_exact", rec)
    pieces = [(i, "f.bin", i * PIECE, PIECE) for i in range(8)]  # tensor i: one piece
    pf = Prefetch(folder, pieces, 3 * PIECE, threads=2)
    try:
        _settle(pf, rec, 3)
        assert sorted(rec.reads) == [0, PIECE, 2 * PIECE] and pf.claimed() == 3 * PIECE  # stopped at the budget
        buf = pf.take("f.bin", 0, PIECE)
        assert bytes(buf) == data[:PIECE]  # the piece's own bytes, read once
        _settle(pf, rec, 4)
        assert sorted(rec.reads)[3:] == [3 * PIECE] and pf.claimed() == 3 * PIECE
        pf.at(5)  # tensors 1-4 passed: their buffers are dropped, 5-7 read
        _settle(pf, rec, 7)
        assert sorted(rec.reads)[4:] == [5 * PIECE, 6 * PIECE, 7 * PIECE] and pf.claimed() == 3 * PIECE
        assert pf.take("f.bin", 3 * PIECE, PIECE) is None  # passed: the caller's to read
        assert bytes(pf.take("f.bin", 6 * PIECE, PIECE)) == data[6 * PIECE : 7 * PIECE]  # 5 dropped on the way
        assert pf.claimed() == PIECE
        assert pf.take("f.bin", 0, PIECE + 1) is None  # not a listed piece
        assert len(rec.reads) == 7 and rec.most <= 2
    finally:
        pf.close()
    assert not any(th.is_alive() for th in pf._threads)


def test_a_piece_not_claimed_yet_is_left_to_the_caller(src, monkeypatch):
    """take() of a piece no thread has started: None, and no thread reads it later (no double read)."""
    folder, data = src
    rec = Recorder()
    monkeypatch.setattr(prefetch, "pread_exact", rec)
    pieces = [(i, "f.bin", i * PIECE, PIECE) for i in range(8)]
    pf = Prefetch(folder, pieces, PIECE, threads=1)
    try:
        _settle(pf, rec, 1)
        assert pf.take("f.bin", 3 * PIECE, PIECE) is None  # 0 dropped; 1, 2 skipped; 3 is the caller's
        _settle(pf, rec, 2)
        assert rec.reads == [0, 4 * PIECE]
        assert bytes(pf.take("f.bin", 4 * PIECE, PIECE)) == data[4 * PIECE : 5 * PIECE]
    finally:
        pf.close()


def test_a_piece_being_read_is_waited_for(src, monkeypatch):
    folder, data = src
    monkeypatch.setattr(prefetch, "pread_exact", Recorder(delay=0.3))
    pf = Prefetch(folder, [(0, "f.bin", 0, PIECE)], PIECE, threads=1)
    try:
        time.sleep(0.05)
        assert bytes(pf.take("f.bin", 0, PIECE)) == data[:PIECE]
    finally:
        pf.close()


def test_a_failed_read_is_reported_by_the_callers_own_read(src):
    """A piece past the end of a truncated file: take() gives None (no hang) and the reader's own pread
    raises the error naming the file."""
    folder, _ = src
    rd = Read("f.bin", "t", "BF16", (16, PIECE // 2), 0, 0, 16)  # 16 rows of PIECE bytes: half past the end
    reader = _Reader(folder, 1 << 20)
    reader.ahead = Prefetch(folder, [(0, "f.bin", 0, 16 * PIECE)], 1 << 20, threads=1)
    try:
        time.sleep(0.1)
        with pytest.raises(HeaderError, match=r"f\.bin: unexpected end of file"):
            reader.rows(rd, 0, 16)
        assert reader.ahead.claimed() == 0
    finally:
        reader.ahead.close()
        reader.close()


class Served:
    """Counts pieces listed to Prefetch and the takes: of listed pieces (served from a buffer, or read by
    the caller because it got there before any thread), and of pieces not listed."""

    def __init__(self):
        self.listed = self.asked = self.served = self.unlisted = 0
        self.real_init, self.real_take = Prefetch.__init__, Prefetch.take

    def install(self, monkeypatch):
        def init(pf, src, pieces, *args, **kw):
            self.listed += len(pieces)
            self.real_init(pf, src, pieces, *args, **kw)

        def take(pf, file, offset, nbytes):
            listed = (file, offset, nbytes) in pf._where
            buf = self.real_take(pf, file, offset, nbytes)
            self.asked += listed
            self.unlisted += not listed
            self.served += buf is not None
            return buf

        monkeypatch.setattr(Prefetch, "__init__", init)
        monkeypatch.setattr(Prefetch, "take", take)


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory) -> Path:
    from tiny_ckpt import make_tiny

    return make_tiny(tmp_path_factory.mktemp("src") / "bf16", quantized=False, vision=False)


def _prefetch_on(monkeypatch, ahead: int) -> Served:
    monkeypatch.setattr(write, "READ_AHEAD_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(write, "READ_AHEAD_BYTES", ahead)
    served = Served()
    served.install(monkeypatch)
    return served


@pytest.mark.parametrize("ahead", [1 << 16, 64 << 20])
def test_shard_with_prefetch_reads_each_piece_once_and_changes_no_byte(bf16_src, tmp_path, monkeypatch, ahead):
    """The schedule lists exactly the pieces the converter asks for (every one asked for, none wasted: the
    groups' later parts are not listed), and the files are the same bytes."""
    plan = build_plan(bf16_src, 2)
    execute(plan, tmp_path / "a", workers=1)
    served = _prefetch_on(monkeypatch, ahead)
    execute(plan, tmp_path / "b", workers=1)
    assert served.listed > 100 and served.asked == served.listed and served.unlisted == 0
    assert served.served > served.listed // 2  # most from the threads' buffers (the rest: caller got there first)
    for f in (tmp_path / "a").glob("model*"):
        assert (tmp_path / "b" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("stop", [30, 60, 95])
def test_resume_with_prefetch_is_byte_identical(bf16_src, tmp_path, monkeypatch, stop):
    """Ctrl-C inside a computed tensor (later group parts written ahead: stash 0), then --resume with the
    prefetch on: it lists exactly the pieces asked for from the checkpoint's tensor and chunk on."""
    rf = build_plan(bf16_src, 2).files[1]
    kw = dict(chunk_bytes=1 << 12, stash_bytes=0, plan_digest="d", journal_bytes=1 << 13)
    (tmp_path / "clean").mkdir()
    write_rank_file(rf, bf16_src, tmp_path / "clean", quantizer_for("cpu"), **kw)
    served = _prefetch_on(monkeypatch, 1 << 16)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        write_partial(rf, bf16_src, out, CountingQuantizer(stop), **kw)
    stats: dict = {}
    served.listed = served.asked = served.unlisted = 0
    write_rank_file(rf, bf16_src, out, quantizer_for("cpu"), resume=True, stats=stats, **kw)
    assert 0 < stats["resumed_from"] < rf.nbytes
    assert served.asked == served.listed > 0 and served.unlisted == 0
    assert (out / rf.file).read_bytes() == (tmp_path / "clean" / rf.file).read_bytes()


def test_the_caller_hints_only_copied_tensors_with_the_prefetch_on(bf16_src, tmp_path, monkeypatch):
    """With the prefetch on, the converting thread's WILLNEED hints cover only the copied tensors (its
    threads read the computed ones, and a hint can block the caller while the disk is busy); without it,
    computed tensors' regions are hinted too."""
    rf = build_plan(bf16_src, 2).files[0]
    computed = set()  # (file, region start) of the computed tensors' reads
    for t in rf.tensors:
        if t.action not in write.COPIED:
            computed |= {(rd.file, rd.offset + rd.r0 * write.row_bytes(rd.dtype, rd.shape)) for rd in t.reads}
    hinted: set[tuple[str, int]] = set()
    real = os.posix_fadvise

    def fadvise(fd, offset, n, advice):
        if threading.current_thread() is threading.main_thread():
            hinted.add((Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset))
        return real(fd, offset, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    (tmp_path / "a").mkdir()
    write_rank_file(rf, bf16_src, tmp_path / "a", quantizer_for("cpu"))
    assert computed & hinted  # without the prefetch
    hinted.clear()
    monkeypatch.setattr(write, "READ_AHEAD_DEVICES", ("cpu", "cuda"))
    (tmp_path / "b").mkdir()
    write_rank_file(rf, bf16_src, tmp_path / "b", quantizer_for("cpu"))
    assert hinted and not computed & hinted  # copies still hinted, computed tensors not
    assert (tmp_path / "b" / rf.file).read_bytes() == (tmp_path / "a" / rf.file).read_bytes()


def test_a_failed_piece_the_converter_passes_gives_its_budget_back(src, monkeypatch):
    """Piece 0 runs past the end of the file (its read fails) and holds the whole budget; once the converter
    moves on to tensor 1 (at), piece 1 is read ahead and served. Bug guarded: a failed piece passed without a
    take keeping its bytes claimed, which stopped all read-ahead for the rest of the file."""
    folder, data = src
    rec = Recorder()
    monkeypatch.setattr(prefetch, "pread_exact", rec)
    pieces = [(0, "f.bin", 7 * PIECE, 2 * PIECE), (1, "f.bin", 0, PIECE)]
    pf = Prefetch(folder, pieces, 2 * PIECE, threads=1)
    try:
        _settle(pf, rec, 1)
        assert rec.reads == [7 * PIECE] and pf.claimed() == 2 * PIECE  # failed, its claim held until passed
        pf.at(1)
        _settle(pf, rec, 2)
        assert rec.reads == [7 * PIECE, 0]
        assert bytes(pf.take("f.bin", 0, PIECE)) == data[:PIECE] and pf.claimed() == 0
    finally:
        pf.close()


def test_a_piece_passed_while_being_read_gives_its_budget_back(src, monkeypatch):
    """The converter moves past piece 0 while a thread is still reading it: when that read ends its bytes are
    no longer claimed, and piece 1 (the budget holds one piece) is read and served. Bug guarded: the claim of
    a piece passed mid-read never given back, so nothing more was read ahead."""
    folder, data = src
    rec = Recorder(delay=0.3)
    monkeypatch.setattr(prefetch, "pread_exact", rec)
    pf = Prefetch(folder, [(0, "f.bin", 0, PIECE), (1, "f.bin", PIECE, PIECE)], PIECE, threads=1)
    try:
        deadline = time.monotonic() + 10
        while not rec.inflight and time.monotonic() < deadline:
            time.sleep(0.005)
        pf.at(1)  # piece 0 is being read
        _settle(pf, rec, 2)
        assert rec.reads == [0, PIECE]
        assert bytes(pf.take("f.bin", PIECE, PIECE)) == data[PIECE : 2 * PIECE] and pf.claimed() == 0
    finally:
        pf.close()


def test_close_closes_the_source_files_it_opened(src, monkeypatch):
    """A Prefetch is made per rank file and opens each source shard it reads; close() closes them. Bug
    guarded: descriptors left open at close, one set more for every rank file a run writes."""
    folder, _ = src
    opened: list[int] = []
    real_open = os.open

    def record(path, flags, *args):
        fd = real_open(path, flags, *args)
        opened.append(fd)
        return fd

    monkeypatch.setattr(prefetch.os, "open", record)
    rec = Recorder()
    monkeypatch.setattr(prefetch, "pread_exact", rec)
    pf = Prefetch(folder, [(0, "f.bin", 0, PIECE), (1, "f.bin", PIECE, PIECE)], 2 * PIECE, threads=2)
    try:
        _settle(pf, rec, 2)
        assert sorted(rec.reads) == [0, PIECE]
    finally:
        pf.close()
    monkeypatch.undo()
    assert len(opened) == 1  # one descriptor per file, shared by the threads
    with pytest.raises(OSError):
        os.fstat(opened[0])
