"""DirectAppender against a bytearray model of the file: random appends, flushes and seeks."""

from __future__ import annotations

import errno
import os
import random

import pytest

from dsv41_convert.store import direct_write
from dsv41_convert.store.direct_write import BLOCK, DirectAppender


def _run_script(path, direct: bool, seed: int, piece_blocks: int, depth: int) -> bytearray:
    """Apply a random script of operations to the file and to a model; return the model."""
    rng = random.Random(seed)
    model = bytearray()
    out = DirectAppender(path, direct=direct, piece_bytes=piece_blocks * BLOCK, depth=depth)
    try:
        for _ in range(60):
            op = rng.random()
            if op < 0.7:
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
def test_random_script_matches_model(tmp_path, direct, seed):
    path = tmp_path / "f.bin"
    model = _run_script(path, direct, seed, piece_blocks=3, depth=1 + seed % 3)
    assert path.read_bytes() == bytes(model)


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
