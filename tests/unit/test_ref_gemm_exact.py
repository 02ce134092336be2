"""The CPU reference GEMMs (kernels/ref.py) return the same bytes as the plain per-block loop.

The loop below is the specification the faster code must keep bit for bit: widen the whole weight
(`b.float()`, fp4 through one table lookup per nibble), then for every 32-wide K block one matmul of the
strided views and `acc += partial * a_s * b_s`, in K order. The inputs are raw random bytes, so every
e4m3 / e2m1 code occurs (subnormals, +-max, -0, NaN activations), with e8m0 scales over their whole
range (2**-127 is an fp32 subnormal, 2**127 overflows a product) or fp32 scales that round.

Faults caught: any change of an output byte, e.g. a different summation order of the block partials,
the two scale products swapped (visible with fp32 scales and at the e8m0 range ends), a K block
skipped, a stale or shared scratch buffer. Not caught: a BLAS whose per-block order differs from
this build's (both sides call the same matmul).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import Tensor

from dsv41_convert.kernels import ref
from dsv41_convert.kernels.scratch import scratch
from dsv41_convert.quant.fp4 import E2M1_VALUES, decode_e2m1_pairs, unpack_nibbles


def _loop_gemm(a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, block_k: int) -> Tensor:
    m, k_total = a.shape
    acc = torch.zeros(m, b.size(0), dtype=torch.float32)
    for k in range(k_total // block_k):
        cols = slice(k * block_k, (k + 1) * block_k)
        partial = a[:, cols] @ b[:, cols].T
        acc += partial * a_s[:, k : k + 1] * b_s[:, k].unsqueeze(0)
    return acc


def _spec_fp8_gemm(a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, block: int) -> Tensor:
    k_total, n = a.size(-1), b.size(0)
    m = a.numel() // k_total
    b_s_rows = b_s.float().repeat_interleave(block, dim=0)[:n]
    c = _loop_gemm(a.reshape(m, k_total).float(), a_s.reshape(m, -1).float(), b.float(), b_s_rows, block)
    return c.to(torch.bfloat16).view(*a.shape[:-1], n)


def _spec_fp4_gemm(a: Tensor, a_s: Tensor, b: Tensor, b_s: Tensor, act_block: int) -> Tensor:
    k_total, n = a.size(-1), b.size(0)
    m = a.numel() // k_total
    a_s32 = a_s.reshape(m, -1).float().repeat_interleave(act_block // 32, dim=1)
    b32 = E2M1_VALUES[unpack_nibbles(b).long()]
    c = _loop_gemm(a.reshape(m, k_total).float(), a_s32, b32, b_s.float(), 32)
    return c.to(torch.bfloat16).view(*a.shape[:-1], n)


def _bytes(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def _e4m3(shape: tuple[int, ...], g: torch.Generator, nan: bool) -> Tensor:
    """Every e4m3 code; the two NaN codes become +-448 except, with `nan`, in the first row (random bytes hold
    a NaN every 128 codes: at K >= 256 nearly every row would be NaN whatever the scales, and check nothing)."""
    u = _bytes(shape, g)
    finite = torch.where((u & 0x7F) == 0x7F, u - 1, u)
    if nan:
        finite[..., 0, :] = u[..., 0, :]
    return finite.view(torch.float8_e4m3fn)


def _scales(shape: tuple[int, ...], g: torch.Generator, kind: str) -> Tensor:
    """e8m0: codes spread over 0 (2**-127) .. 254 (2**127), mostly near 1; fp32: random values that round."""
    if kind == "e8m0":
        u = torch.randint(117, 138, shape, dtype=torch.uint8, generator=g)
        edge = torch.rand(shape, generator=g)
        u = torch.where(edge < 0.05, torch.randint(0, 255, shape, dtype=torch.uint8, generator=g), u)
        return u.view(torch.float8_e8m0fnu)
    s = torch.rand(shape, generator=g) * 2.0 ** torch.randint(-130, 20, shape, generator=g).float()
    return s.float()


def _assert_same_bytes(new: Tensor, spec: Tensor) -> None:
    assert new.dtype == spec.dtype == torch.bfloat16 and new.shape == spec.shape
    diff = (new.view(torch.int16) != spec.view(torch.int16)).nonzero()
    assert diff.numel() == 0, f"{diff.size(0)} bytes differ, first at {diff[0].tolist()}"


FP8_CASES = [  # (lead dims, M, N, K, block, scale kind)
    ((), 1, 1, 32, 32, "e8m0"),
    ((), 1, 7, 64, 32, "e8m0"),
    ((), 1, 300, 256, 32, "e8m0"),
    ((), 2, 33, 128, 128, "fp32"),
    ((), 3, 517, 96, 32, "fp32"),
    ((), 8, 2304, 160, 32, "e8m0"),
    ((2,), 4, 70, 256, 128, "e8m0"),
    ((), 9, 257, 64, 32, "e8m0"),
    ((), 17, 100, 384, 128, "fp32"),
    ((), 64, 129, 64, 32, "e8m0"),
    ((3,), 40, 96, 128, 32, "fp32"),
]


@pytest.mark.parametrize(("lead", "m", "n", "k", "block", "kind"), FP8_CASES)
def test_fp8_gemm_bytes_equal_the_loop(lead, m, n, k, block, kind):
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    a = _e4m3((*lead, m, k), g, nan=True)
    a_s = _scales((*lead, m, k // block), g, kind)
    b = _e4m3((n, k), g, nan=False)
    b_s = _scales((-(-n // block), k // block), g, kind)
    dtype = torch.float8_e8m0fnu if kind == "e8m0" else torch.float32
    new = ref.fp8_gemm(a, a_s, b, b_s, dtype, block_size=block)
    _assert_same_bytes(new, _spec_fp8_gemm(a, a_s, b, b_s, block))


FP4_CASES = [  # (lead dims, M, N, K, activation block, activation scale kind)
    ((), 1, 1, 32, 32, "e8m0"),
    ((), 1, 2304, 256, 32, "e8m0"),
    ((), 2, 31, 128, 128, "fp32"),
    ((), 8, 513, 512, 32, "e8m0"),
    ((2,), 5, 64, 256, 128, "e8m0"),
    ((), 9, 130, 64, 32, "fp32"),
    ((), 120, 67, 128, 128, "e8m0"),
]


@pytest.mark.parametrize(("lead", "m", "n", "k", "act_block", "kind"), FP4_CASES)
def test_fp4_gemm_bytes_equal_the_loop(lead, m, n, k, act_block, kind):
    g = torch.Generator().manual_seed(m * 104729 + n * 17 + k)
    a = _e4m3((*lead, m, k), g, nan=True)
    a_s = _scales((*lead, m, k // act_block), g, kind)
    b = _bytes((n, k // 2), g).view(torch.float4_e2m1fn_x2)
    b_s = _scales((n, k // 32), g, "e8m0")
    dtype = torch.float8_e8m0fnu if kind == "e8m0" else torch.float32
    new = ref.fp4_gemm(a, a_s, b, b_s, dtype, act_block_size=act_block)
    _assert_same_bytes(new, _spec_fp4_gemm(a, a_s, b, b_s, act_block))


@pytest.mark.parametrize(("m", "n", "k", "fp4"), [(1, 5, 32, False), (8, 300, 256, True), (9, 64, 512, False)])
def test_fp32_accumulator_bytes_equal_the_loop(m, n, k, fp4):
    """Before the bf16 rounding, which hides most one-ulp differences of the fp32 sum."""
    g = torch.Generator().manual_seed(m + n + k)
    a = _e4m3((m, k), g, nan=False).float()
    a_s = _scales((m, k // 32), g, "fp32")
    b = _bytes((n, k // 2), g).view(torch.float4_e2m1fn_x2) if fp4 else _e4m3((n, k), g, nan=False)
    b32 = E2M1_VALUES[unpack_nibbles(b).long()] if fp4 else b.float()
    b_s = _scales((n, k // 32), g, "fp32")
    new = ref._blockwise_gemm(a, a_s, ref._widen(b, 32), b_s, 32)
    spec = _loop_gemm(a, a_s, b32, b_s, 32)
    assert torch.equal(new.view(torch.int32), spec.view(torch.int32))


def test_zero_weights_and_extreme_scales():
    """All-zero weights (the hollow layout) with scale code 0, and +-448 activations at scale 2**127."""
    g = torch.Generator().manual_seed(5)
    a = torch.full((8, 128), 448.0)
    a[::2] = -448.0
    a = a.to(torch.float8_e4m3fn)
    a_s = torch.full((8, 4), 254, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    b = torch.zeros(64, 128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    b_s = torch.zeros(2, 4, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    _assert_same_bytes(ref.fp8_gemm(a, a_s, b, b_s, block_size=32), _spec_fp8_gemm(a, a_s, b, b_s, 32))
    b = _e4m3((64, 128), g, nan=False)
    out = ref.fp8_gemm(a, a_s, b, b_s, block_size=32)
    _assert_same_bytes(out, _spec_fp8_gemm(a, a_s, b, b_s, 32))
    bp = torch.zeros(64, 64, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    bps = torch.zeros(64, 4, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    _assert_same_bytes(ref.fp4_gemm(a, a_s, bp, bps, act_block_size=32), _spec_fp4_gemm(a, a_s, bp, bps, 32))


def test_a_planted_one_ulp_change_is_seen(monkeypatch):
    """The comparison above sees one bf16 ulp in one element (one fp32 accumulator nudged)."""
    g = torch.Generator().manual_seed(11)
    a, a_s = _e4m3((4, 64), g, nan=False), _scales((4, 2), g, "e8m0")
    b, b_s = _e4m3((48, 64), g, nan=False), _scales((2, 2), g, "e8m0")
    spec = _spec_fp8_gemm(a, a_s, b, b_s, 32)
    _assert_same_bytes(ref.fp8_gemm(a, a_s, b, b_s, block_size=32), spec)
    real = ref._blockwise_gemm

    def nudged(*args: Tensor | int) -> Tensor:
        acc = real(*args)
        acc.view(torch.int32)[1, 3] += 1 << 16  # one bf16 ulp
        return acc

    monkeypatch.setattr(ref, "_blockwise_gemm", nudged)
    with pytest.raises(AssertionError, match="1 bytes differ, first at \\[1, 3\\]"):
        _assert_same_bytes(ref.fp8_gemm(a, a_s, b, b_s, block_size=32), spec)


def test_results_survive_the_next_gemm():
    """The widened weight lives in a reused buffer: an output never aliases it, a larger GEMM grows it."""
    g = torch.Generator().manual_seed(3)
    small = (_e4m3((2, 64), g, False), _scales((2, 2), g, "e8m0"), _e4m3((40, 64), g, False))
    big = (_e4m3((2, 256), g, False), _scales((2, 8), g, "e8m0"), _e4m3((300, 256), g, False))
    s_small, s_big = _scales((2, 2), g, "e8m0"), _scales((10, 8), g, "e8m0")
    first = ref.fp8_gemm(*small, s_small, block_size=32)
    kept = first.clone()
    second = ref.fp8_gemm(*big, s_big, block_size=32)
    third = ref.fp8_gemm(*small, s_small, block_size=32)
    assert torch.equal(first.view(torch.int16), kept.view(torch.int16))
    _assert_same_bytes(second, _spec_fp8_gemm(*big, s_big, 32))
    _assert_same_bytes(third, kept)


def test_scratch_is_per_thread():
    mine = scratch((4, 4), torch.float32, torch.device("cpu"))
    theirs: list[Tensor] = []
    t = threading.Thread(target=lambda: theirs.append(scratch((4, 4), torch.float32, torch.device("cpu"))))
    t.start()
    t.join()
    assert mine.data_ptr() != theirs[0].data_ptr()
    assert scratch((2, 8), torch.float32, torch.device("cpu")).data_ptr() == mine.data_ptr()


def test_decode_e2m1_pairs_every_byte():
    b = torch.arange(256, dtype=torch.uint8).view(16, 16)
    want = E2M1_VALUES[unpack_nibbles(b).long()]
    got = decode_e2m1_pairs(b.view(torch.float4_e2m1fn_x2))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 kept
    out = torch.empty(16, 32)
    assert decode_e2m1_pairs(b, out=out) is out
    with pytest.raises(ValueError, match="out"):
        decode_e2m1_pairs(b, out=torch.empty(16, 31))


def test_parameters_that_require_grad():
    """Model weights and scales are nn.Parameters (requires_grad=True outside no_grad): accepted, same bytes."""
    g = torch.Generator().manual_seed(13)
    a, a_s = _e4m3((3, 64), g, nan=False), _scales((3, 2), g, "fp32")
    b, b_s = _e4m3((40, 64), g, nan=False), _scales((2, 2), g, "fp32")
    w, s = torch.nn.Parameter(b), torch.nn.Parameter(b_s)
    assert w.requires_grad and s.requires_grad
    _assert_same_bytes(ref.fp8_gemm(a, a_s, w, s, torch.float32, block_size=32), _spec_fp8_gemm(a, a_s, b, b_s, 32))


def test_a_strided_weight():
    """A transposed weight (strides (1, N): no view into K blocks) gives the loop's bytes."""
    g = torch.Generator().manual_seed(17)
    a, a_s = _e4m3((5, 64), g, nan=False), _scales((5, 2), g, "e8m0")
    b = _e4m3((64, 40), g, nan=False).T
    b_s = _scales((2, 2), g, "e8m0")
    assert not b.is_contiguous()
    _assert_same_bytes(ref.fp8_gemm(a, a_s, b, b_s, block_size=32), _spec_fp8_gemm(a, a_s, b, b_s, 32))
    bp = _bytes((32, 40), g).T.view(torch.float4_e2m1fn_x2)
    bps = _scales((40, 2), g, "e8m0")
    _assert_same_bytes(ref.fp4_gemm(a, a_s, bp, bps, act_block_size=32), _spec_fp4_gemm(a, a_s, bp, bps, 32))


@pytest.mark.parametrize(("k", "act_block"), [(256, 128), (512, 128), (128, 32)])
def test_fp4_gemm_activation_scale_covers_its_own_k_columns(k, act_block):
    """Each activation scale covers act_block consecutive K columns (act_block / 32 weight groups in a row).
    Finite activations (the cases above put a NaN in every row once K >= 256, which hides any scale
    mix-up) and a different scale per activation block."""
    g = torch.Generator().manual_seed(k + act_block)
    m, n = 6, 40
    a = _e4m3((m, k), g, nan=False)
    a_s = torch.exp2(torch.randint(-4, 5, (m, k // act_block), generator=g).float())
    b = _bytes((n, k // 2), g).view(torch.float4_e2m1fn_x2)
    b_s = torch.randint(120, 135, (n, k // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    out = ref.fp4_gemm(a, a_s, b, b_s, torch.float32, act_block_size=act_block)
    assert not out.isnan().any()
    _assert_same_bytes(out, _spec_fp4_gemm(a, a_s, b, b_s, act_block))
