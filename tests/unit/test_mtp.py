"""DSpark stages: the draft block layout, the window over the main positions, the heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv41_convert.config import ModelArgs
from dsv41_convert.model.layers import ParallelEmbedding, dense_dtype
from dsv41_convert.model.mtp import DSparkAttention, DSparkBlock, get_dspark_topk_idxs
from dsv41_convert.synth.presets import TINY, hf_config


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    a = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405, vision=False))
    return dataclasses.replace(a, dtype="bf16", expert_dtype=None).with_runtime(max_batch_size=2, max_seq_len=64)


def _fill(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def test_topk_idxs_window_then_whole_block():
    idx = get_dspark_topk_idxs(16, 2, 5, 3)
    assert idx.shape == (2, 5, 4 + 5) and idx.dtype == torch.int32
    assert idx[1, 4].tolist() == [0, 1, 2, 3, 16, 17, 18, 19, 20]
    full = get_dspark_topk_idxs(16, 1, 5, 40)
    assert full[0, 0].tolist() == list(range(21))
    assert torch.equal(full[0, 0], full[0, 4])  # no causal mask inside the block


def test_prefill_fills_ring_slots_with_main_positions(args):
    stage = args.n_layers
    assert args.compress_ratios[stage] == 0
    with dense_dtype(args):
        attn = DSparkAttention(stage, args)
    _fill(attn, 0)
    main_x = torch.randn(1, 21, args.dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    x = torch.randn(1, 5, args.dim).bfloat16()
    assert attn(x, 0, main_x) is x  # prefill returns its input untouched
    kv = attn._main_kv(main_x, 0)
    win = args.window_size
    for p in range(21 - win, 21):
        assert torch.equal(attn.window_kv_cache[0, p % win], kv[0, p])
    out = attn(x, 21, main_x[:, -1:])
    assert out.shape == (1, 5, args.dim) and out.isfinite().all()
    with pytest.raises(ValueError, match="one main position"):
        attn(x, 22, main_x[:, -2:])


def test_draft_block_is_token_then_noise(args):
    with dense_dtype(args):
        first = DSparkBlock(args.n_layers, args)
        last = DSparkBlock(args.n_layers + args.n_mtp_layers - 1, args)
        embed = ParallelEmbedding(args.vocab_size, args.dim)
    assert hasattr(first, "main_proj") and hasattr(first, "main_norm") and not hasattr(first, "markov_head")
    assert hasattr(last, "markov_head") and hasattr(last, "confidence_head") and not hasattr(last, "main_proj")
    assert first.ffn.n_routed_experts == args.dspark_n_routed_experts
    assert first.ffn.gate.topk == args.dspark_n_activated_experts
    _fill(first, 2)
    _fill(embed, 3)
    first.embed = embed
    hidden = torch.randn(2, 4, 3 * args.dim).bfloat16()
    x, main_x = first.forward_embed(hidden, torch.tensor([7, 9]))
    k, noise = args.dspark_block_size, args.dspark_noise_token_id
    want = embed(torch.tensor([[7] + [noise] * (k - 1), [9] + [noise] * (k - 1)]))
    assert x.shape == (2, k, args.hc_mult, args.dim)
    for c in range(args.hc_mult):
        assert torch.equal(x[:, :, c], want)
    assert torch.equal(main_x, first.main_norm(first.main_proj(hidden)))


def test_markov_head_and_confidence(args):
    with dense_dtype(args):
        last = DSparkBlock(args.n_layers + args.n_mtp_layers - 1, args)
    _fill(last, 4)
    ids = torch.tensor([3, 100])
    bias, emb = last.markov_head(ids)
    assert bias.shape == (2, args.vocab_size) and bias.dtype == torch.float32
    assert torch.equal(emb, last.markov_head.embed.weight[ids])
    torch.testing.assert_close(bias, emb.float() @ last.markov_head.head.weight.T, atol=0, rtol=0)
    hidden = torch.randn(2, 5, args.dim).bfloat16()
    markov = torch.randn(2, 5, args.dspark_markov_rank).bfloat16()
    conf = last.confidence_head(hidden, markov)
    want = torch.cat([hidden, markov], -1).float() @ last.confidence_head.proj.weight[0]
    assert conf.shape == (2, 5)
    torch.testing.assert_close(conf, want, atol=1e-5, rtol=1e-5)
