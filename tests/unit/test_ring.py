"""ring.HostRing, ring.Staging and the Prefetch reading into a ring, with fake fences (no GPU).

Planted faults (each test class of them must fail on a broken ring, and `test_planted_*` check that it
does): a release that is ignored (bytes never come back), one that hands bytes back before the fence has
passed, a wrap off by one (the new region overlaps the oldest live one), a ring that reuses a region still
lent to the converter, and a close() that returns the ring with copies still queued.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41_convert.convert import prefetch, ring
from dsv41_convert.convert.prefetch import Prefetch
from dsv41_convert.convert.ring import HostRing, Staging

PIECE = 8192


class Fence:
    """A fake CUDA event: passes when `done` is set; synchronize() waits for it."""

    def __init__(self, done: bool = False):
        self.event = threading.Event()
        if done:
            self.event.set()
        self.waited = 0

    def query(self) -> bool:
        return self.event.is_set()

    def synchronize(self) -> None:
        self.waited += 1
        assert self.event.wait(10), "fence never passed"

    def set(self) -> None:
        self.event.set()


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def exercise(make_ring, steps: int = 3000, seed: int = 0) -> None:
    """Random claims, releases in any order with fences passing at random: every new region lies in the
    ring and overlaps no region whose bytes are still in use (not released, or its fence not passed), and
    the ring makes room whenever every region's bytes are free again."""
    rng = random.Random(seed)
    r = make_ring()
    busy: list[list] = []  # handed out: [region, released by this test, fence or None]
    for _ in range(steps):
        op = rng.random()
        if op < 0.5:
            n = rng.choice([1, 7, 10, 33, 50, 99, 100, rng.randint(1, 120)])
            got = r.carve(n)
            if n > r.size:
                assert got is None
                continue
            if got is None:
                continue
            assert 0 <= got.start and got.end <= r.size and got.nbytes == n and len(got.view) == n
            for other, released, fence in busy:
                in_use = not released or (fence is not None and not fence.query())
                assert not (in_use and _overlaps((got.start, got.end), (other.start, other.end))), (
                    f"{got.start, got.end} handed out over {other.start, other.end} still in use"
                )
            busy.append([got, False, None])
        elif op < 0.8 and busy:
            entry = busy[rng.randrange(len(busy))]
            if not entry[1]:
                fence = Fence(done=rng.random() < 0.5) if rng.random() < 0.7 else None
                r.release(entry[0], fence)
                entry[1:] = [True, fence]
        else:
            for _, _, fence in busy:
                if fence is not None and rng.random() < 0.5:
                    fence.set()
        busy = [e for e in busy if not (e[1] and (e[2] is None or e[2].query()))]
        if not busy:  # every byte free again: a request of the whole ring fits
            probe = r.carve(r.size)
            assert probe is not None and probe.start == 0, "the ring did not take its bytes back"
            r.release(probe)


def test_regions_never_overlap_bytes_in_use():
    for seed in range(5):
        exercise(lambda: HostRing(100, align=1), seed=seed)
        exercise(lambda: HostRing(128, align=8), seed=seed)


def test_wraps_to_byte_zero_and_skips_the_end():
    r = HostRing(100, align=1)
    a, b = r.carve(40), r.carve(40)
    assert (a.start, b.start) == (0, 40)
    assert r.carve(30) is None  # 20 left at the end, none at the start
    r.release(a)
    c = r.carve(30)
    assert c.start == 0 and r.live() == [(40, 80), (0, 30)]
    assert r.held() == 100 - 40 + 30  # the 20 bytes after 80 are lost for this lap
    assert r.carve(11) is None  # would reach into [40, 80)
    d = r.carve(10)
    assert (d.start, d.end) == (30, 40)
    r.release(b)
    r.release(c)
    r.release(d)
    assert r.carve(1).start == 0 and r.live() == [(0, 1)]  # empty: starts over at byte 0


def test_bytes_come_back_only_after_release_and_fence():
    r = HostRing(100, align=1)
    a = r.carve(60)
    assert r.carve(60) is None
    fence = Fence()
    r.release(a, fence)
    assert r.carve(60) is None and r.blocking_fence() is fence  # released, copy still running
    fence.set()
    got = r.carve(60)
    assert got is not None and got.start == 0


def test_release_out_of_order_waits_for_the_oldest():
    r = HostRing(90, align=1)
    a, b, c = r.carve(30), r.carve(30), r.carve(30)
    r.release(b)
    r.release(c)
    assert r.carve(30) is None  # a, the oldest, is still lent
    r.release(a)
    assert r.carve(90).start == 0


def test_a_request_larger_than_the_ring_never_fits():
    r = HostRing(100, align=1)
    assert r.carve(101) is None and r.live() == []


def test_regions_start_aligned():
    r = HostRing(1 << 16)
    a, b = r.carve(10), r.carve(5000)
    assert a.start == 0 and b.start == ring.ALIGN and r.carve(1).start == 3 * ring.ALIGN


class IgnoresRelease(HostRing):
    def release(self, region, fence=None):
        pass


class IgnoresFence(HostRing):
    def release(self, region, fence=None):
        super().release(region, None)


class WrapOffByOne(HostRing):
    def _place(self, nbytes):
        if self._live and not self._wraps() and self._end(self._live[-1]) + nbytes > self.size:
            return 0 if nbytes <= self._live[0].start + 1 else None
        return super()._place(nbytes)


@pytest.mark.parametrize("broken", [IgnoresRelease, IgnoresFence, WrapOffByOne])
def test_planted_faults_are_caught(broken):
    with pytest.raises(AssertionError):
        for seed in range(5):
            exercise(lambda: broken(100, align=1), seed=seed)


def test_borrow_reuses_one_ring_per_user():
    first = ring.borrow(1 << 20, bytearray)
    second = ring.borrow(1 << 20, bytearray)  # the first is lent: another one
    assert second is not first
    ring.give_back(first, bytearray)
    assert ring.borrow(1 << 20, bytearray) is first  # allocated once, reused
    region = second.carve(10)
    with pytest.raises(AssertionError, match="live regions"):
        ring.give_back(second, bytearray)  # a buffer still lent
    second.release(region)
    ring.give_back(second, bytearray)
    ring.give_back(first, bytearray)


def test_staging_bytes_come_back_when_the_tensor_is_gone_and_the_copy_done():
    st = Staging(64 << 10)
    x, region = st.empty((32, 256), torch.float16)  # 16 KiB
    assert x.shape == (32, 256) and x.dtype == torch.float16
    x.fill_(1.5)
    assert bytes(region.view[:2]) == torch.tensor([1.5], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    fence = Fence()
    region.fence = fence
    view = memoryview(x.reshape(-1).view(torch.uint8).numpy())  # as the Sink holds it
    del x
    gc.collect()
    assert st.held() == 16 << 10  # the memoryview keeps it
    del view
    gc.collect()
    assert st.held() == 16 << 10  # released, but its copy is still running
    fence.set()
    assert st.held() == 0


def test_staging_says_when_it_is_full():
    st = Staging(64 << 10)
    held = [st.empty((16 << 10,), torch.uint8) for _ in range(4)]
    assert all(h is not None for h in held)
    assert st.empty((1,), torch.uint8) is None  # full: the caller copies into pageable memory
    assert st.empty((0,), torch.uint8) is None
    del held
    gc.collect()
    assert st.empty((64 << 10,), torch.uint8) is not None


# --- the Prefetch reading into a ring ---------------------------------------------------------------


@pytest.fixture()
def src(tmp_path) -> tuple[Path, bytes]:
    data = os.urandom(32 * PIECE)
    (tmp_path / "f.bin").write_bytes(data)
    return tmp_path, data


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)
    time.sleep(0.05)


def _reads(monkeypatch) -> list[int]:
    """Offsets prefetch.pread_exact reads, in order."""
    seen: list[int] = []
    real = prefetch.pread_exact

    def record(fd, buf, offset, path="?"):
        seen.append(offset)
        real(fd, buf, offset, path)

    monkeypatch.setattr(prefetch, "pread_exact", record)
    return seen


def test_buffers_are_ring_regions_reused_after_release(src, monkeypatch):
    folder, data = src
    seen = _reads(monkeypatch)
    r = HostRing(3 * PIECE)
    pieces = [(i, "f.bin", i * PIECE, PIECE) for i in range(8)]
    pf = Prefetch(folder, pieces, 3 * PIECE, threads=2, ring=r)
    try:
        _wait(lambda: len(seen) == 3, "three pieces read")
        a = pf.take("f.bin", 0, PIECE)
        assert bytes(a) == data[:PIECE]
        time.sleep(0.1)
        assert len(seen) == 3  # taken but lent to the converter: its bytes are not read into
        fence = Fence()
        pf.release(a, fence)
        time.sleep(0.1)
        assert len(seen) == 3  # released, but its copy is still running
        fence.set()
        _wait(lambda: len(seen) == 4, "piece 3 read into piece 0's bytes")
        b = pf.take("f.bin", PIECE, PIECE)
        pf.release(b)
        c = pf.take("f.bin", 3 * PIECE, PIECE)  # piece 2 passed: dropped, its bytes free
        assert bytes(c) == data[3 * PIECE : 4 * PIECE]
        pf.release(c)
        for i in range(4, 8):
            _wait(lambda i=i: i * PIECE in seen, f"piece {i} read")  # a take before the claim: the caller's read
            got = pf.take("f.bin", i * PIECE, PIECE)
            assert bytes(got) == data[i * PIECE : (i + 1) * PIECE]
            pf.release(got, Fence(done=True))
        assert sorted(seen) == [i * PIECE for i in range(8)]  # each once
    finally:
        pf.close()
    assert r.live() == []


def test_ring_prefetch_hands_over_the_right_bytes_with_random_takes(src, monkeypatch):
    """Many laps of the ring; pieces of varied sizes; some passed (at), some taken late and released with
    fences that pass later: every taken buffer holds its own bytes while it is lent (checked again just
    before its release, after later pieces were read)."""
    folder, data = src
    rng = random.Random(1)
    pieces, pos = [], 0
    for i in range(60):
        n = rng.choice([512, 3000, PIECE, 2 * PIECE + 5])
        if pos + n > len(data):
            pos = 0
        pieces.append((i, "f.bin", pos, n))
        pos += n
    r = HostRing(5 * PIECE, align=512)
    pf = Prefetch(folder, pieces, 5 * PIECE, threads=3, ring=r)
    lent: list[tuple[memoryview, int, int, Fence]] = []
    try:
        i = 0
        while i < len(pieces):
            if rng.random() < 0.2:
                i += rng.randint(1, 3)
                pf.at(i)
                continue
            _, _, off, n = pieces[i]
            buf = pf.take("f.bin", off, n)
            if buf is not None:
                assert bytes(buf) == data[off : off + n]
                lent.append((buf, off, n, Fence()))
            while lent and (len(lent) > 2 or rng.random() < 0.5):
                b, o, m, fence = lent.pop(0)
                assert bytes(b) == data[o : o + m], "a lent buffer was read into"
                pf.release(b, fence)
                threading.Timer(0.01, fence.set).start()
            i += 1
        for b, o, m, fence in lent:
            assert bytes(b) == data[o : o + m]
            pf.release(b, fence)
            fence.set()
    finally:
        pf.close()
    assert r.live() == []


def test_a_piece_larger_than_the_ring_is_read_alone_elsewhere(src, monkeypatch):
    folder, data = src
    seen = _reads(monkeypatch)
    allocated: list[int] = []

    def alloc(n):
        allocated.append(n)
        return bytearray(n)

    r = HostRing(2 * PIECE)
    pieces = [(0, "f.bin", 0, PIECE), (1, "f.bin", PIECE, 4 * PIECE), (2, "f.bin", 5 * PIECE, PIECE)]
    pf = Prefetch(folder, pieces, 2 * PIECE, alloc, threads=2, ring=r)
    try:
        _wait(lambda: len(seen) == 1, "piece 0 read")
        assert len(seen) == 1  # the large piece waits until nothing else is claimed
        a = pf.take("f.bin", 0, PIECE)
        pf.release(a)
        _wait(lambda: PIECE in seen, "the large piece read")
        big = pf.take("f.bin", PIECE, 4 * PIECE)
        assert bytes(big) == data[PIECE : 5 * PIECE] and allocated == [4 * PIECE]
        pf.release(big)  # not a ring buffer: nothing to do
        _wait(lambda: 5 * PIECE in seen, "piece 2 read")
        c = pf.take("f.bin", 5 * PIECE, PIECE)
        assert bytes(c) == data[5 * PIECE : 6 * PIECE]
        pf.release(c)
        assert sorted(seen) == [0, PIECE, 5 * PIECE]
    finally:
        pf.close()


def test_close_with_buffers_lent_and_copies_running_waits_for_them(src, monkeypatch):
    """The converter stopped on an error: one buffer lent and never released, one released with its copy
    still queued. close() calls `settle` (the device sync) before taking them back, and waits for the
    fence; the ring goes back to the pool empty."""
    folder, _ = src
    seen = _reads(monkeypatch)
    r = HostRing(4 * PIECE)
    settled = []
    pieces = [(i, "f.bin", i * PIECE, PIECE) for i in range(8)]
    pf = Prefetch(folder, pieces, 4 * PIECE, threads=2, ring=r, settle=lambda: settled.append(True))
    _wait(lambda: len(seen) == 4, "four pieces read")
    a = pf.take("f.bin", 0, PIECE)
    b = pf.take("f.bin", PIECE, PIECE)
    fence = Fence()
    pf.release(b, fence)
    threading.Timer(0.2, fence.set).start()
    t0 = time.monotonic()
    pf.close()
    assert settled == [True] and fence.waited and time.monotonic() - t0 >= 0.15
    assert a is not None and r.live() == [] and not any(th.is_alive() for th in pf._threads)
    ring.give_back(r, bytearray)
    assert ring.borrow(4 * PIECE, bytearray) is r


def test_planted_reuse_of_a_lent_region_is_caught(src, monkeypatch):
    """A ring whose release takes bytes back at once, fence or not: a buffer the converter holds gets read
    into, which the byte check of the random-takes test sees."""
    monkeypatch.setattr(HostRing, "reclaim", lambda self: self._live.clear())  # lent ones too, fence or not
    with pytest.raises(AssertionError):
        test_ring_prefetch_hands_over_the_right_bytes_with_random_takes(src, monkeypatch)


def test_a_failed_read_gives_its_ring_region_back(src, monkeypatch):
    """Piece 0 runs past the end of the file and fills the whole ring; its read fails, and piece 1 is read
    into the ring all the same. Bug guarded: a failed piece keeping its region, the oldest of the ring and
    never released, so that no piece after it was read ahead for the rest of the run."""
    folder, data = src
    seen = _reads(monkeypatch)
    r = HostRing(2 * PIECE)
    pieces = [(0, "f.bin", 31 * PIECE, 2 * PIECE), (1, "f.bin", 0, PIECE)]
    pf = Prefetch(folder, pieces, 2 * PIECE, threads=1, ring=r)
    try:
        _wait(lambda: 0 in seen, "piece 1 read after piece 0 failed")
        assert pf.take("f.bin", 31 * PIECE, 2 * PIECE) is None  # failed: the converter's own read reports it
        got = pf.take("f.bin", 0, PIECE)
        assert bytes(got) == data[:PIECE]
        pf.release(got)
    finally:
        pf.close()
    assert r.live() == []


def test_a_pooled_ring_is_lent_to_one_user_at_a_time():
    """Two users borrowing at once get two rings, also when the pool holds one. Bug guarded: borrow handing
    out a pooled ring without taking it from the pool, so two writers carved (and read into) the same bytes."""
    size = (1 << 20) + 3 * ring.ALIGN  # a size no other test pools
    first = ring.borrow(size, bytearray)
    ring.give_back(first, bytearray)
    again, other = ring.borrow(size, bytearray), ring.borrow(size, bytearray)
    assert again is first and other is not first
    ring.give_back(again, bytearray)
    ring.give_back(other, bytearray)
