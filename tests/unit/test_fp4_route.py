"""fp4_gemm's choice of route, on the CPU with a stand-in for the GPU cast: a weight goes through the fp8
kernel only when its cast is exact and every cast value is a normal e4m3; the answer is asked of the GPU
once per weight tensor and asked again after an in-place change (the version counter), for a new storage,
a new scale tensor, and for inference tensors, which have no version counter, by storage only; a dead
weight's entry goes with it. A known weight is cast into its shape's workspace on the workspace's stream,
into new tensors on another stream or when it is not contiguous."""

from __future__ import annotations

import gc

import pytest
import torch

fp4_gemm = pytest.importorskip("dsv41_convert.kernels.fp4_gemm")

NORMAL, SUBNORMAL = 0x38, 0x03  # e4m3 1.0 and 3 * 2**-9


class FakeCast:
    """cast_unchecked's stand-in: w8 filled with `byte`, s8 zeros, lossy = `lossy`; counts checked casts
    (a fresh counter, read by the caller) and unchecked ones (the caller's counter); `into` stands in for
    cast_into (counted in `into_calls`, the w8 it wrote kept in `targets`)."""

    def __init__(self):
        self.byte, self.lossy, self.checked, self.unchecked = NORMAL, 0, 0, 0
        self.into_calls, self.targets = 0, []

    def into(self, packed, s, w8, s8, lossy):
        assert packed.dtype == s.dtype == w8.dtype == s8.dtype == torch.uint8
        w8.fill_(self.byte)
        s8.zero_()
        self.into_calls += 1
        self.unchecked += 1
        self.targets.append(w8)

    def __call__(self, b, b_s, lossy=None):
        n, k = b.size(0), 2 * b.size(1)
        w8 = torch.full((n, k), self.byte, dtype=torch.uint8).view(torch.float8_e4m3fn)
        s8 = torch.zeros(-(-n // 32), k // 32, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        if lossy is None:
            self.checked += 1
            return w8, s8, torch.tensor([self.lossy], dtype=torch.int32)
        self.unchecked += 1
        return w8, s8, lossy


@pytest.fixture
def cast(monkeypatch):
    fake = FakeCast()
    monkeypatch.setattr(fp4_gemm, "cast_unchecked", fake)
    monkeypatch.setattr(fp4_gemm, "cast_into", fake.into)
    monkeypatch.setattr(fp4_gemm, "_current_stream", lambda device: 7)
    monkeypatch.setattr(fp4_gemm, "_workspaces", {})
    return fake


def weight(n=64, k=128):
    return torch.zeros(n, k // 2, dtype=torch.uint8), torch.full((n, k // 32), 127, dtype=torch.uint8)


def test_exact_normal_weight_goes_as_fp8_asked_once(cast):
    b, b_s = weight()
    for _ in range(3):
        got = fp4_gemm._route_as_fp8(b, b_s)
        assert got is not None and got[0].dtype == torch.float8_e4m3fn and got[0].shape == (64, 128)
    assert (cast.checked, cast.unchecked) == (1, 2)


@pytest.mark.parametrize("byte,lossy", [(SUBNORMAL, 0), (NORMAL, 1), (0x80 | SUBNORMAL, 0)])
def test_subnormal_or_lossy_cast_stays_on_the_fp4_kernel_asked_once(cast, byte, lossy):
    cast.byte, cast.lossy = byte, lossy
    b, b_s = weight()
    assert fp4_gemm._route_as_fp8(b, b_s) is None
    assert fp4_gemm._route_as_fp8(b, b_s) is None
    assert (cast.checked, cast.unchecked) == (1, 0)


def test_in_place_change_new_scale_or_storage_asked_again(cast):
    b, b_s = weight()
    fp4_gemm._route_as_fp8(b, b_s)
    cast.byte = SUBNORMAL
    assert fp4_gemm._route_as_fp8(b, b_s) is not None, "unchanged weight: the known answer"
    b_s.add_(1)  # in place: the version counter moves
    assert fp4_gemm._route_as_fp8(b, b_s) is None and cast.checked == 2
    cast.byte = NORMAL
    b_s2 = b_s.clone()
    assert fp4_gemm._route_as_fp8(b, b_s2) is not None and cast.checked == 3, "another scale tensor"
    b.data = torch.ones_like(b)  # another storage behind the same Parameter-like object
    fp4_gemm._route_as_fp8(b, b_s2)
    assert cast.checked == 4


def test_inference_tensors_by_storage(cast):
    with torch.inference_mode():
        b, b_s = weight()
        assert fp4_gemm._version(b) is None
        fp4_gemm._route_as_fp8(b, b_s)
        fp4_gemm._route_as_fp8(b, b_s)
    assert (cast.checked, cast.unchecked) == (1, 1)


def test_a_dead_weight_leaves_no_entry(cast):
    b, b_s = weight()
    fp4_gemm._route_as_fp8(b, b_s)
    key = id(b)
    assert key in fp4_gemm._routes
    del b
    gc.collect()
    assert key not in fp4_gemm._routes


def test_another_scale_tensor_at_the_same_address_asked_again(cast):
    """A scale tensor freed and another made at its address with the same version count: told apart by
    identity (here the other shares the storage; set_ counts as its first change)."""
    b, b_s = weight()
    b_s.add_(0)
    fp4_gemm._route_as_fp8(b, b_s)
    other = torch.empty(0, dtype=torch.uint8).set_(b_s.untyped_storage(), 0, b_s.shape, b_s.stride())
    assert other.data_ptr() == b_s.data_ptr() and other._version == b_s._version == 1
    cast.byte = SUBNORMAL
    assert fp4_gemm._route_as_fp8(b, other) is None and cast.checked == 2


def test_known_weight_is_cast_into_its_shapes_workspace(cast, monkeypatch):
    b, b_s = weight()
    first = fp4_gemm._route_as_fp8(b, b_s)  # asked: a new tensor
    second = fp4_gemm._route_as_fp8(b, b_s)
    other_b, other_s = weight()
    fp4_gemm._route_as_fp8(other_b, other_s)  # asked
    third = fp4_gemm._route_as_fp8(other_b, other_s)
    ws = fp4_gemm._workspaces[(64, 128, b.device)]
    assert second[0] is third[0] is ws.w8 and second[1] is ws.s8 and first[0] is not ws.w8
    assert ws.w8.dtype == torch.float8_e4m3fn and ws.s8.dtype == torch.uint8 and ws.s8.shape == (2, 4)
    assert cast.into_calls == 2 and all(t is ws.w8_bytes for t in cast.targets)
    monkeypatch.setattr(fp4_gemm, "_current_stream", lambda device: 8)  # another stream: new tensors
    elsewhere = fp4_gemm._route_as_fp8(b, b_s)
    assert elsewhere[0] is not ws.w8 and cast.into_calls == 2 and cast.unchecked == 3
    assert elsewhere[1].dtype == torch.uint8


def test_a_strided_weight_is_cast_into_new_tensors(cast):
    wide = torch.zeros(64, 128, dtype=torch.uint8)
    b, b_s = wide[:, :64], torch.full((64, 4), 127, dtype=torch.uint8)
    assert not b.is_contiguous()
    fp4_gemm._route_as_fp8(b, b_s)
    got = fp4_gemm._route_as_fp8(b, b_s)
    assert got is not None and cast.into_calls == 0 and (cast.checked, cast.unchecked) == (1, 1)
    assert not fp4_gemm._workspaces  # no workspace made for a weight that cannot use it


def test_warm_up_compiles_both_routes_and_the_cast(monkeypatch):
    """A warm-up (or the first call, whatever its rows) compiles the fp4 kernels, the fp8 kernels with the
    fp4 weight's scale layout (32x32 e8m0 blocks, the activation's blocks) and the cast."""
    calls = []
    monkeypatch.setattr(fp4_gemm, "_kernels", lambda *a: calls.append(("fp4", a)) or {})
    monkeypatch.setattr(fp4_gemm.fp8_gemm, "kernels", lambda *a: calls.append(("fp8", a)) or {})
    monkeypatch.setattr(fp4_gemm.fp4_to_fp8, "_launch", lambda *a: calls.append(("cast", a)))
    fp4_gemm.warm_up(2304, 5120, 32, True)
    assert sorted(calls) == [
        ("cast", (5120,)),
        ("fp4", (2304, 5120, 32, True)),
        ("fp8", (2304, 5120, 32, True, 32, True)),
    ]
