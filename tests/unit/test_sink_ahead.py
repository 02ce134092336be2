"""Group parts written ahead (stash too small) are hashed and written by the Sink's thread, not the
converting one, and the file is the same bytes. Planted fault it catches: write-ahead back in the caller
(its pwrites then come from the main thread)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.convert.write import write_rank_file


def test_written_ahead_parts_leave_the_caller_thread(tmp_path, monkeypatch):
    from tiny_ckpt import make_tiny

    src = make_tiny(tmp_path / "src", quantized=False, vision=False)
    rf = build_plan(src, 2).files[0]
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    write_rank_file(rf, src, tmp_path / "a", quantizer_for("cpu"))  # stash: nothing written ahead
    threads: list[str] = []
    real = os.pwrite

    def pwrite(fd, data, pos):
        threads.append(threading.current_thread().name)
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    write_rank_file(rf, src, tmp_path / "b", quantizer_for("cpu"), stash_bytes=0)
    assert threads and threading.main_thread().name not in threads, set(threads)
    assert (tmp_path / "b" / rf.file).read_bytes() == (tmp_path / "a" / rf.file).read_bytes()
