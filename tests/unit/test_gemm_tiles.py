"""The gemm's host-side choices, without a GPU: which tile a wrapper launches, and the e2m1 -> e4m3 table
the kernel widens fp4 weights with."""

import math

import pytest
import torch

pytest.importorskip("tilelang")

from dsv41_convert.kernels import block_gemm
from dsv41_convert.quant.fp4 import E2M1_VALUES

SMS = 132  # an H100/H200


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(block_gemm, "_sm_count", lambda device: SMS)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("tiles", [block_gemm.FP8_TILES, block_gemm.FP4_TILES], ids=["fp8", "fp4"])
def test_pick_tile_few_rows_then_many(h200, tiles):
    few, many = tiles
    assert block_gemm.pick_tile(1, 4096, h200, tiles) == few
    assert block_gemm.pick_tile(128, 4096, h200, tiles) == few  # the bench's decode-sized shape: fill 0.24
    assert block_gemm.pick_tile(192, 4096, h200, tiles) == few  # fill 0.36: 201 against 183 TFLOP/s (fp8)
    assert block_gemm.pick_tile(512, 4096, h200, tiles) == many  # 128 CTAs, fill 0.97: 451 against 255
    assert block_gemm.pick_tile(640, 4096, h200, tiles) == many  # 160 CTAs in 2 waves, fill 0.61: 305 / 258
    assert block_gemm.pick_tile(4096, 4096, h200, tiles) == many


@pytest.mark.parametrize("tiles", [block_gemm.FP8_TILES, block_gemm.FP4_TILES], ids=["fp8", "fp4"])
def test_pick_tile_switches_at_the_fill(h200, tiles):
    """One wave of the many-rows tile (one CTA per SM): its fill is m / bm, and the switch is at MANY_FILL;
    one column block more makes two waves, half as full."""
    few, many = tiles
    n = SMS * many[1]
    least = math.ceil(block_gemm.MANY_FILL * many[0])
    assert block_gemm.pick_tile(least, n, h200, tiles) == many
    assert block_gemm.pick_tile(least - 1, n, h200, tiles) == few
    assert block_gemm.pick_tile(many[0], n, h200, tiles) == many
    assert block_gemm.pick_tile(many[0], n + many[1], h200, tiles) == many  # 133 CTAs: 2 waves, fill 0.504
    assert block_gemm.pick_tile(least, n + many[1], h200, tiles) == few  # the same, times m / bm


def test_e2m1_e4m3_table_holds_each_magnitude_as_e4m3():
    table = [(word >> (8 * i)) & 0xFF for word in block_gemm.E2M1_E4M3_TABLE for i in range(4)]
    want = E2M1_VALUES[:8].to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert table == want
