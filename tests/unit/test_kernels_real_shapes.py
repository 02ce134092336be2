"""The GEMM kernels the published model's warm-up compiles, lowered for Hopper at its real shapes, without a GPU.

The GPU tests multiply at K <= 7168; the real checkpoint has K up to 15360 (the MTP's main_proj), and a
kernel that does not lower there fails only on a GPU run of the whole model (it did: the activation scales'
TMA box, docs/BENCHMARKS.md "Gemms, 2026-12-02, session 13"). Here every distinct fp8 weight shape of the
published headers (per rank at tp 1 and 8, split as `shard` splits it) goes through fp8_gemm's kernel
factory on every tile, and every routed-expert shape through fp4_gemm's own kernel on its tiles, with the
exact arguments the wrappers pass. Skipped where tilelang or nvcc is missing.
"""

import gzip
import importlib.util
import json
import shutil

import pytest
from reference_data import HEADERS_GZ

pytestmark = pytest.mark.slow

if importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None:
    pytest.skip("needs tilelang and nvcc", allow_module_level=True)

from dsv41_convert.convert.rules import Op, Split, canonical_name, classify  # noqa: E402
from dsv41_convert.kernels import block_gemm, fp4_gemm, fp8_gemm  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90a"}
TPS = (1, 8)


def real_gemm_shapes() -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """({(n, k)} of the fp8 linear weights, {(n, k)} of the routed experts, k logical) on one rank."""
    fp8, fp4 = set(), set()
    for header in json.loads(gzip.decompress(HEADERS_GZ.read_bytes()))["shards"].values():
        for name, info in header["tensors"].items():
            rule, _ = classify(canonical_name(name))
            n, k = info["shape"] if len(info["shape"]) == 2 else (0, 0)
            if rule.op is Op.AS_FP4:
                fp4.add((n, 2 * k))
            elif rule.op is Op.FP8:
                for tp in TPS:
                    rows, cols = {Split.DIM0: (tp, 1), Split.DIM1: (1, tp)}.get(rule.split, (1, 1))
                    fp8.add((n // rows, k // cols))
    return fp8, fp4


FP8_SHAPES, FP4_SHAPES = (sorted(s) for s in real_gemm_shapes())


def test_the_headers_hold_the_shapes_that_matter():
    assert (5120, 15360) in FP8_SHAPES  # mtp.0.main_proj
    assert (5120, 8192) in FP8_SHAPES and (5120, 1024) in FP8_SHAPES  # wo_b at tp 1 and 8
    assert FP4_SHAPES == [(2304, 5120), (5120, 2304)]


def lower(module, call, monkeypatch) -> str:
    """Call `call` with module.block_gemm_kernel recorded instead of compiled, then lower what it was given
    for sm_90a: -> the kernel's CUDA source."""
    import tilelang

    given = []
    monkeypatch.setattr(module, "block_gemm_kernel", lambda *args, **kw: given.append((args, kw)))
    call()
    (args, kw), *_ = given
    jit = block_gemm.block_gemm_kernel
    return tilelang.compile(jit.get_tir(*args, **kw), target=TARGET, pass_configs=jit.pass_configs).get_kernel_source()


@pytest.mark.parametrize("tile", list(block_gemm.FP8_TILES), ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("n,k", FP8_SHAPES)
def test_fp8_gemm_lowers_at_the_real_shapes(n, k, tile, monkeypatch):
    source = lower(fp8_gemm, lambda: fp8_gemm.fp8_gemm_kernel(n, k, 32, True, tile), monkeypatch)
    assert "wgmma" in source


@pytest.mark.parametrize("tile", list(block_gemm.FP4_TILES), ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("n,k", FP4_SHAPES)
def test_fp4_gemm_lowers_at_the_real_expert_shapes(n, k, tile, monkeypatch):
    source = lower(fp4_gemm, lambda: fp4_gemm.fp4_gemm_kernel(n, k, 32, True, tile), monkeypatch)
    assert "wgmma" in source
