"""Every TileLang kernel factory still lowers and compiles for Hopper, without a GPU.

TileLang builds CUDA kernels on a machine with nvcc and no GPU when given an explicit target; this
catches a kernel that no longer lowers (a TileLang upgrade, an edit) on CPU-only CI. sm_90a is the
H100/H200 target TileLang picks on those GPUs (wgmma and register reallocation need the 'a').
Skipped where tilelang or nvcc is missing.

Besides one representative configuration per factory, the GEMM kernels the published model's warm-up
compiles, at its real shapes: the GPU tests multiply at K <= 7168, the real checkpoint has K up to 15360
(the MTP's main_proj), and a kernel that does not lower there failed only on a GPU run of the whole model
(the activation scales' TMA box, docs/BENCHMARKS.md "Gemms, 2026-12-02, session 13"). Every distinct fp8
weight shape of the published headers (per rank at tp 1 and 8, split as `shard` splits it) goes through
fp8_gemm's kernel factory on every tile, every routed-expert shape through fp4_gemm's own kernel on its
tiles, with the exact arguments the wrappers pass.
"""

import gzip
import importlib.util
import json
import shutil

import pytest
from reference_data import HEADERS_GZ

# a deprecated tilelang API is an error here: the pin allows newer 0.1.x releases, which remove what 0.1.15
# deprecates (T.symbolic was), and these are the only tests that build every kernel on the CPU
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("error::DeprecationWarning:tilelang.*")]

if importlib.util.find_spec("tilelang") is None or shutil.which("nvcc") is None:
    pytest.skip("needs tilelang and nvcc", allow_module_level=True)

from dsv41_convert.convert.rules import Op, Split, canonical_name, classify  # noqa: E402
from dsv41_convert.kernels import block_gemm, fp4_gemm, fp8_gemm  # noqa: E402

TARGET = {"kind": "cuda", "arch": "sm_90a"}
TPS = (1, 8)  # tensor-parallel sizes whose per-rank weight shapes the GEMMs are lowered at


def cuda_source(jit, *args, **kw) -> str:
    """The CUDA source of TileLang factory `jit` lowered for sm_90a with these compile-time arguments."""
    import tilelang

    return tilelang.compile(jit.get_tir(*args, **kw), target=TARGET, pass_configs=jit.pass_configs).get_kernel_source()


# (module, factory, compile-time arguments): one representative configuration per factory
CASES = [
    ("fp8_quant", "fp8_quant_kernel", (200, 32, 32, "bfloat16", True)),
    ("row_quant", "row_quant_kernel", (1024, 32, "bfloat16", "e4m3", "e8m0", False, 4)),
    ("row_quant", "row_quant_kernel", (1024, 128, "float32", "e4m3", "f32", True, 4)),
    ("row_quant", "row_quant_kernel", (1024, 32, "bfloat16", "e2m1", "e8m0", False, 2)),
    ("row_quant", "row_quant_kernel", (200, 16, "float16", "e2m1", "e4m3", True, 2)),
    ("fp8_dequant", "fp8_dequant_kernel", (1024, 128, 128, False, "bfloat16")),
    ("fp4_dequant", "fp4_dequant_kernel", (1024, 32, "bfloat16")),
    ("fp4_dequant", "fp4_dequant_kernel", (200, 32, "float32")),
    ("fp4_to_fp8", "fp4_to_fp8_kernel", (1024,)),
    ("hc_split_sinkhorn", "hc_split_sinkhorn_kernel", (4, 20, 1e-6)),
    # fp8_gemm and fp4_gemm, on their tiles (block_gemm.FP8_TILES, FP4_TILES); the last has too many
    # scales to hoist into shared memory (2 MiB) and reads them where used
    ("block_gemm", "block_gemm_kernel", (512, 1024, 32, 32, 32, False, True, True, 4, (64, 128, 128))),
    ("block_gemm", "block_gemm_kernel", (512, 1024, 32, 32, 32, False, True, True, 4, (64, 64, 128))),
    ("block_gemm", "block_gemm_kernel", (256, 1024, 32, 128, 1, True, False, True, 3, (128, 128, 256))),
    ("block_gemm", "block_gemm_kernel", (256, 1024, 32, 128, 1, True, False, True, 3, (64, 64, 256))),
    ("block_gemm", "block_gemm_kernel", (512, 65536, 32, 32, 32, False, False, False, 4, (128, 128, 256))),
    # the fp4 kernel with 480 activation scales a row, more than one TMA box takes (fp8 at the real model's
    # shapes, K = 15360 among them: test_fp8_gemm_lowers_at_the_real_shapes below)
    ("block_gemm", "block_gemm_kernel", (256, 15360, 32, 32, 1, True, True, True, 3, (64, 64, 256))),
    # one K block per stage, one partial tile (no ping-pong)
    (
        "block_gemm",
        "block_gemm_kernel",
        (512, 1024, 32, 32, 32, False, True, True, 4, (128, 128, 256), True, 32, False),
    ),
    ("sparse_attn", "sparse_attn_kernel", (16, 512, 200)),
    ("sparse_attn", "sparse_attn_kernel", (8, 512, 1024)),  # V4.1-Flash at tp 8: 8 heads, fewer than a CTA's 16
]


@pytest.fixture(scope="module", autouse=True)
def no_kernel_cache():
    import tilelang

    tilelang.disable_cache()  # compile for real, every run
    yield
    tilelang.enable_cache()


@pytest.mark.parametrize("module,factory,args", CASES, ids=[f"{c[0]}-{'-'.join(map(str, c[2]))}" for c in CASES])
def test_kernel_compiles_for_sm90(module, factory, args):
    source = cuda_source(getattr(importlib.import_module(f"dsv41_convert.kernels.{module}"), factory), *args)
    assert "__global__" in source
    if module.endswith("gemm"):
        assert "wgmma" in source, "the gemm should run on Hopper's wgmma"


@pytest.mark.parametrize(
    "fp4,tile,depth", [(False, (128, 128, 256), 2), (True, (128, 128, 256), 2), (False, (64, 64, 128), 3)]
)
def test_gemm_stage_released_after_its_matmuls(fp4, tile, depth):
    """With ping-pong the K blocks' matmuls are asynchronous: the consumers may release a pipeline stage
    (arrive on its empty barrier, letting the producer overwrite its tiles) only when no matmul is still
    pending (after `wait_wgmma<0>`). A release with a matmul in flight is a race: bytes that differ run to
    run. (TileLang places the release after the last statement that touches the tiles; block_gemm touches
    them after the wait for that reason.)"""
    import re

    b_rows = 1 if fp4 else 32
    args = (512, 1024, 32, 32, b_rows, fp4, True, True, 3, tile, True, 128, True, depth)
    source = cuda_source(block_gemm.block_gemm_kernel, *args)
    consumer = source[source.index("warpgroup_reg_alloc<240>") :]
    tokens = re.findall(r"(wgmma_ss<)|wait_wgmma<(\d)>|(mbarrier\[[^\]]*\]\.arrive\(\))", consumer)
    pending, releases, mmas, max_pending = 0, 0, 0, 0
    for mma, wait, release in tokens:
        if mma:
            pending, mmas = pending + 1, mmas + 1
            max_pending = max(max_pending, pending)
        elif wait:
            pending = min(pending, int(wait))
        elif release:
            assert pending == 0, f"a stage is released with {pending} matmul(s) in flight"
            releases += 1
    assert max_pending == depth, f"{max_pending} matmuls in flight at most, want {depth}"
    assert mmas >= 4 and releases >= 1, f"expected the K loop's matmuls and releases, found {mmas} and {releases}"


# --- the CUDA C helpers (kernels/device_c.py), compiled for the host and checked against quant/ ------------

HOST_SHIM = r"""
#include <cstring>
#include <cmath>
#include <algorithm>
#define __device__
#define __forceinline__ inline
using std::max;
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned char b[8]; std::memcpy(b, &x, 4); std::memcpy(b + 4, &y, 4); unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)b[(s >> (4 * i)) & 7] << (8 * i);
  return r;
}
static inline unsigned __vmaxu2(unsigned a, unsigned b) {
  return std::max(a & 0xFFFFu, b & 0xFFFFu) | (std::max(a >> 16, b >> 16) << 16);
}
"""

HOST_API = r"""
extern "C" {
void e2m1_codes(const float* y, int n, unsigned char* out) { for (int i = 0; i < n; ++i) out[i] = tl_e2m1_code(y[i]); }
void e2m1x8_bf16(const unsigned short* x, int n8, const float* inv, unsigned* out) {
  for (int i = 0; i < n8; ++i) tl_e2m1x8_bf16(x + 8 * i, inv[i], out + i);
}
void absmax_bf16x8(const unsigned short* x, int n8, unsigned* out) {
  for (int i = 0; i < n8; ++i) out[i] = tl_absmax_bf16x8(x + 8 * i);
}
void div_rn(const float* x, const float* s, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = tl_div_rn(x[i], s[i], 1.0f / s[i]);
}
void fp4_to_e4m3(const unsigned* w, int n, const int* d, unsigned char* out) {
  for (int i = 0; i < n; ++i) tl_fp4_to_e4m3(w + i, 1, d[i], out + 8 * i);
}
void mxfp4_to_bf16(const unsigned* w, int n, const unsigned* b, unsigned short* out) {
  for (int i = 0; i < n; ++i) tl_mxfp4_to_bf16(w + i, 1, b[i], out + 8 * i);
}
}
"""


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    import ctypes
    import subprocess

    from dsv41_convert.kernels.device_c import PRELUDE

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    d = tmp_path_factory.mktemp("device_c")
    (d / "helpers.cpp").write_text(HOST_SHIM + PRELUDE + HOST_API)
    cmd = ["g++", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(d / "helpers.so"), str(d / "helpers.cpp")]
    subprocess.run(cmd, check=True, capture_output=True)
    return ctypes.CDLL(str(d / "helpers.so"))


def _ptr(t):
    import ctypes

    return ctypes.c_void_p(t.data_ptr())


def test_device_e2m1_code_matches_reference(host_lib):
    import torch

    from dsv41_convert.quant.fp4 import encode_e2m1

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    mids = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, float("inf"), float("nan")])
    near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 9.0)), torch.nextafter(mids, -mids - 1)])
    y = torch.cat([bits.view(torch.float32), near, -near, torch.rand(1 << 16, generator=g) * 8])
    out = torch.empty(y.numel(), dtype=torch.uint8)
    host_lib.e2m1_codes(_ptr(y), y.numel(), _ptr(out))
    assert torch.equal(out, encode_e2m1(y))


def test_device_bf16_mxfp4_encode_matches_reference(host_lib):
    import torch

    from dsv41_convert.quant.fp4 import encode_mxfp4

    g = torch.Generator().manual_seed(1)
    w = torch.randn(4096, 32, generator=g) * torch.exp2(torch.randint(-30, 30, (4096, 1), generator=g).float())
    w[:8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(4) * 2.0 ** torch.arange(8)[:, None]
    w[8:16] = 1e-39 * torch.randn(8, 32, generator=g)  # bf16 subnormals
    w = w.to(torch.bfloat16)
    packed, s = encode_mxfp4(w, 32, "w")
    inv = torch.exp2(127 - s.view(torch.uint8).float()).repeat_interleave(4)  # 1/s per 8 values
    got = torch.empty(w.numel() // 8, dtype=torch.int32)
    amax = torch.empty(w.numel() // 8, dtype=torch.int32)
    host_lib.e2m1x8_bf16(_ptr(w), w.numel() // 8, _ptr(inv), _ptr(got))
    host_lib.absmax_bf16x8(_ptr(w), w.numel() // 8, _ptr(amax))
    assert torch.equal(got.view(torch.uint8).view(4096, 16), packed.view(torch.uint8))
    want_amax = w.float().abs().view(-1, 8).amax(-1)
    assert torch.equal(amax.view(torch.float32), want_amax)


def test_device_division_is_correctly_rounded(host_lib):
    import torch

    g = torch.Generator().manual_seed(2)
    n = 1 << 20
    s = (torch.rand(n, generator=g) + 1) * torch.exp2(torch.randint(-9, 120, (n,), generator=g).float())
    s[::3] = torch.exp2(torch.randint(-9, 8, (s[::3].numel(),), generator=g).float()) * 1.375  # e4m3-like
    x = torch.randn(n, generator=g) * s * torch.exp2(torch.randint(-12, 10, (n,), generator=g).float())
    x[::5] = (torch.randint(-900, 900, (x[::5].numel(),), generator=g).float() / 2 + 0.25) * s[::5]  # near ties
    x = torch.where(x.isfinite(), x, 1.0)  # finite inputs only (the kernels divide plainly otherwise)
    x[:4] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])
    got = torch.empty(n)
    host_lib.div_rn(_ptr(x), _ptr(s), n, _ptr(got))
    want = x / s
    exact = want.abs() >= 2.0**-100
    assert torch.equal(got.view(torch.int32)[exact], want.view(torch.int32)[exact])
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0 / s stays -0
    assert bool(((got - want).abs() <= 2.0**-120).all())


def test_device_fp4_decoders_match_reference(host_lib):
    import torch

    from dsv41_convert.quant.fp4 import E2M1_VALUES, decode_mxfp4

    g = torch.Generator().manual_seed(3)
    n = 1 << 16
    w = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    codes = torch.stack([(w >> (4 * i)) & 15 for i in range(8)], -1)  # [n, 8], element order
    d = torch.randint(-5, 7, (n,), generator=g, dtype=torch.int32)
    got = torch.empty(n, 8, dtype=torch.uint8)
    host_lib.fp4_to_e4m3(_ptr(w), n, _ptr(d), _ptr(got))
    vals = E2M1_VALUES[codes.long()] * torch.exp2(d.float())[:, None]
    want = torch.where(codes % 8 == 0, 0.0, vals).to(torch.float8_e4m3fn).view(torch.uint8)  # -0 -> +0
    assert torch.equal(got, want)
    b = torch.randint(2, 253, (n,), generator=g, dtype=torch.int32)
    got16 = torch.empty(n, 8, dtype=torch.bfloat16)
    host_lib.mxfp4_to_bf16(_ptr(w), n, _ptr(b), _ptr(got16))
    want16 = decode_mxfp4(w.view(torch.uint8).view(n, 4), b.to(torch.uint8).view(torch.float8_e8m0fnu)[:, None], 8)
    assert torch.equal(got16.view(torch.int16), want16.view(torch.int16))


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
    given = []
    monkeypatch.setattr(module, "block_gemm_kernel", lambda *args, **kw: given.append((args, kw)))
    call()
    (args, kw), *_ = given
    return cuda_source(block_gemm.block_gemm_kernel, *args, **kw)


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
