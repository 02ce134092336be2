"""The tensor-parallel modules at world size 2 without processes: each rank's module is built with
its slice of a whole weight, and its one collective is emulated by running every rank twice (first
recording what each rank hands to the collective, then giving each rank the sum / concatenation of
all of them). The ranks' results must equal the one-rank module's.

Catches a collective left out or put in the wrong place (a RowParallel partial never summed, the
shared expert summed over ranks, a head that does not gather) and a rank owning the wrong rows.
The real process-group runs are tests/integration/test_model_tp.py (marked dist).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from model_testing import tiny_args

from dsv41_convert.model import parallel
from dsv41_convert.model.head import ParallelHead
from dsv41_convert.model.layers import ParallelEmbedding, RowParallelLinear, dense_dtype
from dsv41_convert.model.moe import MoE

WORLD = 2


def _on_ranks(monkeypatch, run: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    """run(rank) builds rank's module and calls it once; -> each rank's result with the collective done."""
    handed: list[list[torch.Tensor]] = [[] for _ in range(WORLD)]

    def one(r: int, record: bool) -> torch.Tensor:
        monkeypatch.setattr(parallel, "world_size", lambda: WORLD)
        monkeypatch.setattr(parallel, "rank", lambda: r)

        def all_reduce(x):
            if record:
                handed[r].append(x.clone())
            else:
                x.copy_(sum(h[0].double() for h in handed).to(x.dtype))
            return x

        def all_gather_last(x):
            if record:
                handed[r].append(x.clone())
                return x
            return torch.cat([h[0] for h in handed], dim=-1)

        monkeypatch.setattr(parallel, "all_reduce", all_reduce)
        monkeypatch.setattr(parallel, "all_gather_last", all_gather_last)
        return run(r)

    for r in range(WORLD):
        one(r, record=True)
    assert all(len(h) == 1 for h in handed), "one collective per call"
    return [one(r, record=False) for r in range(WORLD)]


def test_row_parallel_linear_sums_the_ranks_partials(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(24, 64, generator=gen) * 0.2).bfloat16()
    x = torch.randn(3, 64, generator=gen).bfloat16()

    def run(r):
        lin = RowParallelLinear(64, 24, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(w.chunk(WORLD, dim=1)[r])
        return lin(x.chunk(WORLD, dim=-1)[r])

    want = (x.double() @ w.double().T).bfloat16()
    for got in _on_ranks(monkeypatch, run):
        # each partial rounded to bf16, summed in fp32, rounded again: two bf16 steps at most
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)


def test_embedding_ranks_own_contiguous_vocab_rows(monkeypatch):
    table = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)).bfloat16()
    ids = torch.tensor([[0, 7, 8, 15], [3, 12, 8, 7]])

    def run(r):
        emb = ParallelEmbedding(16, 4)
        with torch.no_grad():
            emb.weight.copy_(table.chunk(WORLD)[r])
        return emb(ids)

    for got in _on_ranks(monkeypatch, run):
        assert torch.equal(got, table[ids])


def test_head_gathers_the_vocab_slices_in_rank_order(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 8, generator=gen)
    x = torch.randn(2, 3, 8, generator=gen).bfloat16()

    def run(r):
        head = ParallelHead(16, 8)
        with torch.no_grad():
            head.weight.copy_(w.chunk(WORLD)[r])
        return head(x)

    for got in _on_ranks(monkeypatch, run):
        torch.testing.assert_close(got, x[:, -1].float() @ w.T, atol=1e-6, rtol=1e-6)


def test_moe_sums_routed_experts_over_ranks_and_adds_the_shared_expert_once(monkeypatch):
    args = tiny_args(dtype="bf16", expert_dtype=None)
    with dense_dtype(args):
        whole = MoE(0, args)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.2).to(p.dtype))
    x = torch.randn(2, 5, args.dim, generator=gen).bfloat16()
    want = whole(x)
    state = whole.state_dict()

    def run(r):
        with dense_dtype(args):
            moe = MoE(0, args)
        moe.load_state_dict({k: v for k, v in state.items() if k in moe.state_dict()}, strict=True)
        assert sum(e is not None for e in moe.experts) == args.n_routed_experts // WORLD
        return moe(x)

    for got in _on_ranks(monkeypatch, run):
        # fp32 sums of the experts in another grouping, one bf16 rounding: one bf16 step at most
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-7)
