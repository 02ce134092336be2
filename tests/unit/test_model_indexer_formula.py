"""The indexer's choice against its scores written out: fp4-rounded query heads (RoPE at the query's
position) against one fp4-rounded key per compressed position (k_norm(wk(latent)), RoPE at the group's
first token j * ratio), ReLU, weighted per head by weights_proj(x) * index_head_dim**-0.5 *
n_heads**-0.5, summed over heads; a query sees the groups it has passed; the top index_topk are kept.

The fp4 round trips are quant.act.fp4_act_quant (tested against its definition in test_quant_act.py).
The model scores in bf16, so near-ties may be kept either way: the check is that no visible position
left out scores more than 2% of the row's largest score above the weakest one kept (measured: at
most 0.04%, one near-tie). Catches a dropped ReLU, RoPE on the wrong dims, a query
left unrounded, a choice of the wrong size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from model_formulas import rms, rope_tail
from model_testing import tiny_args

from dsv41_convert.model.indexer import Indexer
from dsv41_convert.model.layers import dense_dtype
from dsv41_convert.model.runtime import SharedAttentionRuntime
from dsv41_convert.quant.act import fp4_act_quant

ARGS = tiny_args(dtype="bf16", expert_dtype=None)
SEQ = 40  # 20 compressed positions at ratio 2, more than index_topk (8)
THETA = 10000.0


def test_index_source_keeps_the_top_scoring_visible_positions():
    with dense_dtype(ARGS):
        idx = Indexer(ARGS, 1)  # ratio 2, owns its keys, no candidates
    assert idx.owns_k and not idx.is_candidate_source and not idx.uses_candidates
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in idx.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    x = torch.randn(2, SEQ, ARGS.dim, generator=gen).bfloat16()
    qr = torch.randn(2, SEQ, ARGS.q_lora_rank, generator=gen).bfloat16()
    latent = torch.randn(2, SEQ // 2, ARGS.head_dim, generator=gen).bfloat16()
    rd, d, h, ratio = ARGS.rope_head_dim, ARGS.index_head_dim, ARGS.index_n_heads, 2
    angles = torch.arange(ARGS.max_seq_len, dtype=torch.float64)[:, None] * THETA ** (
        -torch.arange(0, rd, 2, dtype=torch.float64) / rd
    )
    freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    got = idx(x, qr, latent.clone(), 0, 0, freqs_cis, SharedAttentionRuntime())

    k = rope_tail(
        rms(F.linear(latent, idx.wk.weight), idx.k_norm.weight, ARGS.norm_eps), rd, torch.arange(0, SEQ, ratio), THETA
    )
    q = rope_tail(F.linear(qr, idx.wq_b.weight).unflatten(-1, (h, d)), rd, torch.arange(SEQ), THETA)
    k, q = fp4_act_quant(k, 32, True).double(), fp4_act_quant(q, 32, True).double()
    w = F.linear(x, idx.weights_proj.weight).double() * d**-0.5 * h**-0.5
    scores = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(2)  # [b, s, t]

    assert got.shape == (2, SEQ, ARGS.index_topk)
    for b in range(2):
        for s in range(SEQ):
            seen = (s + 1) // ratio
            kept = [i for i in got[b, s].tolist() if i >= 0]
            assert kept == sorted(kept) and all(i < seen for i in kept)
            assert len(kept) == min(ARGS.index_topk, seen), f"query {s}: kept {kept} of {seen} visible"
            if seen > ARGS.index_topk:
                row = scores[b, s, :seen]
                out = [i for i in range(seen) if i not in kept]
                gap = row[out].max() - row[kept].min()
                assert gap <= 2e-2 * row.abs().max(), f"query {s}: left out a position scoring {gap:.3g} higher"
