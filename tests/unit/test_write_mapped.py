"""Copied tensors go from a read-only map of the source to the writer (`write._Reader.mapped`): the bytes
of any unaligned range, a clear error where the file no longer holds them, and pread where a file system
cannot map (the same rank file)."""

from __future__ import annotations

import hashlib
import mmap
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert import write
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.errors import HeaderError


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("s") / "fp8", quantized=True)


def test_mapped_bytes_of_unaligned_ranges_and_a_short_file(tmp_path):
    data = os.urandom(3 * mmap.ALLOCATIONGRANULARITY + 123)
    (tmp_path / "f.bin").write_bytes(data)
    reader = write._Reader(tmp_path, 1 << 20)
    try:
        for pos, n in ((0, 1), (1, 4096), (4095, 2), (4097, 8000), (len(data) - 5, 5)):
            assert bytes(reader.mapped("f.bin", pos, n)) == data[pos : pos + n]
        with pytest.raises(HeaderError, match=r"f\.bin: unexpected end of file before byte"):
            reader.mapped("f.bin", len(data) - 5, 6)
    finally:
        reader.close()


def test_rank_file_through_pread_where_maps_fail(src, tmp_path, monkeypatch):
    rf = build_plan(src, 2).files[1]
    calls = []
    real_mapped = write._Reader.mapped

    def counted(self, file, pos, n):
        calls.append(n)
        return real_mapped(self, file, pos, n)

    monkeypatch.setattr(write._Reader, "mapped", counted)
    for out in ("mapped", "pread"):
        (tmp_path / out).mkdir()
    size, sha = write.write_rank_file(rf, src, tmp_path / "mapped", quantizer_for("cpu"))
    assert calls, "no copied tensor went through a map"

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # ENODEV: the file system cannot map files

    monkeypatch.setattr(mmap, "mmap", refuse)
    size2, sha2 = write.write_rank_file(rf, src, tmp_path / "pread", quantizer_for("cpu"))
    assert (size2, sha2) == (size, sha)
    for out in ("mapped", "pread"):
        assert hashlib.sha256((tmp_path / out / rf.file).read_bytes()).hexdigest() == sha
