"""Random values of the synthetic checkpoint: seeding, statistics, canonical quantized form."""

from __future__ import annotations

import torch

from dsv41_convert.quant import decode_fp8_blocks, decode_mxfp4, encode_fp8_blocks, encode_mxfp4
from dsv41_convert.quant.fp4 import as_fp4
from dsv41_convert.synth.tensors import Fmt, Init, Param
from dsv41_convert.synth.weights import decode_file_tensors, draw, encode_param, encode_params, param_seed


def _p(name="layers.0.attn.wq_a", shape=(96, 160), fmt=Fmt.FP8, std=160**-0.5, jitter=True) -> Param:
    return Param(name, shape, fmt, "layer.0", Init(std, jitter=jitter))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_draw_is_seeded_per_name():
    a = draw(_p(), 0)
    assert torch.equal(a, draw(_p(), 0))
    assert not torch.equal(a, draw(_p(), 1))
    assert not torch.equal(a, draw(_p(name="layers.1.attn.wq_a"), 0))
    assert param_seed(0, "x") == param_seed(0, "x") != param_seed(0, "y")


def test_draw_statistics():
    w = draw(_p(shape=(512, 512), std=0.05, jitter=False), 3)
    assert abs(w.mean().item()) < 0.002 and abs(w.std().item() - 0.05) < 0.002
    norm = draw(Param("n.weight", (4096,), Fmt.BF16, "head", Init(0.1, 1.0)), 0)
    assert abs(norm.mean().item() - 1.0) < 0.01


def test_jitter_spreads_scale_exponents():
    p = _p(shape=(256, 256))
    s = encode_param(p, draw(p, 0), True)["layers.0.attn.wq_a.scale"]
    assert len(torch.unique(_bytes(s))) >= 3


def _fixed_point_fp8(q, s, block):
    q2, s2 = encode_fp8_blocks(decode_fp8_blocks(q, s, block, torch.bfloat16), block=block)
    assert torch.equal(_bytes(q2), _bytes(q)) and torch.equal(_bytes(s2), _bytes(s))


def test_fp8_is_canonical_and_bf16_is_its_decode():
    p = _p(shape=(96, 160))
    w = draw(p, 0)
    w[0, 0] = 448 * 2.0**-8  # a block whose largest code is 448: canonical form doubles its scale
    fp8 = encode_param(p, w, True)
    q, s = fp8["layers.0.attn.wq_a.weight"], fp8["layers.0.attn.wq_a.scale"]
    assert (q.dtype, s.dtype, tuple(s.shape)) == (torch.float8_e4m3fn, torch.float8_e8m0fnu, (3, 5))
    _fixed_point_fp8(q, s, (32, 32))
    bf16 = encode_param(p, w, False)["layers.0.attn.wq_a.weight"]
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.view(torch.int16), decode_fp8_blocks(q, s, (32, 32)).view(torch.int16))
    # the canonical form moves values by at most one e4m3 step from the float draw
    assert torch.allclose(bf16.float(), w, rtol=2**-3, atol=2**-9 * s.float().max().item())


def test_engram_rows_are_canonical_per_32():
    p = Param("layers.0.engram.embed", (40, 64), Fmt.FP8_ROWS, "engram.0", Init(1.0))
    t = encode_param(p, draw(p, 0), True)
    q, s = t["layers.0.engram.embed.weight"], t["layers.0.engram.embed.scale"]
    assert tuple(s.shape) == (40, 2)
    _fixed_point_fp8(q, s, (1, 32))


def test_fp4_experts_are_canonical_int8_and_bf16_is_their_decode():
    ps = [_p(name=f"layers.0.ffn.experts.{e}.w{k}", shape=(64, 96), fmt=Fmt.FP4) for e in range(3) for k in (1, 3)]
    ps.append(_p(name="layers.0.ffn.experts.0.w2", shape=(96, 64), fmt=Fmt.FP4))
    items = [(p, draw(p, 0)) for p in ps]
    fp8, bf16 = encode_params(items, True), encode_params(items, False)
    for p, w in items:
        q, s = fp8[f"{p.name}.weight"], fp8[f"{p.name}.scale"]
        out, inp = w.shape
        assert (q.dtype, tuple(q.shape), tuple(s.shape)) == (torch.int8, (out, inp // 2), (out, inp // 32))
        q2, s2 = encode_mxfp4(decode_mxfp4(as_fp4(q), s))
        assert torch.equal(_bytes(q2), _bytes(q)) and torch.equal(_bytes(s2), _bytes(s)), p.name
        b = bf16[f"{p.name}.weight"]
        assert torch.equal(b.view(torch.int16), decode_mxfp4(as_fp4(q), s).view(torch.int16))
        # batching experts is only a speed-up: the same bytes as one call per tensor
        alone = encode_param(p, w, True)
        assert torch.equal(_bytes(alone[f"{p.name}.weight"]), _bytes(q))
        assert torch.equal(decode_file_tensors(p, fp8).view(torch.int16), b.view(torch.int16))


def test_plain_formats_pass_through():
    f32 = Param("layers.0.hc_attn_base", (24,), Fmt.F32, "layer.0", Init(0.1))
    bf = Param("norm.weight", (64,), Fmt.BF16, "head", Init(0.1, 1.0))
    w32, wb = draw(f32, 0), draw(bf, 0)
    assert torch.equal(encode_param(f32, w32, True)["layers.0.hc_attn_base"], w32)
    assert torch.equal(encode_param(bf, wb, False)["norm.weight"], wb.bfloat16())
