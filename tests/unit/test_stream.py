"""stream.blocks: computed tensors as row blocks read ahead in a thread. Planted faults: a reader that races
ahead of the consumer (more than DEPTH blocks held), a read error mid-tensor, a consumer that stops early
(the reader must stop too), and an Engram-shaped table cut into blocks that must give the same bytes as
one whole-tensor quantization."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv41_convert.convert import stream
from dsv41_convert.convert.plan import OutTensor, Read
from dsv41_convert.convert.transform import quantizer_for, to_bytes
from dsv41_convert.convert.write import _Reader
from dsv41_convert.errors import FormatError, HeaderError
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


def test_one_block_is_read_without_a_thread(table, monkeypatch):
    """A tensor of one block is read in the caller: a reader thread for it overlaps nothing. The threads
    started are recorded and still run, so a planted `len(starts) >= 1` fails here instead of hanging."""
    folder, w, t = table
    reader = _Reader(folder, 1 << 20)
    started = []
    real_start = stream.threading.Thread.start
    monkeypatch.setattr(stream.threading.Thread, "start", lambda self: started.append(self) or real_start(self))
    try:
        got = list(stream.blocks(t, reader, quantizer_for("cpu"), 1024, 0))
    finally:
        reader.close()
    assert not started and len(got) == 1
    q, _ = encode_fp8_blocks(w, (1, 32), "ue8m0")
    assert bytes(to_bytes(got[0][0])) == bytes(to_bytes(q))


def test_cuda_blocks_travel_as_whole_rows_with_their_columns(table):
    """On CUDA a column slice is read as whole rows (the columns are selected on the GPU): the rows of
    HostRows, cut at its columns, are the CPU path's input; a block never launched gives its Prefetch
    buffer back (stream._unused)."""
    folder, w, t = table
    rd = t.reads[0]
    sliced = Read(rd.file, rd.name, rd.dtype, rd.shape, rd.offset, rd.r0, rd.r1, 64, 192)
    t2 = OutTensor(name=t.name, dtype=t.dtype, shape=(ROWS, 128), rule=t.rule, action=t.action, reads=(sliced,))
    reader = _Reader(folder, 1 << 20)
    try:
        (cpu,) = stream._read_block(t2, reader, 128, 256, form="tensors")
        (host,) = stream._read_block(t2, reader, 128, 256, form="cuda")
    finally:
        reader.close()
    assert isinstance(host, stream.HostRows) and host.cols == (64, 192)
    assert host.rows.shape == (128, WIDTH) and torch.equal(host.rows, w[128:256])
    assert torch.equal(host.rows[:, 64:192], cpu) and torch.equal(cpu, w[128:256, 64:192])

    released = []

    class Ahead:
        def release(self, buf, fence=None):
            released.append(buf)

    stream._unused([host], Ahead())
    stream._unused(None, Ahead())
    assert released == [host.buf]


def test_cuda_rows_of_a_column_slice_from_column_0_keep_their_columns(table):
    """Rank 0 of a dim-1 split reads columns [0, c1): on CUDA its whole rows travel with cols (0, c1), which
    the GPU cuts out. Bug guarded: a slice starting at column 0 taken for "every column" (cols None), so rank 0
    computes on all the columns and writes a tensor of the wrong width."""
    folder, w, t = table
    rd = t.reads[0]
    sliced = Read(rd.file, rd.name, rd.dtype, rd.shape, rd.offset, rd.r0, rd.r1, 0, WIDTH // 2)
    t0 = OutTensor(name=t.name, dtype=t.dtype, shape=(ROWS, WIDTH // 2), rule=t.rule, action=t.action, reads=(sliced,))
    reader = _Reader(folder, 1 << 20)
    try:
        (host,) = stream._read_block(t0, reader, 0, 128, form="cuda")
    finally:
        reader.close()
    assert host.cols == (0, WIDTH // 2) and host.rows.shape == (128, WIDTH)
    assert torch.equal(host.rows[:, host.cols[0] : host.cols[1]], w[:128, : WIDTH // 2])


def _fp8_source(folder: Path, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, OutTensor]:
    """A [rows, cols] e4m3 weight with 128 x 128 e8m0 scales in folder/w.safetensors, and the dequant_bf16
    tensor of it (main read, then the scale read: 128 weight rows a scale row)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(rows, cols, generator=g) * 16).to(torch.float8_e4m3fn)
    exps = torch.randint(120, 135, (-(-rows // 128), -(-cols // 128)), generator=g, dtype=torch.uint8)
    s = exps.view(torch.float8_e8m0fnu)
    path = folder / "w.safetensors"
    save_file({"w": w, "s": s}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8 : 8 + n])
    start = {k: 8 + n + v["data_offsets"][0] for k, v in meta.items() if k != "__metadata__"}
    rw = Read("w.safetensors", "w", "F8_E4M3", (rows, cols), start["w"], 0, rows)
    rs = Read("w.safetensors", "s", "F8_E8M0", tuple(s.shape), start["s"], 0, s.shape[0], ratio=128)
    t = OutTensor("w", "BF16", (rows, cols), "r", "dequant_bf16", (rw, rs), block=(128, 128))
    return w, exps, t


def test_a_last_block_short_of_a_scale_block_reads_its_scale_row(tmp_path):
    """Rows 128..199 of a 200-row fp8 weight (128 x 128 scales) are a block of 72 rows: it needs scale row 1,
    the ceiling of 200 / 128. Bug guarded: block_rows rounding a block's end scale row down, which hands the
    last block no scale rows (an error, or its rows decoded with the wrong scales); and the decode taking the
    published 32 x 32 block instead of the tensor's own. Expected bytes from the definition: each e4m3 value
    times 2 ** (its 128 x 128 block's byte - 127), rounded to bf16."""
    rows, cols = 200, 256
    w, exps, t = _fp8_source(tmp_path, rows, cols)
    scale = torch.exp2(exps.float() - 127).repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    want = (w.float() * scale).to(torch.bfloat16)
    reader = _Reader(tmp_path, 1 << 20)
    try:
        got = list(stream.blocks(t, reader, quantizer_for("cpu"), 128, 0))
    finally:
        reader.close()
    assert len(got) == 2
    assert b"".join(np.ascontiguousarray(o[0]).tobytes() for o in got) == bytes(to_bytes(want))


def test_a_1d_tensor_is_computed_and_named_as_1d(tmp_path):
    """A 1-d f32 tensor cast to bf16 in blocks of 128 elements: each block is [128] and a non-finite value is
    named by its 1-d index in the source. Bug guarded: 1-d blocks reaching the action as [rows, 1] (the
    reshape dropped), which named an inf at element 200 as index [200, 0] of an F32 [300] tensor."""
    x = torch.arange(300, dtype=torch.float32)
    bad = x.clone()
    bad[200] = float("inf")
    tensors = {}
    for file, data in (("good.safetensors", x), ("bad.safetensors", bad)):
        save_file({"b": data}, tmp_path / file)
        raw = (tmp_path / file).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        rd = Read(file, "b", "F32", (300,), 8 + n + json.loads(raw[8 : 8 + n])["b"]["data_offsets"][0], 0, 300)
        tensors[file] = OutTensor("b", "BF16", (300,), "r", "cast", (rd,))
    reader = _Reader(tmp_path, 1 << 20)
    try:
        got = [o for (o,) in stream.blocks(tensors["good.safetensors"], reader, quantizer_for("cpu"), 128, 0)]
        assert [tuple(o.shape) for o in got] == [(128,), (128,), (44,)]
        assert torch.equal(torch.cat(got), x.to(torch.bfloat16))
        with pytest.raises(FormatError, match=r"found inf at index \[200\] "):
            list(stream.blocks(tensors["bad.safetensors"], reader, quantizer_for("cpu"), 128, 0))
    finally:
        reader.close()
