"""The streaming GPU path (convert/stream.py) on an Engram-shaped table of 1.5 GiB: cut into row blocks,
the GPU never holds the table (peak GPU memory a few blocks), and the bytes equal the CPU path's.
Planted fault it catches: a block boundary that drops, repeats or reorders rows (bytes differ), a
pipeline that keeps every block on the GPU (the memory bound fails)."""

import pytest
import torch
from safetensors.torch import save_file

from dsv41_convert.convert import stream
from dsv41_convert.convert.plan import OutTensor, Read
from dsv41_convert.convert.transform import quantizer_for, to_bytes
from dsv41_convert.convert.write import _Reader
from dsv41_convert.quant.fp8 import encode_fp8_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ROWS, WIDTH = 3 * 2**20 + 136, 256  # 1.5 GiB of bf16; the last block is short


def test_engram_table_in_row_blocks(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    name = "layers.1.engram.embed.weight"
    w = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    save_file({name: w}, tmp_path / "a.safetensors")
    header_len = int.from_bytes((tmp_path / "a.safetensors").read_bytes()[:8], "little")
    rd = Read("a.safetensors", name, "BF16", (ROWS, WIDTH), 8 + header_len, 0, ROWS)
    t = OutTensor(name=name, dtype="F8_E4M3", shape=(ROWS, WIDTH), rule="engram", action="quant_rows_fp8", reads=(rd,))
    step = stream.GPU_BLOCK_BYTES // (WIDTH * 2)
    reader = _Reader(tmp_path, 1 << 20)
    torch.cuda.reset_peak_memory_stats()
    stages: dict = {}
    q_parts, s_parts = [], []
    try:
        for q, s in stream.blocks(t, reader, quantizer_for("cuda"), step, 0, stages):
            q_parts.append(bytes(to_bytes(q)))
            s_parts.append(bytes(to_bytes(s)))
    finally:
        reader.close()
    peak = torch.cuda.max_memory_allocated()
    assert len(q_parts) == -(-ROWS // step) > 20
    assert peak < 8 * stream.GPU_BLOCK_BYTES, peak  # a few blocks, never the 1.5 GiB table
    q_all, s_all = b"".join(q_parts), b"".join(s_parts)
    for k in range(0, ROWS, 2**20):  # the CPU reference, a slice at a time (same bytes: row blocks)
        q, s = encode_fp8_blocks(w[k : k + 2**20], (1, 32), "ue8m0")
        a, b = k * WIDTH, (k + q.shape[0]) * WIDTH
        assert q_all[a:b] == bytes(to_bytes(q)), k
        assert s_all[a // 32 : b // 32] == bytes(to_bytes(s)), k
    assert all(stages[k] > 0 for k in ("read", "h2d", "kernel", "d2h"))
