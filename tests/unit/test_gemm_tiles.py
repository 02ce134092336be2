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


FEW, MID, MANY = block_gemm.FP8_TILES  # fp8: 64 x 64, 64 x 128, 128 x 128


@pytest.mark.parametrize(
    ("m", "n", "want"),
    [
        (1, 4096, FEW),
        (64, 4096, FEW),  # 64 CTAs either way: 149 against 102 (64 x 128) TFLOP/s, queued
        (128, 4096, FEW),  # 128 CTAs in one wave: 224 against 202 (64 x 128) and 123 (128 x 128)
        (192, 4096, MID),  # 286 against 199 (64 x 64, two waves) and 183 (128 x 128, half a wave)
        (256, 4096, MID),  # 308 against 238 and 243
        (320, 4096, MANY),  # 293 against 224 and 248
        (512, 4096, MANY),  # 128 CTAs, one wave: 455 against 255 and 339
        (640, 4096, MID),  # 318 against 307 (128 x 128: 160 CTAs in two waves)
        (4096, 4096, MANY),
        (128, 2304, FEW),  # 164 against 112 and 68
        (384, 2304, MID),  # 313 against 234 and 203
        (512, 2304, MANY),  # 269 against 225 and 228
        (128, 5120, MID),  # 188 against 132 and 132
        (256, 5120, MANY),  # 260 against 176 and 196
    ],
)
def test_pick_tile_takes_the_fastest_measured_fp8_tile(h200, m, n, want):
    """Rows of the H200 measurement behind FP8_TILES' rates ("Gemms, 2026-12-02, session 13")."""
    assert block_gemm.pick_tile(m, n, h200, block_gemm.FP8_TILES) == want


@pytest.mark.parametrize("tiles", [block_gemm.FP8_TILES, block_gemm.FP4_TILES], ids=["fp8", "fp4"])
def test_pick_tile_ends_the_waves_first(h200, tiles):
    """One wave of the biggest tile (one CTA per SM): it is taken from the rows where that wave ends before
    every other tile's waves, and not at half its rows once one CTA more makes two waves."""
    few, *_, many = tiles
    n = SMS * many[1]

    def waves(m, tile):
        return -(-(-(-m // tile[0]) * -(-n // tile[1])) // SMS)

    def big_first(m):  # the biggest tile's one wave ends before every other tile's waves
        return all(
            waves(m, many) * many[0] * many[1] / tiles[many] <= waves(m, t) * t[0] * t[1] / tiles[t] for t in tiles
        )

    least = next(m for m in range(1, many[0] + 1) if big_first(m))
    assert block_gemm.pick_tile(least, n, h200, tiles) == many
    assert least == 1 or block_gemm.pick_tile(least - 1, n, h200, tiles) != many
    assert block_gemm.pick_tile(many[0], n, h200, tiles) == many
    assert block_gemm.pick_tile(many[0] // 2, n + many[1], h200, tiles) != many  # 133 CTAs: two waves, a quarter full
    assert block_gemm.pick_tile(1, 4096, h200, tiles) == few


def test_pick_tile_takes_the_first_of_equal_tiles(h200):
    tiles = {(64, 64, 128): 100, (64, 128, 128): 200}  # the same cost per output
    assert block_gemm.pick_tile(64, 4096, h200, tiles) == (64, 64, 128)  # one wave each
    assert block_gemm.pick_tile(64, 4096, h200, dict(reversed(tiles.items()))) == (64, 128, 128)


def test_e2m1_e4m3_table_holds_each_magnitude_as_e4m3():
    table = [(word >> (8 * i)) & 0xFF for word in block_gemm.E2M1_E4M3_TABLE for i in range(4)]
    want = E2M1_VALUES[:8].to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert table == want


def test_compile_tiles_builds_every_tile_once_side_by_side():
    """Each tile built once, in the tiles' order, all at the same time (each build waits for the others)."""
    import threading

    tiles = tuple(block_gemm.FP8_TILES)
    meet = threading.Barrier(len(tiles), timeout=10)
    built = []

    def build(tile):
        built.append(tile)
        meet.wait()  # raises BrokenBarrierError unless every tile's build runs at once
        return ("kernel", tile)

    got = block_gemm.compile_tiles(build, tiles)
    assert list(got) == list(tiles) and sorted(built) == sorted(tiles)
    assert all(got[tile] == ("kernel", tile) for tile in tiles)
