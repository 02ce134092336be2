"""bench_kernels' report gives the GEMMs' queued and graphed (goal 2's) figures, each with fp8_gemm's share of
cuBLAS's: at 128 rows a queued cuBLAS call is the host's pace (docs/BENCHMARKS.md, "GEMMs with the host taken
out"), so the two differ, and the report must not give one for the other."""

from __future__ import annotations

from bench_modules import fresh_bench_module


def test_the_gemm_lines_give_the_queued_and_the_graphed_shares(monkeypatch):
    kernels = fresh_bench_module(monkeypatch, "bench_kernels")
    row = {
        "M": 128, "N": 4096, "K": 7168, "tiles_TFLOPs": {t: (1.0, 1.0) for t in kernels.GEMM_TILES},
        "tiles_same_bytes": True,
        "fp8_gemm_TFLOPs": 150.0, "fp4_gemm_TFLOPs": 100.0, "_scaled_mm_tensorwise_TFLOPs": 180.0,
        "bf16_matmul_TFLOPs": 160.0,
        "queued_TFLOPs": {"fp8_gemm": 205.0, "fp4_gemm": 145.0, "_scaled_mm": 279.0},
        "graphed_TFLOPs": {"fp8_gemm": 222.0, "fp4_gemm": 154.0, "_scaled_mm": 722.0},
    }  # fmt: skip
    text = kernels.markdown([], [row], "a GPU", "now")
    queued = next(line for line in text.splitlines() if line.startswith("Queued"))
    graphed = next(line for line in text.splitlines() if line.startswith("Graphed"))
    assert "fp8_gemm 205, fp4_gemm 145, _scaled_mm 279 (fp8_gemm / _scaled_mm 73%)" in queued, queued
    assert "fp8_gemm 222, fp4_gemm 154, _scaled_mm 722 (fp8_gemm / _scaled_mm 31%)" in graphed, graphed
    del row["graphed_TFLOPs"]["_scaled_mm"]  # not captured: no share said
    assert "/ _scaled_mm" not in next(x for x in kernels.markdown([], [row], "g", "t").splitlines() if "Graphed" in x)
