"""stream.blocks: computed tensors as row blocks read ahead in a thread. Planted faults: a reader that races
ahead of the consumer (more than DEPTH blocks held), a read error mid-tensor, a consumer that stops early
(the reader must stop too), and an Engram-shaped table cut into blocks that must give the same bytes as
one whole-tensor quantization."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41_convert.convert import stream
from dsv41_convert.convert.plan import OutTensor, Read
from dsv41_convert.convert.transform import quantizer_for, to_bytes
from dsv41_convert.convert.write import _Reader
from dsv41_convert.errors import HeaderError
from dsv41_convert.quant.fp8 import encode_fp8_blocks

ROWS, WIDTH = 4 * 128 + 40, 256  # an Engram-shaped table: [rows, 256] bf16, rows not a multiple of the block


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> tuple[Path, torch.Tensor, OutTensor]:
    folder = tmp_path_factory.mktemp("src")
    w = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    name = "layers.1.engram.embed.weight"
    save_file({name: w}, folder / "a.safetensors")
    header_len = int.from_bytes((folder / "a.safetensors").read_bytes()[:8], "little")
    rd = Read("a.safetensors", name, "BF16", (ROWS, WIDTH), 8 + header_len, 0, ROWS)
    t = OutTensor(name=name, dtype="F8_E4M3", shape=(ROWS, WIDTH), rule="engram", action="quant_rows_fp8", reads=(rd,))
    return folder, w, t


def test_blocks_give_the_bytes_of_the_whole_tensor(table):
    folder, w, t = table
    reader = _Reader(folder, 1 << 20)
    stages: dict = {}
    try:
        got = list(stream.blocks(t, reader, quantizer_for("cpu"), 128, 0, stages))
    finally:
        reader.close()
    assert len(got) == 5  # 4 whole blocks of 128 rows and one of 40
    q, s = encode_fp8_blocks(w, (1, 32), "ue8m0")
    assert b"".join(bytes(to_bytes(o[0])) for o in got) == bytes(to_bytes(q))
    assert b"".join(bytes(to_bytes(o[1])) for o in got) == bytes(to_bytes(s))
    assert stages["read"] > 0 and stages["kernel"] > 0


def test_blocks_from_a_later_block_on(table):
    """A resumed tensor starts at block `first`."""
    folder, w, t = table
    reader = _Reader(folder, 1 << 20)
    try:
        got = list(stream.blocks(t, reader, quantizer_for("cpu"), 128, 3))
    finally:
        reader.close()
    q, _ = encode_fp8_blocks(w[3 * 128 :], (1, 32), "ue8m0")
    assert b"".join(bytes(to_bytes(o[0])) for o in got) == bytes(to_bytes(q))


class _SlowConsumerReader(_Reader):
    """Counts blocks read; fails at block `fail_at` if set."""

    def __init__(self, src, fail_at=None):
        super().__init__(src, 1 << 20)
        self.read_blocks = 0
        self.fail_at = fail_at

    def rows(self, rd, a, b, alloc=bytearray):
        if self.fail_at is not None and self.read_blocks == self.fail_at:
            raise HeaderError(f"{rd.file}: unexpected end of file (planted)")
        self.read_blocks += 1
        return super().rows(rd, a, b, alloc)


def test_reader_stays_at_most_depth_blocks_ahead(table):
    folder, _, t = table
    reader = _SlowConsumerReader(folder)
    gen = stream.blocks(t, reader, quantizer_for("cpu"), 32, 0)  # 18 blocks
    try:
        for used, _ in enumerate(gen, start=1):
            time.sleep(0.02)  # let the reader run ahead as far as it may
            # queued (DEPTH) + one read and waiting to be queued + the one being consumed
            assert reader.read_blocks - used <= stream.DEPTH + 1
    finally:
        gen.close()
        reader.close()
    assert reader.read_blocks == -(-ROWS // 32)


def test_read_error_reaches_the_consumer(table):
    folder, _, t = table
    reader = _SlowConsumerReader(folder, fail_at=2)
    got = []
    try:
        with pytest.raises(HeaderError, match="planted"):
            for outs in stream.blocks(t, reader, quantizer_for("cpu"), 128, 0):
                got.append(outs)
    finally:
        reader.close()
    assert len(got) == 2


def test_closing_early_stops_the_reader(table):
    folder, _, t = table
    reader = _SlowConsumerReader(folder)
    before = threading.active_count()
    gen = stream.blocks(t, reader, quantizer_for("cpu"), 32, 0)
    next(gen)
    gen.close()
    assert threading.active_count() == before  # the reader thread has ended
    stopped_at = reader.read_blocks
    time.sleep(0.1)
    assert reader.read_blocks == stopped_at < -(-ROWS // 32)
    reader.close()


def _settle(reads: list, n: int) -> None:
    """Wait until `n` reads happened (or 10 s), then a little longer for any read past them."""
    deadline = time.monotonic() + 10
    while len(reads) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)


def test_read_ahead_stays_within_its_budget_and_stops(tmp_path, monkeypatch):
    """ReadAhead reads the regions after the writer's tensor, never more than `ahead` bytes past it, skips
    what the writer has reached, and ends on close."""
    src = tmp_path / "f.bin"
    src.write_bytes(bytes(64 << 10))
    monkeypatch.setattr(stream.ReadAhead, "PIECE", 4096)
    reads: list[tuple[int, int]] = []
    real = stream.os.preadv

    def preadv(fd, bufs, pos):
        reads.append((pos, len(bufs[0])))
        return real(fd, bufs, pos)

    monkeypatch.setattr(stream.os, "preadv", preadv)
    regions = [(i, "f.bin", i * 8192, 8192) for i in range(8)]  # tensor i: bytes [8 KiB i, 8 KiB (i + 1))
    ra = stream.ReadAhead(tmp_path, regions, 3 * 4096)
    _settle(reads, 3)
    assert sum(n for _, n in reads) == 3 * 4096  # stopped at the budget: tensor 0 and half of tensor 1
    ra.at(2)  # the writer moved on: 0-1 free the budget; 2 is the writer's own to read; 3 and half of 4
    _settle(reads, 6)
    assert [p for p, _ in reads[3:]] == [3 * 8192, 3 * 8192 + 4096, 4 * 8192]
    ra.at(4)
    _settle(reads, 9)
    assert [p for p, _ in reads[6:]] == [5 * 8192, 5 * 8192 + 4096, 6 * 8192]
    ra.at(7)  # the last tensor: nothing left to read ahead
    _settle(reads, 9)
    assert len(reads) == 9
    ra.close()
    assert not ra._thread.is_alive()


def test_read_ahead_changes_no_byte(tmp_path, monkeypatch):
    """shard with the read-ahead thread on (as on CUDA) writes the same files."""
    from tiny_ckpt import make_tiny

    from dsv41_convert.convert import write
    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan

    src = make_tiny(tmp_path / "src", quantized=False, vision=False)
    plan = build_plan(src, 2)
    execute(plan, tmp_path / "a", workers=1)
    monkeypatch.setattr(write, "READ_AHEAD_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(write, "READ_AHEAD_BYTES", 1 << 16)
    started = []
    real = stream.ReadAhead.__init__

    def init(self, *args, **kw):
        started.append(args[1])
        real(self, *args, **kw)

    monkeypatch.setattr(stream.ReadAhead, "__init__", init)
    execute(plan, tmp_path / "b", workers=1)
    assert len(started) == 2 and all(started)
    for f in (tmp_path / "a").glob("model*"):
        assert (tmp_path / "b" / f.name).read_bytes() == f.read_bytes()


def test_one_block_is_read_without_a_thread(table, monkeypatch):
    folder, w, t = table
    reader = _Reader(folder, 1 << 20)
    started = []
    monkeypatch.setattr(stream.threading.Thread, "start", lambda self: started.append(self))
    try:
        got = list(stream.blocks(t, reader, quantizer_for("cpu"), 1024, 0))
    finally:
        reader.close()
    assert not started and len(got) == 1
    q, _ = encode_fp8_blocks(w, (1, 32), "ue8m0")
    assert bytes(to_bytes(got[0][0])) == bytes(to_bytes(q))
