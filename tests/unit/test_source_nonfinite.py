"""quant/byte_checks.first_nonfinite, the scan of bytes copied or cast unchanged, against torch's own
decoding of every code (8- and 16-bit dtypes exhaustively, 32- and 64-bit at their edges)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsv41_convert.quant.byte_checks import NONFINITE_BITS, first_nonfinite

TORCH = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}
BITS_AS = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def _values(codes: np.ndarray, dtype: str) -> torch.Tensor:
    """The codes decoded by torch (the independent reference), as float64."""
    raw = torch.from_numpy(codes.copy())
    return raw.view(TORCH[dtype]).to(torch.float64)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "F8_E8M0", "BF16", "F16"])
def test_every_code_is_classed_as_torch_decodes_it(dtype):
    kind = NONFINITE_BITS[dtype][0]
    codes = np.arange(np.iinfo(kind).max + 1, dtype=np.uint64).astype(kind)
    values = _values(codes, dtype).tolist()
    for code, value in zip(codes, values, strict=True):
        found = first_nonfinite(code.tobytes(), dtype)
        if math.isfinite(value):
            assert found is None, (dtype, hex(code), value)
        else:
            assert found is not None and found[0] == 0 and _same(found[1], value), (dtype, hex(code), value, found)
    assert sum(not math.isfinite(v) for v in values) > 0  # each format has some


@pytest.mark.parametrize("dtype", ["F32", "F64"])
def test_wide_floats_at_their_edges(dtype):
    t = TORCH[dtype]
    info = torch.finfo(t)
    finite = [0.0, -0.0, info.tiny, info.smallest_normal / 4, info.max, -info.max, 1.5, -(2.0**-100)]
    x = torch.tensor(finite, dtype=t)
    assert first_nonfinite(x.numpy().tobytes(), dtype) is None
    payloads = [0x7FC00001, 0xFFC00000, 0x7F800001] if dtype == "F32" else [0x7FF8000000000001, 0xFFF8000000000000]
    for bad in [math.inf, -math.inf, math.nan]:
        y = x.clone()
        y[5] = bad
        index, value = first_nonfinite(y.numpy().tobytes(), dtype)
        assert index == 5 and _same(value, bad)
    for bits in payloads:  # NaNs with other payloads and signs, signalling ones too
        raw = x.view(BITS_AS[x.element_size()]).clone()
        raw[3] = bits if bits < 2**63 else bits - 2**64
        index, value = first_nonfinite(raw.numpy().tobytes(), dtype)
        assert index == 3 and math.isnan(value)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "BF16", "F32"])
def test_the_first_of_several_is_named_and_only_whole_elements_count(dtype):
    rng = np.random.default_rng(7)
    t = TORCH[dtype]
    x = torch.from_numpy(rng.uniform(-400, 400, 10007).astype(np.float32)).to(t)
    data = bytearray(x.view(BITS_AS[x.element_size()]).numpy().tobytes())
    assert first_nonfinite(data, dtype) is None
    size = x.element_size()
    nan = torch.tensor([math.nan]).to(t).view(BITS_AS[size]).numpy().tobytes()
    for at in (9000, 4321, 0):
        data[at * size : (at + 1) * size] = nan
        assert first_nonfinite(data, dtype)[0] == at
    clean = x.view(BITS_AS[size]).numpy().tobytes()
    if size > 1:  # a part of an element at the end is not an element
        assert first_nonfinite(clean + nan[:-1], dtype) is None


@pytest.mark.parametrize("dtype", ["F4", "I8", "U8", "I32", "I64", "BOOL"])
def test_dtypes_without_nan_pass_any_bytes(dtype):
    assert first_nonfinite(bytes(range(256)) * 4, dtype) is None
