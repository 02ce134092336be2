"""fp4_gemm on CUDA: e4m3 activations times MXFP4 weights, matching `kernels.ref.fp4_gemm` within a bound.

The kernel is `block_gemm.block_gemm_kernel` with packed e2m1 weights, K blocks of 32 (the weight's
scale group) and one e8m0 weight scale per row; its docstring gives the numerics, the bound (the
same as fp8_gemm's, for the same reasons) and the layout. Operands are checked once per shape, as in
fp8_gemm.

From VIA_FP8_ROWS rows on (by default always), the weight is first re-expressed as e4m3 in 32x32 blocks
on the GPU (`fp4_to_fp8.cast_unchecked`, the lossless expert cast: each value times a power of two, the
block scale divided by it) and multiplied by the fp8 kernel. The same bytes as the fp4 kernel: for one
output column and K block all 32 products are scaled by the same power of two, which commutes with the
tensor cores' sum and with the promotion's fused multiply-add, so partial * (a_s * 2**s) is the same
float32 either way (while the scale products stay normal float32s, as with e8m0 scales anyway).
Measured, that holds while every cast value is a normal e4m3; where the cast gives subnormals (a 32x32
block whose scales span 12 binades or more) the H200's tensor cores summed a few outputs differently (1
and 26 of 131072 at spans 13 and 14, up to 2.3% apart; docs/BENCHMARKS.md, "Gemms, 2026-12-02"), so such
a weight stays on the fp4 kernel, as does one whose cast is not exact (a span over 14, a NaN scale).
Which route a weight takes is learned once per weight tensor (`_route_as_fp8`: one wait for the GPU) and
kept while the tensor, its storage and its version counter are the same (inference tensors have no
version counter: `_version`); from then on it is cast into a workspace of its shape by one raw launch.
The fp4 kernel widens e2m1 and multiplies per-element column scales on its consumer warpgroups; the
fp8 kernel does neither, which was worth more than the cast's pass over the weight at every row count
measured (16 to 4096 rows: 1.1x to 4.1x the fp4 kernel's TFLOP/s with calls queued, 1.0x to 3.1x with
each call waited for).
"""

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from dsv41_convert.kernels import fp4_to_fp8, fp8_gemm
from dsv41_convert.kernels.block_gemm import (
    FP4_TILES,
    FP8_TILES,
    block_gemm_kernel,
    compile_tiles,
    dense,
    launcher,
    pick_tile,
    rows,
)
from dsv41_convert.kernels.fp4_to_fp8 import cast_into, cast_unchecked

GROUP = 32  # weight scale group along K
STAGES = 3  # pipeline stages (each block_gemm.K_TILE columns of K) in flight
PACKED_DTYPES = (torch.float4_e2m1fn_x2, torch.uint8, torch.int8)
VIA_FP8_ROWS = 1  # rows from which the weight goes through the fp8 kernel: every row count measured, 16 to
# 4096, was faster that way (docs/BENCHMARKS.md, "Gemms, 2026-12-02")


def fp4_gemm_kernel(n: int, k: int, act_block: int, e8m0: bool, tile: tuple[int, int, int] = max(FP4_TILES)):
    """[M, k] e4m3 x [n, k/2] packed e2m1 -> [M, n] bf16."""
    return block_gemm_kernel(n, k, GROUP, act_block, 1, True, e8m0, True, STAGES, tile)


def fp4_gemm(
    a: Tensor,
    a_s: Tensor,
    b: Tensor,
    b_s: Tensor,
    scale_dtype: torch.dtype = torch.float32,
    act_block_size: int = 128,
) -> Tensor:
    """e4m3 activations times packed e2m1 weights; same signature as kernels.ref.fp4_gemm.

    a:   [..., K]                  float8_e4m3fn, CUDA
    a_s: [..., K/act_block_size]   float8_e8m0fnu or float32
    b:   [N, K/2]                  float4_e2m1fn_x2 (logical [N, K])
    b_s: [N, K/32]                 float8_e8m0fnu
    -> [..., N]                    bfloat16
    """
    run, via_fp8, m, n, e8m0 = _launch(
        a.shape, a_s.shape, b.shape, b_s.shape, a.dtype, a_s.dtype, b.dtype, b_s.dtype, act_block_size, a.device
    )
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if m:
        a2, a_s2 = rows(dense(a), m), rows(dense(a_s, e8m0), m)
        fp8 = _route_as_fp8(b, b_s) if m >= VIA_FP8_ROWS else None
        if fp8 is None:
            run(a2, a_s2, dense(b, True), dense(b_s, True), c)
        else:
            via_fp8(a2, a_s2, fp8[0], fp8[1], c)
    return c if a.dim() == 2 else c.view(*a.shape[:-1], n)


@functools.cache
def _launch(a_shape, a_s_shape, b_shape, b_s_shape, a_dtype, s_dtype, b_dtype, b_s_dtype, act_block, device):
    """-> (launch, launch of the fp8 route, M, N, e8m0) for operands of these shapes and dtypes, checked here
    once; raises ValueError."""
    k, n = a_shape[-1], b_shape[0]
    if a_dtype != torch.float8_e4m3fn or b_dtype not in PACKED_DTYPES:
        raise ValueError(f"fp4_gemm: a {a_dtype} {list(a_shape)} must be e4m3, b {b_dtype} {list(b_shape)} packed e2m1")
    if act_block not in (32, 128) or k % act_block or 2 * b_shape[1] != k or device.type != "cuda":
        raise ValueError(f"fp4_gemm: a {list(a_shape)}, b {list(b_shape)} (packed), act block {act_block}")
    m = a_shape.numel() // k
    if a_s_shape.numel() != m * (k // act_block) or tuple(b_s_shape) != (n, k // GROUP):
        raise ValueError(
            f"fp4_gemm: scales a_s {list(a_s_shape)}, b_s {list(b_s_shape)} "
            f"do not fit a {list(a_shape)}, b {list(b_shape)}"
        )
    if s_dtype not in (torch.float32, torch.float8_e8m0fnu) or b_s_dtype != torch.float8_e8m0fnu:
        raise ValueError(f"fp4_gemm: scale dtypes {s_dtype}, {b_s_dtype}: want float32/e8m0 and e8m0")
    e8m0 = s_dtype == torch.float8_e8m0fnu
    if not m:
        return None, None, m, n, e8m0
    fp4, fp8 = _compile(n, k, act_block, e8m0)  # both routes, so that a warm-up with one row readies either
    run = launcher(fp4[pick_tile(m, n, device, FP4_TILES)])
    return run, launcher(fp8[pick_tile(m, n, device, FP8_TILES)]), m, n, e8m0


_routes: dict[int, tuple] = {}  # id(weight) -> (weakref(weight), weakref(scale), their state, the route:
# a _Cast where it goes as fp8 through its shape's workspace, AS_FP8_ELSEWHERE where it goes as fp8 into new
# tensors (not contiguous), None where it stays on the fp4 kernel)
AS_FP8_ELSEWHERE = ()


@dataclass(frozen=True)
class _Cast:
    """A known weight's cast into the workspace of its shape, bound once: the current stream is checked
    against `stream` (the workspace's) and `args` go to cast_into as they are."""

    device: torch.device
    stream: int
    args: tuple  # (weight bytes uint8 [N, K/2], scale bytes uint8 [N, K/32], w8_bytes, s8, lossy counter)
    w8: Tensor
    s8: Tensor


def _route_as_fp8(b: Tensor, b_s: Tensor) -> tuple[Tensor, Tensor] | None:
    """The weight as (e4m3 [N, K], e8m0 bytes uint8 [ceil(N/32), K/32]) where the fp8 kernel gives the fp4
    kernel's bytes with it (an exact cast to normal e4m3 values), else None.

    That is asked of the GPU (a wait) the first time this weight tensor comes, and again whenever it,
    its scale, their storage or their version counters (an in-place change) differ. A known weight is
    cast into the workspace of its shape (`_workspace`) when the current stream is the workspace's: no
    allocation, no checks, one raw launch with arguments bound when it was asked (at few rows the host's
    time per call is the GEMM's pace).
    """
    state = (b.data_ptr(), b_s.data_ptr(), _version(b), _version(b_s))
    known = _routes.get(id(b))
    if known is not None and known[0]() is b and known[1]() is b_s and known[2] == state:
        route = known[3]
        if route is None:
            return None
        if route is not AS_FP8_ELSEWHERE and route.stream == _current_stream(route.device):
            cast_into(*route.args)
            return route.w8, route.s8
        w8, s8, _ = cast_unchecked(b, b_s, _untold(b.device))
        return w8, s8.view(torch.uint8)
    w8, s8, lossy = cast_unchecked(b, b_s)
    u = w8.view(torch.uint8)
    subnormal = ((u & 0x78) == 0) & ((u & 7) != 0)
    route = None
    if not int(lossy.item()) and not bool(subnormal.any()):
        route = _bind_cast(b, b_s) if b.is_contiguous() and b_s.is_contiguous() else AS_FP8_ELSEWHERE
    key = id(b)
    _routes[key] = (weakref.ref(b, lambda _: _routes.pop(key, None)), weakref.ref(b_s), state, route)
    return None if route is None else (w8, s8.view(torch.uint8))


def _bind_cast(b: Tensor, b_s: Tensor) -> _Cast:
    """The cast of the contiguous weight b (packed [N, K/2]) into its shape's workspace, as a _Cast."""
    ws = _workspace(b.size(0), 2 * b.size(1), b.device)
    args = (b.view(torch.uint8), b_s.view(torch.uint8), ws.w8_bytes, ws.s8, _untold(b.device))
    return _Cast(b.device, ws.stream, args, ws.w8, ws.s8)


@dataclass
class Workspace:
    """The cast's output for weights of one shape on one GPU, rewritten by every fp4_gemm on `stream` (the
    stream runs a call's GEMM before the next call's cast): w8 e4m3 [N, K] (w8_bytes: as uint8), s8 e8m0
    bytes uint8 [ceil(N/32), K/32]."""

    stream: int
    w8: Tensor
    w8_bytes: Tensor
    s8: Tensor


_workspaces: dict[tuple[int, int, torch.device], Workspace] = {}


def _workspace(n: int, k: int, device: torch.device) -> Workspace:
    """The workspace for weights [n, k] (logical) on `device`, made on the first call, for the current
    stream (calls on another stream cast into new tensors). One per weight shape: V4.1-Flash's experts
    have two (w1/w3 [2304, 5120], w2 [5120, 2304]), 11.8 MB each."""
    key = (n, k, device)
    ws = _workspaces.get(key)
    if ws is None:
        w8 = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)
        s8 = torch.empty(-(-n // 32), k // 32, dtype=torch.uint8, device=device)
        ws = _workspaces[key] = Workspace(_current_stream(device), w8, w8.view(torch.uint8), s8)
    return ws


def _current_stream(device: torch.device) -> int:
    """The handle of the current stream on `device` (torch.cuda.current_stream(device).cuda_stream, read
    without making a Stream object where torch offers that)."""
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _version(t: Tensor) -> int | None:
    """t's version counter; None for an inference tensor, which has none (made under torch.inference_mode,
    as the streamed weights are: an in-place change of one inside inference mode is not seen)."""
    return None if t.is_inference() else t._version


@functools.cache
def _untold(device: torch.device) -> Tensor:
    """A lossy counter nobody reads, for casts of weights already known exact (saves a fill per call)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.cache
def _kernels(n: int, k: int, act_block: int, e8m0: bool) -> dict:
    """tile -> compiled kernel, every tile on the first call (as fp8_gemm.kernels)."""
    return compile_tiles(lambda tile: fp4_gemm_kernel(n, k, act_block, e8m0, tile), FP4_TILES)


def _compile(n: int, k: int, act_block: int, e8m0: bool) -> tuple[dict, dict]:
    """Every kernel fp4_gemm may run for a weight [n, k] (logical): -> (tile -> fp4 kernel, tile -> fp8
    kernel), the cast's kernel compiled too."""
    fp4_to_fp8.warm_up(k)
    return _kernels(n, k, act_block, e8m0), fp8_gemm.kernels(n, k, GROUP, e8m0, act_block, True)


def warm_up(n: int, k: int, act_block_size: int = 32, e8m0: bool = True) -> None:
    """Compile the kernels of both routes (every tile of each, and the cast) for an expert weight [n, k]
    (logical) before collectives start."""
    _compile(n, k, act_block_size, e8m0)
