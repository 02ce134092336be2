"""DirectAppender against a bytearray model of the file: random appends (copied into pieces, or sent from the
caller's memory), flushes and seeks."""

from __future__ import annotations

import errno
import mmap
import os
import random

import pytest
from slow_writes import slow_pwrites

from dsv41_convert.store import direct_write
from dsv41_convert.store.direct_write import BLOCK, DirectAppender, address, aligned_buffer


def _aligned_copy(data: bytes, skew: int) -> tuple[memoryview, mmap.mmap]:
    """`data` in memory that starts `skew` bytes past a block boundary (as write.py's copy buffers)."""
    buf = aligned_buffer(len(data) + BLOCK)
    view = memoryview(buf)[skew : skew + len(data)]
    view[:] = data
    return view, buf


def _run_script(path, direct: bool, seed: int, piece_blocks: int, depth: int) -> bytearray:
    """Apply a random script of operations to the file and to a model; return the model. Some long writes
    come from memory at the file position's skew (sent without a copy where THROUGH_BYTES allows); their
    memory is scribbled over right after `settle`."""
    rng = random.Random(seed)
    model = bytearray()
    out = DirectAppender(path, direct=direct, piece_bytes=piece_blocks * BLOCK, depth=depth)
    try:
        for _ in range(60):
            op = rng.random()
            if op < 0.2:
                data = rng.randbytes(rng.choice([2 * BLOCK, 5 * BLOCK + 7, rng.randrange(2 * BLOCK, 40000)]))
                pos = out.position
                model[pos : pos + len(data)] = data
                view, _ = _aligned_copy(data, pos % BLOCK)
                out.write(view)
                out.settle()
                view[:] = bytes(len(view))
            elif op < 0.7:
                size = rng.choice([1, 7, BLOCK - 1, BLOCK, BLOCK + 3, 3 * BLOCK + 5, rng.randrange(20000)])
                data = rng.randbytes(size)
                pos = out.position
                model[pos : pos + len(data)] = data
                out.write(data)
            elif op < 0.85:
                out.flush()
                assert path.read_bytes()[: out.position] == bytes(model[: out.position])
            else:  # jump ahead over bytes written elsewhere (as a group's later part is), or back
                gap = rng.randbytes(rng.randrange(1, 3 * BLOCK))
                at = out.position + rng.randrange(0, 50)
                out.flush()
                if len(model) < at:
                    model.extend(bytes(at - len(model)))
                    os.truncate(path, at)
                model[at : at + len(gap)] = gap
                os.pwrite(out.fd, gap, at)
                out.seek(at + len(gap))
        out.close()
    except BaseException:
        out.abort()
        raise
    return model


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("through_bytes", [2 * BLOCK, 1 << 30])
def test_random_script_matches_model(tmp_path, monkeypatch, direct, seed, through_bytes):
    monkeypatch.setattr(direct_write, "THROUGH_BYTES", through_bytes)
    path = tmp_path / "f.bin"
    model = _run_script(path, direct, seed, piece_blocks=3, depth=1 + seed % 3)
    assert path.read_bytes() == bytes(model)


def test_aligned_write_goes_out_from_the_callers_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_write, "THROUGH_BYTES", 2 * BLOCK)
    made = slow_pwrites(monkeypatch, 0.02)
    path = tmp_path / "f.bin"
    head, body = os.urandom(BLOCK + 100), os.urandom(9 * BLOCK + 5)
    out = DirectAppender(path, piece_bytes=4 * BLOCK, depth=2)
    try:
        if out.direct_fd < 0:
            pytest.skip("this file system refuses O_DIRECT")
        out.write(head)
        view, _ = _aligned_copy(body, len(head) % BLOCK)
        out.write(view)
        out.settle()
        view[:] = bytes(len(view))  # a settle that returned early lets these zeros reach the file
        out.close()
    finally:
        out.abort()
    assert path.read_bytes() == head + body
    lead = BLOCK - 100  # the bytes up to the next block boundary went into the piece
    whole = (len(body) - lead) // BLOCK * BLOCK
    assert (address(view) + lead, whole, 2 * BLOCK) in made
    assert sum(n for _, n, _ in made) == len(head) + len(body)  # each byte written once


def test_unaligned_write_is_copied(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_write, "THROUGH_BYTES", 2 * BLOCK)
    made = slow_pwrites(monkeypatch, 0.02)
    body = os.urandom(9 * BLOCK)
    view, _ = _aligned_copy(body, 8)  # position 0, memory 8 bytes past a block boundary
    out = DirectAppender(tmp_path / "f.bin", piece_bytes=4 * BLOCK, depth=2)
    try:
        out.write(view)
        out.close()
    finally:
        out.abort()
    assert (tmp_path / "f.bin").read_bytes() == body
    inside = range(address(view), address(view) + len(view))
    assert made and not any(a in inside for a, _, _ in made)


def test_direct_descriptor_is_used_where_supported(tmp_path):
    out = DirectAppender(tmp_path / "f.bin")
    try:
        supported = out.direct_fd >= 0
        out.write(os.urandom(5 * (8 << 20) + 17))
        out.close()
    finally:
        out.abort()
    if not supported:
        pytest.skip("this file system refuses O_DIRECT: the ordinary descriptor path ran")
    assert (tmp_path / "f.bin").stat().st_size == 5 * (8 << 20) + 17


def test_start_inside_existing_file_keeps_the_bytes_before(tmp_path):
    path = tmp_path / "f.bin"
    head = os.urandom(3 * BLOCK + 123)
    path.write_bytes(head + os.urandom(999))  # bytes past `start` are overwritten by the caller's stream
    tail = os.urandom(5 * BLOCK + 1)
    out = DirectAppender(path, start=len(head), piece_bytes=2 * BLOCK)
    out.write(tail)
    out.close()
    assert path.read_bytes() == head + tail


def test_write_error_reaches_the_caller(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = os.pwrite

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_write.os, "pwrite", pwrite)
    out = DirectAppender(tmp_path / "f.bin", piece_bytes=BLOCK, depth=2)
    with pytest.raises(OSError) as info:
        try:
            for _ in range(50):
                out.write(os.urandom(BLOCK))
            out.close()
        finally:
            out.abort()
    assert info.value.errno == errno.ENOSPC


@pytest.mark.parametrize("direct", [True, False])
def test_short_writes_go_on_from_where_they_stopped(tmp_path, monkeypatch, direct):
    """A pwrite that writes fewer bytes than asked (a file size limit, a nearly full disk): the rest goes to the
    file right after them, whichever descriptor takes it."""
    real = os.pwrite

    def short(fd, data, offset):
        data = memoryview(data).cast("B")
        return real(fd, data[: max(1, len(data) // 2)], offset)

    monkeypatch.setattr(direct_write.os, "pwrite", short)
    data = os.urandom(7 * BLOCK + 5)
    out = DirectAppender(tmp_path / "f.bin", direct=direct, piece_bytes=2 * BLOCK, depth=2)
    try:
        for at in range(0, len(data), 3000):
            out.write(data[at : at + 3000])
        out.close()
    finally:
        out.abort()
    assert (tmp_path / "f.bin").read_bytes() == data
