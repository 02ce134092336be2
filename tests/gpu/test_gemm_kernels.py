"""fp8_gemm and fp4_gemm against kernels.ref within the bound their kernel files state:
|C - C_ref| <= 2**-7 |C_ref| + 2**-12 (|A| @ |B|^T, scaled); and the same bytes run to run."""

import pytest
import torch

from dsv41_convert.kernels import ref
from dsv41_convert.quant import act as act_ref
from dsv41_convert.quant import fp4 as fp4_ref
from dsv41_convert.quant import fp8 as fp8_ref

pytestmark = pytest.mark.gpu

# block_gemm_kernel's (tile, hoist, k_tile, pingpong, keywords) arguments: the wrappers' tiles
# (block_gemm.FP8_TILES, FP4_TILES), 64 x 128 with its scales read from global memory (the path for scales
# too big to hoist), the one-K-block-per-stage kernel without ping-pong (the structure before both), and the
# other scale hoists, decodes and matmul queue depths (the rows past M of a TMA-hoisted a_s read as zeros:
# m = 1, 100)
TILES = [
    ((128, 128, 256), True, 128, True, {}),
    ((64, 64, 128), True, 128, True, {"depth": 3}),
    ((64, 64, 256), True, 128, True, {}),
    ((64, 128, 128), True, 128, True, {}),
    ((64, 128, 128), False, 128, True, {}),
    ((128, 128, 256), True, 32, False, {}),
    ((64, 128, 128), True, 128, True, {"scale_tma": False, "scale_lut": False}),
    ((64, 64, 128), True, 128, True, {"depth": 3, "scale_lut": False}),
    ((128, 128, 256), True, 128, True, {"scale_lut": False}),
    ((64, 64, 256), True, 128, True, {"scale_lut": False}),
    ((64, 128, 128), False, 128, True, {"scale_lut": False}),
    ((64, 64, 128), True, 128, True, {"depth": 4}),
]


def abs_e4m3(t):
    return (t.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)


def abs_e2m1(t):
    return (t.view(torch.uint8) & 0x77).view(torch.float4_e2m1fn_x2)


def check(got, want, mag, what):
    got, want, mag = got.float().cpu(), want.float().cpu(), mag.float().cpu()
    bound = 2**-7 * want.abs() + 2**-12 * mag
    err = (got - want).abs()
    assert bool((err <= bound).all()), (
        f"{what}: max err {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"
    )
    assert (got == want).float().mean().item() > 0.5, f"{what}: fewer than half the outputs bit-equal"


def cuda_operands(seed, m, n, k, fp4):
    """Random operands on the GPU as the model quantizes them: activations [m, k] e4m3 with ue8m0 scales per
    32, weights [n, k] as fp8 32x32 blocks or MXFP4 ([n, k/2] packed, scales per 32). -> a, a_s, b, b_s"""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.05).bfloat16()
    a, a_s = act_ref.act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
    if fp4:
        b, b_s = (t.cuda() for t in fp4_ref.encode_mxfp4(w.cpu(), 32, "w"))
    else:
        b, b_s = fp8_ref.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
    return a, a_s, b, b_s


def run_tile(tile, fp4, a, a_s, b, b_s, e8m0, k_block, a_block, b_rows, stages):
    """The block gemm with explicit (tile, hoist, k_tile, pingpong, keywords), called as fp8_gemm / fp4_gemm
    call it."""
    from dsv41_convert.kernels.block_gemm import block_gemm_kernel

    m, k, n = a.size(0), a.size(1), b.size(0)
    b_e8m0 = True if fp4 else e8m0
    *args, keywords = tile
    kernel = block_gemm_kernel(n, k, k_block, a_block, b_rows, fp4, e8m0, b_e8m0, stages, *args, **keywords)
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def raw(t):
        return t.contiguous().view(torch.uint8) if t.dtype in (torch.float8_e8m0fnu, torch.float4_e2m1fn_x2) else t

    kernel(a, raw(a_s), raw(b), raw(b_s), c)
    return c


@pytest.mark.parametrize("tile", [None, *TILES])
@pytest.mark.parametrize("block,fmt,sdtype", [(32, "ue8m0", torch.float8_e8m0fnu), (128, None, torch.float32)])
@pytest.mark.parametrize("m", [1, 100])
def test_fp8_gemm(block, fmt, sdtype, m, tile):
    from dsv41_convert.kernels.fp8_gemm import STAGES, fp8_gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(5)
    n, k = 512, 1024
    x = torch.randn(m, k, generator=g).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().cuda()
    a, a_s = act_ref.act_quant(x, block, fmt, sdtype)
    b, b_s = fp8_ref.encode_fp8_blocks(w, (block, block), fmt, "w")
    b_s = b_s.to(sdtype)
    if tile is None:
        got = fp8_gemm(a, a_s, b, b_s, sdtype, block)
    else:
        got = run_tile(tile, False, a, a_s, b, b_s, fmt == "ue8m0", block, block, block, STAGES)
    want = ref.fp8_gemm(a, a_s, b, b_s, sdtype, block)
    mag = ref.fp8_gemm(abs_e4m3(a), a_s, abs_e4m3(b), b_s, sdtype, block)
    check(got, want, mag, f"fp8_gemm block={block} m={m} tile={tile}")


@pytest.mark.parametrize("m", [1, 100, 300])
def test_fp8_gemm_with_more_scales_a_row_than_one_tma_box(m):
    """K = 15360 (the MTP's main_proj, 3 x dim): 480 activation scales a row, read without TMA, on each
    tile (at N = 5120 pick_tile takes 64 x 64 for 1 row, 64 x 128 for 100, 128 x 128 for 300)."""
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm

    a, a_s, b, b_s = cuda_operands(11, m, 5120, 15360, False)
    e8 = torch.float8_e8m0fnu
    got = fp8_gemm(a, a_s, b, b_s, e8, 32)
    want = ref.fp8_gemm(a, a_s, b, b_s, e8, 32)
    mag = ref.fp8_gemm(abs_e4m3(a), a_s, abs_e4m3(b), b_s, e8, 32)
    check(got, want, mag, f"fp8_gemm K=15360 m={m}")


@pytest.mark.parametrize("tile", [None, *TILES])
@pytest.mark.parametrize("act_block,fmt,sdtype", [(32, "ue8m0", torch.float8_e8m0fnu), (128, None, torch.float32)])
@pytest.mark.parametrize("m", [3, 100, 600])
def test_fp4_gemm(act_block, fmt, sdtype, m, tile):
    from dsv41_convert.kernels.fp4_gemm import GROUP, STAGES, fp4_gemm

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(6)
    n, k = 256, 1024
    x = torch.randn(m, k, generator=g).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().cuda()
    a, a_s = act_ref.act_quant(x, act_block, fmt, sdtype)
    b, b_s = (t.cuda() for t in fp4_ref.encode_mxfp4(w.cpu(), 32, "w"))
    if tile is None:
        got = fp4_gemm(a, a_s, b, b_s, sdtype, act_block)
    else:
        got = run_tile(tile, True, a, a_s, b, b_s, fmt == "ue8m0", GROUP, act_block, 1, STAGES)
    want = ref.fp4_gemm(a, a_s, b, b_s, sdtype, act_block)
    mag = ref.fp4_gemm(abs_e4m3(a), a_s, abs_e2m1(b), b_s, sdtype, act_block)
    check(got, want, mag, f"fp4_gemm act_block={act_block} m={m} tile={tile}")


@pytest.mark.parametrize("tile", TILES[:4])
@pytest.mark.parametrize("fp4", [False, True])
def test_gemm_same_bytes_run_to_run(fp4, tile):
    """Many CTAs per SM and a long K loop: five calls give the same bytes (a race would show here)."""
    from dsv41_convert.kernels.fp4_gemm import STAGES as FP4_STAGES
    from dsv41_convert.kernels.fp8_gemm import STAGES as FP8_STAGES

    a, a_s, b, b_s = cuda_operands(7, 1000, 2048, 4096, fp4)
    if fp4:
        outs = [run_tile(tile, True, a, a_s, b, b_s, True, 32, 32, 1, FP4_STAGES) for _ in range(5)]
    else:
        outs = [run_tile(tile, False, a, a_s, b, b_s, True, 32, 32, 32, FP8_STAGES) for _ in range(5)]
    for i, c in enumerate(outs[1:], 1):
        assert torch.equal(c.view(torch.uint16), outs[0].view(torch.uint16)), f"call {i} differs from call 0"


@pytest.mark.parametrize("fp4", [False, True])
def test_gemm_wrapper_views_misaligned_scales_and_errors(fp4):
    """The wrappers check operands once per shape, then launch directly: a 3-D activation, a non-contiguous
    weight and scales at a 1-byte offset (a tensor map needs 16-byte alignment, so they are copied) give the
    bytes of the plain 2-D call; operands that do not fit raise ValueError, on every call."""
    from dsv41_convert.kernels.fp4_gemm import fp4_gemm
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm

    m, n, k = 70, 256, 1024
    a, a_s, b, b_s = cuda_operands(8, m, n, k, fp4)
    gemm = fp4_gemm if fp4 else fp8_gemm
    want = gemm(a, a_s, b, b_s, torch.float8_e8m0fnu, 32)

    def shifted(t):  # the same values, one byte past a 16-byte boundary
        flat = torch.empty(t.numel() + 1, dtype=torch.uint8, device="cuda")[1:]
        return flat.copy_(t.contiguous().view(torch.uint8).flatten()).view(t.dtype).view(t.shape)

    b_strided = torch.cat([b.view(torch.uint8)] * 2, dim=1)[:, : b.size(1)].view(b.dtype)  # non-contiguous
    got = gemm(a.view(1, m, k), shifted(a_s).view(1, m, -1), b_strided, shifted(b_s), torch.float8_e8m0fnu, 32)
    assert got.shape == (1, m, n)
    assert torch.equal(got.view(m, n).view(torch.uint16), want.view(torch.uint16))
    for _ in range(2):
        with pytest.raises(ValueError):
            gemm(a, a_s[:, :-1], b, b_s, torch.float8_e8m0fnu, 32)


def spread_mxfp4(seed, n, k, span):
    """An MXFP4 weight [n, k/2] (uint8 codes) with e8m0 scales [n, k/32] that spread over `span` + 1
    binades in each 32-row block (around 2**-7): the cast to 32x32 e4m3 gives normal values up to span
    11, subnormals from 12, is exact up to 14 and lossy beyond."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = 120 + torch.randint(0, span + 1, (n, k // 32), dtype=torch.uint8, generator=g)
    s[::32] = 120 + span  # each 32-row block holds both ends of the range
    s[1::32] = 120
    return codes.cuda(), s.cuda().view(torch.float8_e8m0fnu)


def without_subnormal_casts(b, b_s, span):
    """b with every nonzero code whose cast (span as spread_mxfp4's) would be a subnormal e4m3 made a 4 or
    a 6: the same scale spread, only normal values after the cast."""
    n, k = b.size(0), 2 * b.size(1)
    low = b_s.view(torch.uint8).repeat_interleave(32, 1) < 120 + span - 11
    codes = torch.stack([b & 15, b >> 4], -1).view(n, k)
    codes = torch.where(low & (codes & 7 != 0), (codes & 8) | 6 | (codes & 1), codes).view(n, k // 2, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous()


@pytest.mark.parametrize("n", [256, 200])
@pytest.mark.parametrize("m", [1, 256, 777])
def test_fp4_gemm_through_fp8_same_bytes(monkeypatch, m, n):
    """fp4_gemm (from VIA_FP8_ROWS rows: always by default) casts the weight to 32x32 e4m3 and runs the fp8
    kernel: the same bytes as the fp4 kernel (scale spans up to 11 binades, and 14 where no cast value is
    subnormal; ragged N and M). A weight whose cast gives subnormals (span 14), is not exact (span 16) or
    meets a NaN scale stays on the fp4 kernel, asked once; an in-place change of its scales is seen (the version
    counter) and the weight is asked again."""
    from dsv41_convert.kernels import fp4_gemm as mod

    casts = []

    def counted(b, b_s, lossy=None):
        casts.append(b)
        return cast_unchecked(b, b_s, lossy)

    def counted_into(b, *rest):  # a known weight, cast into its shape's workspace
        casts.append(b)
        cast_into(b, *rest)

    cast_unchecked, cast_into = mod.cast_unchecked, mod.cast_into
    monkeypatch.setattr(mod, "cast_unchecked", counted)
    monkeypatch.setattr(mod, "cast_into", counted_into)
    k = 1024
    a, a_s, _, _ = cuda_operands(11, m, n, k, True)
    e8 = torch.float8_e8m0fnu

    def both(b, b_s):
        monkeypatch.setattr(mod, "VIA_FP8_ROWS", 1 << 30)
        direct = mod.fp4_gemm(a, a_s, b, b_s, e8, 32)
        monkeypatch.setattr(mod, "VIA_FP8_ROWS", 1)
        routed = mod.fp4_gemm(a, a_s, b, b_s, e8, 32)
        assert torch.equal(routed.view(torch.uint16), direct.view(torch.uint16))
        return routed

    weights = [(f"span {span}", *spread_mxfp4(span, n, k, span)) for span in (0, 6, 11)]
    b, b_s = spread_mxfp4(14, n, k, 14)
    weights.append(("span 14, normal casts", without_subnormal_casts(b, b_s, 14), b_s))
    for what, b, b_s in weights:
        casts.clear()
        for _ in range(2):
            routed = both(b, b_s)
        assert len(casts) == 2, f"{what}: not cast on each call"
        b4 = b.view(torch.float4_e2m1fn_x2)
        want = ref.fp4_gemm(a, a_s, b4, b_s, e8, 32)
        check(routed, want, ref.fp4_gemm(abs_e4m3(a), a_s, abs_e2m1(b4), b_s, e8, 32), f"through fp8, {what}")

    with torch.inference_mode():  # inference tensors (as streamed weights are) have no version counter
        b, b_s = (t.clone() for t in spread_mxfp4(6, n, k, 6))
        casts.clear()
        for _ in range(2):
            both(b, b_s)
        assert len(casts) == 2

    for span in (14, 16):
        b, b_s = spread_mxfp4(span, n, k, span)
        casts.clear()
        for _ in range(2):
            both(b, b_s)
        assert len(casts) == 1, f"span {span}: asked once, then stays on the fp4 kernel"
    b_s.view(torch.uint8).clamp_(min=136 - 11)  # in place: now spans 11 binades
    both(b, b_s)
    assert len(casts) == 2, "the changed weight is asked again (and cast)"

    b, b_s = spread_mxfp4(4, n, k, 2)
    b_s.view(torch.uint8)[5, 7] = 255  # NaN scale
    casts.clear()
    both(b, b_s)
    assert len(casts) == 1


def test_fp4_gemm_workspace_shared_by_queued_calls(monkeypatch):
    """Known weights of one shape are cast into one workspace: calls queued back to back on one stream,
    alternating two weights, each give the fp4 kernel's bytes of their own weight (the stream runs each
    GEMM before the next cast); a call on another stream casts into new tensors."""
    from dsv41_convert.kernels import fp4_gemm as mod

    n, k, e8 = 256, 1024, torch.float8_e8m0fnu
    a, a_s, _, _ = cuda_operands(12, 333, n, k, True)
    weights = [spread_mxfp4(span, n, k, span) for span in (3, 9)]
    want = []
    for b, b_s in weights:
        monkeypatch.setattr(mod, "VIA_FP8_ROWS", 1 << 30)
        want.append(mod.fp4_gemm(a, a_s, b, b_s, e8, 32))
        monkeypatch.setattr(mod, "VIA_FP8_ROWS", 1)
        mod.fp4_gemm(a, a_s, b, b_s, e8, 32)  # asked: from here on each is known
    torch.cuda.synchronize()
    got = [mod.fp4_gemm(a, a_s, *weights[i % 2], e8, 32) for i in range(8)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got.append(mod.fp4_gemm(a, a_s, *weights[0], e8, 32))
    torch.cuda.synchronize()
    for i, c in enumerate(got):
        assert torch.equal(c.view(torch.uint16), want[i % 2].view(torch.uint16)), f"call {i}"
    ws = mod._workspaces[(n, k, a.device)]
    assert ws.stream == torch.cuda.current_stream().cuda_stream


def test_fp4_gemm_reads_the_current_stream_as_torch_names_it():
    """The route's stream check (a raw handle, no Stream object) names the stream torch.cuda.current_stream
    does, on the default stream and inside `with torch.cuda.stream(side)`; the two differ."""
    from dsv41_convert.kernels import fp4_gemm as mod

    dev = torch.device("cuda", torch.cuda.current_device())
    main = mod._current_stream(dev)
    assert main == torch.cuda.current_stream(dev).cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert mod._current_stream(dev) == side.cuda_stream == torch.cuda.current_stream(dev).cuda_stream
    assert side.cuda_stream != main
