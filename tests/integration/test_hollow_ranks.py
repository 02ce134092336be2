"""tests/hollow_ranks.py against shard itself: the hollow rank files of an all-zero source are shard's bytes."""

from __future__ import annotations

import os
import struct

import pytest
from cli_run import run_cli
from hollow_ranks import write_hollow_ranks
from tiny_ckpt import make_tiny


def _zero_every_tensor(folder) -> None:
    """Every data byte of every shard of `folder` set to 0, headers kept: an all-zero source, as the
    full-size hollow layout reads."""
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "r+b") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            size = os.fstat(fh.fileno()).st_size - 8 - n
            fh.seek(8 + n)
            fh.write(bytes(size))


@pytest.mark.parametrize("tp", [4, 8])  # both pad the last rank's Engram rows (the scale's fill is 0x7f)
def test_hollow_rank_files_are_shards_bytes(tmp_path, monkeypatch, capsys, tp):
    src = make_tiny(tmp_path / "src")
    _zero_every_tensor(src)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "shard"), "--tp", str(tp))
    assert code == 0, err
    plan = write_hollow_ranks(src, tmp_path / "hollow", tp)
    assert any(t.pad_rows for f in plan.files for t in f.tensors), "no padding rows: the fill is not exercised"
    written = sorted(p.name for p in (tmp_path / "hollow").iterdir())
    shard_wrote = (p.name for p in (tmp_path / "shard").iterdir() if p.is_file() and p.name != "manifest.json")
    assert written == sorted(shard_wrote)
    for name in written:
        assert (tmp_path / "hollow" / name).read_bytes() == (tmp_path / "shard" / name).read_bytes(), name
