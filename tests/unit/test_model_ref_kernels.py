"""kernels/ref.py against independent formulations: dequantize-then-matmul in float64, dense
softmax attention, and the Sinkhorn definition."""

from __future__ import annotations

import pytest
import torch

from dsv41_convert.kernels import ref
from dsv41_convert.quant.act import act_quant
from dsv41_convert.quant.fp4 import decode_mxfp4, encode_mxfp4
from dsv41_convert.quant.fp8 import decode_fp8_blocks, encode_fp8_blocks


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dequant_act(q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    return (q.double().unflatten(-1, (-1, block)) * s.double().unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 32), (5, 96, 70), (3, 32, 1)])
def test_fp8_gemm_matches_dequantized_matmul(m, k, n):
    g = _gen(m * k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w, ws = encode_fp8_blocks(torch.randn(n, k, generator=g) * k**-0.5)
    xq, xs = act_quant(x, 32)
    out = ref.fp8_gemm(xq, xs, w, ws, torch.float8_e8m0fnu, block_size=32)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    exact = _dequant_act(xq, xs, 32) @ decode_fp8_blocks(w, ws).double().T
    # the fp32 accumulation is exact up to a few fp32 ulps; the bf16 output is then rounded once
    torch.testing.assert_close(out.double(), exact.bfloat16().double(), atol=1e-6, rtol=2**-8)


def test_fp4_gemm_matches_dequantized_matmul():
    g = _gen(1)
    m, k, n = 4, 128, 48
    x = torch.randn(2, m, k, generator=g).bfloat16()
    w, ws = encode_mxfp4(torch.randn(n, k, generator=g))
    xq, xs = act_quant(x, 32)
    out = ref.fp4_gemm(xq, xs, w, ws, torch.float8_e8m0fnu, act_block_size=32)
    assert out.shape == (2, m, n) and out.dtype == torch.bfloat16
    exact = _dequant_act(xq, xs, 32) @ decode_mxfp4(w, ws, dtype=torch.float32).double().T
    torch.testing.assert_close(out.double(), exact.bfloat16().double(), atol=1e-6, rtol=2**-8)


def test_gemm_rejects_mismatched_k():
    xq, xs = act_quant(torch.ones(2, 64, dtype=torch.bfloat16), 32)
    w, ws = encode_fp8_blocks(torch.ones(8, 32))
    with pytest.raises(ValueError, match="differ in K"):
        ref.fp8_gemm(xq, xs, w, ws, torch.float8_e8m0fnu, block_size=32)


def _dense_attention(q, kv, sink, idxs, scale):
    """Plain softmax over the listed rows plus a sink logit, float64."""
    b, m, h, d = q.shape
    out = torch.zeros(b, m, h, d, dtype=torch.float64)
    for bi in range(b):
        for mi in range(m):
            rows = idxs[bi, mi][idxs[bi, mi] >= 0].long()
            if rows.numel() == 0:
                continue
            k = kv[bi, rows].double()  # [r, d]
            logits = q[bi, mi].double() @ k.T * scale  # [h, r]
            mx = logits.amax(-1, keepdim=True)
            p = torch.exp(logits - mx)
            denom = p.sum(-1, keepdim=True) + torch.exp(sink.double().unsqueeze(-1) - mx)
            out[bi, mi] = (p / denom) @ k
    return out


def test_sparse_attn_matches_dense_softmax():
    g = _gen(2)
    b, m, h, d, n, topk = 2, 3, 4, 32, 150, 130  # topk > 64: several online-softmax blocks
    q = torch.randn(b, m, h, d, generator=g).bfloat16()
    kv = torch.randn(b, n, d, generator=g).bfloat16()
    sink = torch.randn(h, generator=g)
    idxs = torch.randint(0, n, (b, m, topk), generator=g, dtype=torch.int32)
    idxs[:, :, ::7] = -1
    idxs[1, 2] = -1  # a row with nothing to attend to gives zeros
    out = ref.sparse_attn(q, kv, sink, idxs, d**-0.5)
    assert out.dtype == torch.bfloat16
    want = _dense_attention(q, kv, sink, idxs, d**-0.5)
    assert torch.equal(out[1, 2].float(), torch.zeros(h, d))
    # bf16 probabilities before P.V: relative error up to 2**-8 per term, plus the bf16 output rounding
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2**-6)


def test_sparse_attn_sink_only_in_denominator():
    q = torch.zeros(1, 1, 2, 32, dtype=torch.bfloat16)
    kv = torch.ones(1, 1, 32, dtype=torch.bfloat16)
    idxs = torch.zeros(1, 1, 1, dtype=torch.int32)
    # logits 0 for the one row; sink 0 -> weight 1/2; sink -inf -> weight 1
    out = ref.sparse_attn(q, kv, torch.tensor([0.0, -torch.inf]), idxs, 1.0)
    assert out[0, 0, 0, 0].item() == 0.5 and out[0, 0, 1, 0].item() == 1.0


def test_hc_split_sinkhorn_definition():
    g = _gen(3)
    hc = 4
    mixes = torch.randn(2, 5, (2 + hc) * hc, generator=g)
    scale, base = torch.randn(3, generator=g), torch.randn((2 + hc) * hc, generator=g)
    pre, post, comb = ref.hc_split_sinkhorn(mixes, scale, base, hc, 20, 1e-6)
    assert torch.equal(pre, torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + 1e-6)
    assert torch.equal(post, 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc]))
    c = (mixes[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc)).double()
    c = c.softmax(-1) + 1e-6
    c = c / (c.sum(-2, keepdim=True) + 1e-6)
    for _ in range(19):
        c = c / (c.sum(-1, keepdim=True) + 1e-6)
        c = c / (c.sum(-2, keepdim=True) + 1e-6)
    torch.testing.assert_close(comb.double(), c, atol=1e-6, rtol=1e-5)
    # doubly stochastic after 20 rounds (columns exactly up to eps, rows closely)
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 5, hc), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(2, 5, hc), atol=1e-3, rtol=0)


@pytest.mark.parametrize(("t", "want_p"), [(0.50390625, 0.60546875), (0.64453125, 0.5234375)])
def test_sparse_attn_rounds_probabilities_to_bf16_against_the_max_of_64_indices(t, want_p):
    """SPEC §5: online softmax in blocks of 64 indices, probabilities cast to bf16 before P.V. Indices 0..31
    are a row of logit -t and value 1, index 32 a row of logit 0 and value 0, all in the first block of 64:
    p = exp(-t) (fp32) is rounded to bf16 (`want_p`) in the numerator and kept in fp32 in the denominator, so
    out = 32 bf16(p) / (1 + 32 p). An fp32 P, or a block of 32 (whose running max is -t when the first 32
    arrive, so p = 1 then, rescaled in fp32), gives 32 p / (1 + 32 p): one bf16 ulp lower or higher here."""
    q = torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)
    q[..., 0] = 1
    kv = torch.zeros(1, 2, 32, dtype=torch.bfloat16)
    kv[0, 1, 0], kv[0, 1, 1] = -t, 1.0  # row 1: logit q . k = -t, value 1 in column 1
    idxs = torch.full((1, 1, 64), -1, dtype=torch.int32)
    idxs[0, 0, :32] = 1
    idxs[0, 0, 32] = 0
    p = float(torch.exp(torch.tensor(-t, dtype=torch.float32)))
    assert float(torch.tensor(p).bfloat16()) == want_p
    want = torch.tensor(32 * want_p / (1 + 32 * p)).bfloat16()
    fp32_p = torch.tensor(32 * p / (1 + 32 * p)).bfloat16()
    assert want != fp32_p  # the case tells the two apart
    out = ref.sparse_attn(q, kv, torch.tensor([-torch.inf]), idxs, 1.0)
    assert out[0, 0, 0, 1] == want
