"""DSpark against written-out expectations: the draft block's attention (queries at the positions
after the main one, over the main positions' window and the whole block), each draft's Markov bias
taken from the token drafted just before it, and the stage input the backbone hands over (the hc
mean of a target layer's input stream).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from model_formulas import assert_near, attend, e4m3_round_trip, grouped_out, rms, rope_tail
from torch import nn

from dsv41_convert.config import ModelArgs
from dsv41_convert.model.layers import dense_dtype
from dsv41_convert.model.mtp import DSparkAttention, draft_outputs
from dsv41_convert.model.transformer import block_step
from dsv41_convert.synth.presets import TINY, hf_config

ARGS = dataclasses.replace(
    ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405, vision=False)), dtype="bf16", expert_dtype=None
).with_runtime(max_batch_size=2, max_seq_len=64)


def _attention() -> DSparkAttention:
    with dense_dtype(ARGS):
        attn = DSparkAttention(ARGS.n_layers, ARGS)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name == "attn_sink":
                p.copy_(torch.linspace(-1.0, 2.0, p.numel()))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return attn


def test_draft_block_attends_from_the_positions_after_the_main_one():
    """Main positions 0..n (n = 6 < window: all in the window); drafts at n+1..n+K see all of them and
    each other (no causal mask inside the block); window-only RoPE at rope_theta."""
    attn = _attention()
    gen = torch.Generator().manual_seed(1)
    n, k = 6, ARGS.dspark_block_size
    main = torch.randn(1, n + 1, ARGS.dim, generator=gen).bfloat16()
    draft = torch.randn(1, k, ARGS.dim, generator=gen).bfloat16()
    attn(draft, 0, main[:, :n])  # prefill: main positions 0..n-1 into the window
    got = attn(draft.clone(), n, main[:, n:])

    rd, d, eps, theta = attn.rope_head_dim, attn.head_dim, ARGS.norm_eps, ARGS.rope_theta
    main_pos, draft_pos = torch.arange(n + 1), torch.arange(n + 1, n + 1 + k)

    def kv(x, pos):
        return e4m3_round_trip(rope_tail(rms(F.linear(x, attn.wkv.weight), attn.kv_norm.weight, eps), rd, pos, theta))

    keys = torch.cat([kv(main, main_pos), kv(draft, draft_pos)], dim=1)
    qr = rms(F.linear(draft, attn.wq_a.weight), attn.q_norm.weight, eps)
    q = rope_tail(F.linear(qr, attn.wq_b.weight).unflatten(-1, (attn.n_heads, d)), rd, draft_pos, theta)
    o = attend(q, keys, torch.ones(k, keys.size(1), dtype=torch.bool), attn.attn_sink)
    o = rope_tail(o, rd, draft_pos, theta, inverse=True)
    assert_near(got, grouped_out(o, attn.wo_a.weight, attn.wo_b.weight, attn.n_groups))


class _Heads(nn.Module):
    """Stand-in last stage: no head logits, a Markov bias that favours (previous token + 1) % V."""

    vocab = 11
    block_size = 4
    temperature = 0.0

    def norm(self, x):
        return x

    def head(self, x, full_logits):
        return torch.zeros(x.size(0), x.size(1), self.vocab)

    def markov_head(self, ids):
        bias = F.one_hot((ids + 1) % self.vocab, self.vocab).float() * 5.0
        return bias, ids.float().unsqueeze(-1).bfloat16()

    def confidence_head(self, x, markov_embed):
        return markov_embed.float().squeeze(-1)


def test_each_draft_takes_its_markov_bias_from_the_draft_before_it():
    heads = _Heads()
    x = torch.zeros(2, heads.block_size, 3, dtype=torch.bfloat16)
    ids, logits, confidence = draft_outputs(heads, x, torch.tensor([3, 9]))
    assert ids.tolist() == [[3, 4, 5, 6, 7], [9, 10, 0, 1, 2]]
    assert confidence.tolist() == [[3, 4, 5, 6], [9, 10, 0, 1]]  # the embedding of each draft's predecessor
    assert logits[0, 2].argmax().item() == 6 and logits[0, 2].max().item() == 5.0


class _Layer(nn.Module):
    engram = None

    def forward(self, h, start_pos, pre_mix, image_mask):
        return h * 2, pre_mix


def test_dspark_target_is_the_hc_mean_of_the_layer_input():
    h = torch.randn(1, 3, 4, 8, generator=torch.Generator().manual_seed(2)).bfloat16()
    out, _, target = block_step(_Layer(), h, 0, torch.zeros(1, 3, 4), None, None, None)
    want = (h.float().sum(dim=2) / 4).bfloat16()
    assert torch.equal(out, h * 2)
    torch.testing.assert_close(target.float(), want.float(), atol=0, rtol=2**-8)
