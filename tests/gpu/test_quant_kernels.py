"""The quantization kernels against their quant/ references: bit-exact (atol=0, rtol=0).

Every case draws fresh random data with a wide spread of block magnitudes, plus the edge cases
(zero blocks, subnormals, +-max, exact rounding ties, shapes that are not block multiples).
The references run on the CPU, so they share no code path with the kernels.
"""

import pytest
import torch
from kernel_bytes import same_bytes

from dsv41_convert.errors import FormatError
from dsv41_convert.quant import cast as cast_ref
from dsv41_convert.quant import fp4 as fp4_ref
from dsv41_convert.quant import fp8 as fp8_ref

pytestmark = pytest.mark.gpu

BF16_MAX = torch.finfo(torch.bfloat16).max


@pytest.fixture(scope="module")
def ops():
    from dsv41_convert.kernels import quant_ops

    return quant_ops


def spread(shape, dtype, seed):
    """Normal values whose rows (and 32-column stripes) differ in magnitude by up to 2**+-24."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    w = w * torch.exp2(torch.randint(-24, 24, (*shape[:-1], 1), generator=g).float())
    stripes = torch.exp2(torch.randint(-8, 8, ((shape[-1] + 31) // 32,), generator=g).float())
    return (w * stripes.repeat_interleave(32)[: shape[-1]]).to(dtype)


def fp8_edge_weight():
    """[64, 1024] bf16 with one edge case per 32x32 block of the first block row."""
    w = spread((64, 1024), torch.float32, 7)
    w[:32, 0:32] = 0.0  # all-zero block: scale from the 1e-4 floor
    w[:32, 32:64] = 1e-39  # bf16 subnormals
    w[:32, 64:96] = -1e-39
    w[0, 96:128] = BF16_MAX  # +-max in one block
    w[1, 96:128] = -BF16_MAX
    # ties: the block's amax 256 gives scale 1, so e4m3 rounds these midpoints to even
    mids = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 0.0029296875, 0.0048828125, 240.0, 208.0, -1.0625, -17.0])
    w[:32, 128:160] = mids.repeat(32 * 4)[: 32 * 32].view(32, 32)
    w[0, 128] = 256.0
    w[:32, 160:192] = -0.0  # negative zeros
    w[2:4, 192:224] = 1e-30  # tiny block
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("block", [(32, 32), (128, 128), (1, 32)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_encode_fp8_blocks_random(ops, block, scale_fmt):
    for seed, shape in ((1, (320, 1024)), (2, (70, 200))):
        if shape[1] == 200 and scale_fmt is None:
            continue
        w = spread(shape, torch.bfloat16, seed)
        q, s = ops.encode_fp8_blocks(w.cuda(), block, scale_fmt, "w")
        q_ref, s_ref = fp8_ref.encode_fp8_blocks(w, block, scale_fmt, "w")
        same_bytes(q, q_ref, f"q {block} {scale_fmt} {shape}")
        same_bytes(s, s_ref, f"s {block} {scale_fmt} {shape}")


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_encode_fp8_blocks_float32_input(ops, scale_fmt):
    w = spread((96, 1024), torch.float32, 3)
    w[0, :32] = torch.finfo(torch.float32).max
    w[1, 32:64] = 1e-42  # float32 subnormal
    q, s = ops.encode_fp8_blocks(w.cuda(), (32, 32), scale_fmt, "w")
    q_ref, s_ref = fp8_ref.encode_fp8_blocks(w, (32, 32), scale_fmt, "w")
    same_bytes(q, q_ref, "q f32")
    same_bytes(s, s_ref, "s f32")


@pytest.mark.parametrize("block", [(32, 32), (128, 128), (1, 32)])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_encode_fp8_blocks_edges(ops, block, scale_fmt):
    w = fp8_edge_weight()
    q, s = ops.encode_fp8_blocks(w.cuda(), block, scale_fmt, "w")
    q_ref, s_ref = fp8_ref.encode_fp8_blocks(w, block, scale_fmt, "w")
    same_bytes(q, q_ref, f"q edges {block} {scale_fmt}")
    same_bytes(s, s_ref, f"s edges {block} {scale_fmt}")


def fp8_128_edge_weight():
    """[300, 712] bf16: one edge case per 128x128 block of the first block row, ragged tails."""
    w = spread((300, 712), torch.float32, 8)
    w[:128, 0:128] = 0.0  # all-zero block: scale from the 1e-4 floor
    w[:128, 128:256] = -1e-39  # bf16 subnormals
    w[0, 256:384] = BF16_MAX  # +-max
    w[1, 256:384] = -BF16_MAX
    # amax 448: a float32 scale of (about) 1, so these e4m3 midpoints round to even
    mids = torch.tensor([1.0625, 1.1875, 17.0, 19.0, 0.0029296875, 0.0048828125, 240.0, 208.0, -1.0625, -17.0])
    w[:128, 384:512] = mids.repeat(128 * 13)[: 128 * 128].view(128, 128)
    w[0, 384] = 448.0
    w[:128, 512:640] = -0.0
    w[2:4, 640:712] = 1e-30  # a tiny block in the ragged last block column
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("threads", [256, 512])
def test_encode_fp8_128_threads(pow2, threads):
    """The 128x128 kernel at each CTA size: ragged shapes, edge blocks, float32 and ue8m0 scales."""
    from dsv41_convert.kernels.fp8_quant import fp8_quant_kernel

    fmt = "ue8m0" if pow2 else None
    for w in (fp8_128_edge_weight(), spread((300, 456), torch.bfloat16, 9), spread((256, 1024), torch.bfloat16, 10)):
        out, inp = w.shape
        q = torch.empty(out, inp, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(-(-out // 128), -(-inp // 128), dtype=torch.uint8 if pow2 else torch.float32, device="cuda")
        count = torch.zeros(1, dtype=torch.int32, device="cuda")
        fp8_quant_kernel(inp, 128, 128, "bfloat16", pow2, threads)(w.cuda(), q, s, count)
        q_ref, s_ref = fp8_ref.encode_fp8_blocks(w, (128, 128), fmt, "w")
        same_bytes(q, q_ref, f"q 128x128 {fmt} threads={threads} {list(w.shape)}")
        same_bytes(s.view(torch.float8_e8m0fnu) if pow2 else s, s_ref, f"s 128x128 {fmt} threads={threads}")
        assert int(count.item()) == 0


def test_encode_cpu_input_comes_back_on_cpu(ops):
    w = spread((64, 1024), torch.bfloat16, 4)
    q, s = ops.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
    assert q.device.type == "cpu" and s.device.type == "cpu"
    q_ref, s_ref = fp8_ref.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
    same_bytes(q, q_ref, "q cpu")
    same_bytes(s, s_ref, "s cpu")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("block,scale_fmt", [((32, 32), "ue8m0"), ((1, 32), "ue8m0"), ((128, 128), None)])
def test_encode_fp8_nonfinite_raises(ops, bad, block, scale_fmt):
    w = spread((64, 1024), torch.bfloat16, 5)
    w[17, 333] = bad
    with pytest.raises(FormatError, match=r"layers\.3\.attn\.wq_a\.weight.*\[17, 333\]"):
        ops.encode_fp8_blocks(w.cuda(), block, scale_fmt, "layers.3.attn.wq_a.weight")


def random_e4m3(shape, seed):
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x7E  # no NaN
    return b.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("block", [(32, 32), (128, 128), (1, 32)])
@pytest.mark.parametrize("e8m0", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_fp8_blocks(ops, block, e8m0, dtype):
    for seed, shape in ((11, (320, 1024)), (12, (70, 200))):
        q = random_e4m3(shape, seed)
        sshape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        g = torch.Generator().manual_seed(seed)
        if e8m0:
            s = torch.randint(0, 255, sshape, generator=g, dtype=torch.uint8)
            s.view(-1)[:2] = torch.tensor([0, 254], dtype=torch.uint8)  # 2**-127 and 2**127
            s = s.view(torch.float8_e8m0fnu)
        else:
            s = torch.randn(sshape, generator=g) * 1e-3
        y = ops.decode_fp8_blocks(q.cuda(), s.cuda(), block, dtype)
        same_bytes(y, fp8_ref.decode_fp8_blocks(q, s, block, dtype), f"decode {block} e8m0={e8m0} {shape}")


def fp4_edge_weight():
    """[16, 1024] bf16: e2m1 ties, -0, zeros, subnormals and large values in separate groups."""
    w = spread((16, 1024), torch.float32, 21)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 6.0, 7.0])
    w[:, 0:32] = ties.repeat(2)  # amax 7 > 6: scale 2; so also test 4 * ties below
    w[:, 32:64] = torch.cat([ties[:14], torch.tensor([6.0, 0.1])]).repeat(2)  # amax 6: scale 1
    w[:, 64:96] = 0.0
    w[:, 96:128] = -0.0
    w[:, 128:160] = 1e-39
    w[:, 160:192] = -(3e38)
    w[0, 192:224] = torch.linspace(-1e-3, 1e-3, 32)
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_encode_mxfp4(ops, dtype):
    cases = [spread((256, 1024), dtype, 31), spread((3, 5, 200), dtype, 32), fp4_edge_weight().to(dtype)]
    for w in cases:
        p, s = ops.encode_mxfp4(w.cuda(), 32, "expert")
        p_ref, s_ref = fp4_ref.encode_mxfp4(w, 32, "expert")
        same_bytes(p, p_ref, f"packed {list(w.shape)}")
        same_bytes(s, s_ref, f"scale {list(w.shape)}")


def test_encode_mxfp4_nonfinite_raises(ops):
    w = spread((64, 1024), torch.bfloat16, 33)
    w[5, 6] = float("nan")
    with pytest.raises(FormatError, match=r"experts\.7\.w1\.weight"):
        ops.encode_mxfp4(w.cuda(), 32, "layers.2.ffn.experts.7.w1.weight")


def random_mxfp4(rows, cols, seed, spread_bytes=255):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
    base = torch.randint(20, 230, (-(-rows // 32), 1), generator=g).repeat_interleave(32, 0)[:rows]  # per block row
    s = (base + torch.randint(0, spread_bytes + 1, (rows, cols // 32), generator=g)).clamp(0, 254).to(torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2), s.view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_mxfp4(ops, dtype):
    for rows, cols in ((256, 1024), (7, 200)):
        p, s = random_mxfp4(rows, cols, 41, 20)
        if cols % 32:
            s = torch.cat([s, s[:, :1]], 1)[:, : -(-cols // 32)]
        y = ops.decode_mxfp4(p.cuda(), s.cuda(), 32, dtype)
        same_bytes(y, fp4_ref.decode_mxfp4(p, s, 32, dtype), f"decode_mxfp4 {rows}x{cols}")


def test_fp4_to_fp8(ops):
    for rows in (256, 70):
        p, s = random_mxfp4(rows, 1024, 51, 14)  # a block's scales spread by <= 14: lossless
        s.view(torch.uint8)[:32, 0] = 3  # a block whose max byte is below 6: block scale 2**-127
        w8, s8 = ops.fp4_to_fp8(p.cuda(), s.cuda(), 32, "e")
        w8_ref, s8_ref = cast_ref.fp4_to_fp8(p, s, 32, "e")
        same_bytes(w8, w8_ref, f"w8 rows={rows}")
        same_bytes(s8, s8_ref, f"s8 rows={rows}")
        # the other launch geometries (block rows per CTA, threads per row) compute the same bytes
        from dsv41_convert.kernels.fp4_to_fp8 import fp4_to_fp8_kernel

        for block_rows, row_threads in ((2, 16), (1, 32), (2, 64)):
            w8_1 = torch.empty(rows, 1024, dtype=torch.uint8, device="cuda")
            s8_1 = torch.empty(-(-rows // 32), 32, dtype=torch.uint8, device="cuda")
            count = torch.zeros(1, dtype=torch.int32, device="cuda")
            kernel = fp4_to_fp8_kernel(1024, block_rows, row_threads)
            kernel(p.view(torch.uint8).cuda(), s.view(torch.uint8).cuda(), w8_1, s8_1, count)
            what = f"rows={rows} block_rows={block_rows} row_threads={row_threads}"
            same_bytes(w8_1.view(torch.float8_e4m3fn), w8_ref, f"w8 {what}")
            same_bytes(s8_1.view(torch.float8_e8m0fnu), s8_ref, f"s8 {what}")
            assert int(count.item()) == 0


@pytest.mark.parametrize(
    ("both_codes", "top"),
    [
        (0x11, 130),  # the block's other values become 0.5 * 2**-24: below e4m3's 2**-9
        (0x66, 118),  # 4.0 at offset 2**-12 is 2**-10 (the CPU tables once clamped it onto 2**-11: exact)
    ],
)
def test_fp4_to_fp8_lossy_and_nan_raise(ops, both_codes, top):
    p, s = random_mxfp4(64, 1024, 52, 0)
    p.view(torch.uint8).fill_(both_codes)
    s.view(torch.uint8).fill_(100)
    s.view(torch.uint8)[3, 2] = top
    with pytest.raises(FormatError, match=r"layers\.9\.ffn\.experts\.1\.w3\.weight.*lossy"):
        ops.fp4_to_fp8(p.cuda(), s.cuda(), 32, "layers.9.ffn.experts.1.w3.weight")
    s.view(torch.uint8)[3, 2] = 255
    with pytest.raises(FormatError, match=r"NaN"):
        ops.fp4_to_fp8(p.cuda(), s.cuda(), 32, "x")
