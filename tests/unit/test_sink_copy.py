"""Sink.copy: source bytes appended unchanged by copy_file_range (or pwrite from a map of the source), hashed
from the source's pages, in file order with ordinary writes; a short or vanished source is an error naming
the file, never a short or zero-filled output."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from dsv41_convert.errors import HeaderError
from dsv41_convert.store import sink as sink_mod
from dsv41_convert.store.sink import Sink

# (source offset, length): unaligned starts and lengths, one across the map granularity, one empty
PIECES = [(0, 10), (4093, 70_000), (123_457, 1), (65_536, 0), (200_001, 300_000)]


@pytest.fixture
def source(tmp_path) -> tuple[Path, bytes]:
    data = os.urandom(600_000)
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    return path, data


def _run(source: tuple[Path, bytes], out: Path) -> tuple[bytes, str, Sink]:
    path, data = source
    sink = Sink(out, "out", 0, lambda *a: None)
    expected = bytearray()
    fd = os.open(path, os.O_RDONLY)
    try:
        for k, (pos, n) in enumerate(PIECES):
            head = bytes([k]) * (k + 3)  # ordinary writes between the copies
            sink.write(head, "head")
            sink.copy(fd, pos, n, str(path), f"t{k}")
            expected += head + data[pos : pos + n]
        sink.finish()
    finally:
        os.close(fd)
        os.close(sink.fd)
    return bytes(expected), sink.sha.hexdigest(), sink


def test_copy_appends_the_source_bytes_and_hashes_them(source, tmp_path):
    expected, sha, sink = _run(source, tmp_path / "out.bin")
    assert sink.buffered and sink.copy_range
    assert (tmp_path / "out.bin").read_bytes() == expected
    assert sha == hashlib.sha256(expected).hexdigest()
    assert sink.done == sink.queued == len(expected)


@pytest.mark.parametrize("err", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL])
def test_without_copy_file_range_the_map_is_written(source, tmp_path, monkeypatch, err):
    """Another file system or an old kernel: the same bytes, through pwrite from the source map."""

    def refuse(*args):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(sink_mod.os, "copy_file_range", refuse)
    expected, sha, sink = _run(source, tmp_path / "out.bin")
    assert not sink.copy_range
    assert (tmp_path / "out.bin").read_bytes() == expected
    assert sha == hashlib.sha256(expected).hexdigest()


def test_source_shorter_than_the_range_names_the_file(source, tmp_path):
    path, data = source
    sink = Sink(tmp_path / "out.bin", "out", 0, lambda *a: None)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(HeaderError, match=r"src\.bin: unexpected end of file"):
            sink.copy(fd, len(data) - 100, 200, str(path), "t")
        assert sink.queued == 0
    finally:
        os.close(fd)
        sink.finish()
        os.close(sink.fd)


def test_source_truncated_under_the_copy_names_the_file(source, tmp_path, monkeypatch):
    """copy_file_range finds the end of file early (the source shrank after the size check)."""
    path, _ = source
    monkeypatch.setattr(sink_mod.os, "copy_file_range", lambda *args: 0)
    sink = Sink(tmp_path / "out.bin", "out", 0, lambda *a: None)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(HeaderError, match=r"src\.bin: unexpected end of file at byte 4096"):
            sink.copy(fd, 4096, 100, str(path), "t")
    finally:
        os.close(fd)
        sink.finish()
        os.close(sink.fd)


def test_write_error_reaches_the_caller(source, tmp_path, monkeypatch):
    """A full disk during the copy is the caller's OSError (write.py turns it into an OutputError)."""
    path, _ = source

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink_mod.os, "copy_file_range", full)
    sink = Sink(tmp_path / "out.bin", "out", 0, lambda *a: None)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as exc:
            sink.copy(fd, 0, 100, str(path), "tensor.x")
        assert exc.value.errno == errno.ENOSPC and sink.tensor == "tensor.x"
    finally:
        os.close(fd)
        sink.finish()
        os.close(sink.fd)
