"""The gemm's host-side choices, without a GPU: which tile a wrapper launches, and the e2m1 -> e4m3 table
the kernel widens fp4 weights with."""

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
    assert block_gemm.pick_tile(128, 4096, h200, tiles) == few  # the bench's decode-sized shape
    assert block_gemm.pick_tile(4096, 4096, h200, tiles) == many
    # the switch: exactly one CTA per SM (132 = 4 x 33 column blocks) takes the many-rows tile, one row
    # block fewer does not
    n = 33 * many[1]
    assert block_gemm.pick_tile(4 * many[0], n, h200, tiles) == many
    assert block_gemm.pick_tile(3 * many[0], n, h200, tiles) == few


def test_e2m1_e4m3_table_holds_each_magnitude_as_e4m3():
    table = [(word >> (8 * i)) & 0xFF for word in block_gemm.E2M1_E4M3_TABLE for i in range(4)]
    want = E2M1_VALUES[:8].to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert table == want
