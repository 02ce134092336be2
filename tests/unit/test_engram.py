"""Engram module: fp8 row lookup (incl. the row split across ranks) and the gated update."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv41_convert.config import ModelArgs
from dsv41_convert.model import engram as engram_mod
from dsv41_convert.model import parallel
from dsv41_convert.model.engram import Engram, ParallelEngramEmbedding
from dsv41_convert.model.engram_hash import EngramLayout
from dsv41_convert.model.layers import dense_dtype
from dsv41_convert.synth.presets import TINY, hf_config


def _args(dtype: str) -> ModelArgs:
    args = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405))
    return dataclasses.replace(args, dtype=dtype)


def _fp8_rows(rows: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random table in the checkpoint format: e4m3 values, one e8m0 power of two per 32 values."""
    w = (torch.randn(rows, dim, generator=gen) * 40).to(torch.float8_e4m3fn)
    exps = torch.randint(-10, -3, (rows, dim // 32), generator=gen).float()
    return w, torch.pow(2.0, exps).to(torch.float8_e8m0fnu)


def _fill(module: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dtype == torch.float8_e8m0fnu:
                p.copy_(torch.pow(2.0, torch.randint(-9, -5, p.shape, generator=gen).float()).to(p.dtype))
            elif p.dtype == torch.float8_e4m3fn:
                p.copy_((torch.randn(p.shape, generator=gen) * 30).to(p.dtype))
            elif name.endswith(("q_weight", "k_weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def _dequant_rows(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (w.float().view(w.size(0), -1, 32) * s.float().unsqueeze(-1)).view(w.shape)


def test_lookup_dequantizes_rows():
    gen = torch.Generator().manual_seed(0)
    emb = ParallelEngramEmbedding(100, 64)
    w, s = _fp8_rows(100, 64, gen)
    with torch.no_grad():
        emb.weight.copy_(w)
        emb.scale.copy_(s)
    idx = torch.tensor([[0, 99, 17], [5, 5, 63]])
    got = emb(idx)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 64)
    torch.testing.assert_close(got, _dequant_rows(w, s)[idx].bfloat16(), atol=0, rtol=0)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_row_split_across_ranks_sums_to_whole_table(monkeypatch, world):
    """Each rank holds ceil(rows/world) rows (the converter pads the last slice with weight 0,
    scale 1); the ranks' partial lookups sum to the one-rank lookup exactly."""
    rows, dim = 101, 64
    gen = torch.Generator().manual_seed(1)
    w, s = _fp8_rows(rows, dim, gen)
    whole = ParallelEngramEmbedding(rows, dim)
    with torch.no_grad():
        whole.weight.copy_(w)
        whole.scale.copy_(s)
    idx = torch.randint(0, rows, (3, 7), generator=gen)
    idx[0, 0], idx[0, 1] = 0, rows - 1
    want = whole(idx)

    part = -(-rows // world)
    pad = part * world - rows
    w_pad = torch.cat([w, torch.zeros(pad, dim).to(torch.float8_e4m3fn)])
    s_pad = torch.cat([s, torch.ones(pad, dim // 32).to(torch.float8_e8m0fnu)])
    monkeypatch.setattr(parallel, "world_size", lambda: world)
    monkeypatch.setattr(engram_mod.parallel, "all_reduce", lambda x: x)
    total = torch.zeros_like(want, dtype=torch.float32)
    for r in range(world):
        monkeypatch.setattr(parallel, "rank", lambda r=r: r)
        shard = ParallelEngramEmbedding(rows, dim)
        assert shard.weight.shape == (part, dim)
        with torch.no_grad():
            shard.weight.copy_(w_pad[r * part : (r + 1) * part])
            shard.scale.copy_(s_pad[r * part : (r + 1) * part])
        total += shard(idx).float()
    torch.testing.assert_close(total.bfloat16(), want, atol=0, rtol=0)


def _engram(dtype: str, seed: int = 0) -> tuple[Engram, ModelArgs, EngramLayout]:
    args = _args(dtype)
    layout = EngramLayout.from_args(args)
    with dense_dtype(args):
        module = Engram(args, 1, layout)
    _fill(module, torch.Generator().manual_seed(seed))
    return module, args, layout


def test_gate_matches_plain_formula():
    module, args, layout = _engram("bf16")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, args.hc_mult, args.dim, generator=gen).bfloat16()
    hashes = torch.randint(0, layout.num_embeddings[1], (2, 5, layout.n_hash_cols), generator=gen)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 2] = False
    got = module(x, hashes, mask)

    rows = _dequant_rows(module.embed.weight, module.embed.scale).bfloat16()[hashes].flatten(-2)
    kv = (rows @ module.wkv.weight.T).float()
    d, hc = args.dim, args.hc_mult
    key, value = kv[..., : hc * d].view(2, 5, hc, d), kv[..., hc * d :]
    h = x.float()
    w = module.q_weight.float() * module.k_weight.float()
    eps = args.norm_eps
    want = torch.empty_like(h)
    for b in range(2):
        for t in range(5):
            for c in range(hc):
                hv, kv_ = h[b, t, c], key[b, t, c]
                dot = (hv * w[c] * kv_).sum() / torch.sqrt(hv.square().mean() + eps)
                dot = dot / torch.sqrt(kv_.square().mean() + eps) / d**0.5
                root = max(abs(dot.item()), 1e-6) ** 0.5
                gate = torch.sigmoid(torch.tensor(root if dot >= 0 else -root)) if mask[b, t] else 0.0
                want[b, t, c] = hv + gate * value[b, t]
    # fp32 sums in another order; one bf16 rounding of the result
    torch.testing.assert_close(got.float(), want.bfloat16().float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(got[1, 2], x[1, 2])  # closed gate: untouched


def test_wrong_row_changes_output_only_where_read():
    module, args, layout = _engram("fp8")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 6, args.hc_mult, args.dim, generator=gen).bfloat16()
    hashes = torch.randint(0, layout.num_embeddings[1], (1, 6, layout.n_hash_cols), generator=gen)
    before = module(x, hashes)
    row = int(hashes[0, 4, 7])
    with torch.no_grad():
        module.embed.weight[row] = (module.embed.weight[row].float() * -1 + 8).to(torch.float8_e4m3fn)
    after = module(x, hashes)
    reads = (hashes[0] == row).any(-1)
    changed = (after != before).flatten(2).any(-1)[0]
    assert changed[4] and torch.equal(changed, reads & changed)
    assert not changed[~reads].any()
