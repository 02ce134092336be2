"""Attention pieces: window indices, candidate blocks, the compressor's state, and which layer
reads which other layer's caches (every block type of the schedule)."""

from __future__ import annotations

import pytest
import torch
from model_testing import random_state_dict, tiny_args

from dsv41_convert.model import Transformer
from dsv41_convert.model.attention import get_window_topk_idxs
from dsv41_convert.model.compressor import Compressor
from dsv41_convert.model.indexer import select_candidate_blocks
from dsv41_convert.model.load import expected_tensors


@pytest.fixture(scope="module")
def model() -> Transformer:
    args = tiny_args()
    m = Transformer(args)
    sd = random_state_dict(args, seed=0)
    with torch.no_grad():
        for name, (p, _) in expected_tensors(m).items():
            p.copy_(sd[name].to(p.dtype))
    return m


def test_window_idxs_prefill_is_causal_window():
    idxs = get_window_topk_idxs(3, 2, 5, 0)
    want = torch.tensor([[0, -1, -1], [0, 1, -1], [0, 1, 2], [1, 2, 3], [2, 3, 4]], dtype=torch.int32)
    assert idxs.shape == (2, 5, 3) and torch.equal(idxs[1], want)


def test_window_idxs_decode_walks_the_ring_oldest_first():
    # position 4 in a ring of 3: slots hold positions 3 (slot 0), 4 (slot 1), 2 (slot 2)
    assert get_window_topk_idxs(3, 1, 1, 4).tolist() == [[[2, 0, 1]]]
    # position 1: the ring is still filling, slot 2 is empty
    assert get_window_topk_idxs(3, 1, 1, 1).tolist() == [[[-1, 0, 1]]]


def test_candidate_blocks_keep_best_blocks_and_pin_the_newest():
    inf = float("inf")
    # 10 positions in blocks of 4 (last block padded); query sees 9 positions (index 9 unreachable)
    scores = torch.tensor([[[5.0, 0, 0, 0, 1, 1, 1, 9, 0, -inf]]])
    keep = select_candidate_blocks(scores, 9, topk_blocks=2, block_size=4)
    # block 2 holds the newest position (8) and is pinned; the best other block is block 1 (9.0)
    assert keep[0, 0].tolist() == [False] * 4 + [True] * 4 + [True, True]
    # an unreachable block is never kept, even when fewer blocks than topk_blocks are reachable
    only_first = torch.tensor([[[1.0, 2.0, -inf, -inf, -inf, -inf]]])
    keep = select_candidate_blocks(only_first, 2, topk_blocks=3, block_size=2)
    assert keep[0, 0].tolist() == [True, True, False, False, False, False]


def test_compressor_decode_matches_prefill():
    args = tiny_args()
    comp = Compressor(args, 1)  # ratio 2
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        comp.wkv.weight.copy_(torch.randn(comp.wkv.weight.shape, generator=g) * 0.1)
        comp.wgate.weight.copy_(torch.randn(comp.wgate.weight.shape, generator=g) * 0.1)
    x = torch.randn(2, 9, args.dim, generator=g).bfloat16()
    full = comp(x, 0)  # 4 groups; position 8 waits in the state
    assert full.shape == (2, 4, args.head_dim) and full.dtype == torch.bfloat16
    head = comp(x[:, :3], 0)  # 1 group, position 2 waits
    assert head.shape == (2, 1, args.head_dim)
    steps = []
    for p in range(3, 9):
        out = comp(x[:, p : p + 1], p)
        assert (out is None) == (p % 2 == 0)  # a group completes at odd positions
        if out is not None:
            steps.append(out)
    decoded = torch.cat([head, *steps], dim=1)
    # wkv/wgate are fp32 GEMMs of 2 rows vs 18 rows: fp32 summation order may differ, which can
    # move the bf16 result by one rounding step
    torch.testing.assert_close(decoded.float(), full.float(), atol=0, rtol=2**-7)


def _attention_stack(model: Transformer, x: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's attention on the same input, in layer order (so sources publish first)."""
    return [layer.attn(x.clone(), 0) for layer in model.layers]


def _perturb(param: torch.nn.Parameter) -> None:
    with torch.no_grad():
        if param.dtype == torch.float8_e4m3fn:
            param.copy_((param.float() * -1).to(param.dtype))
        else:
            param.mul_(-1)


@pytest.mark.parametrize(
    ("param", "changed"),
    [
        ("layers.1.attn.compressor.wkv.weight", {1, 2}),  # ratio-2 kv source feeds its consumer
        ("layers.1.attn.indexer.wq_b.weight", {1, 2}),  # ratio-2 index source: layer 2 reuses its choice
        ("layers.3.attn.compressor.wkv.weight", {3, 4, 5}),  # ratio-1 kv source: keys, cache for 4, 5
        ("layers.3.attn.indexer.wq_b.weight", {3, 4, 5}),  # candidate source: choice for 4, candidates for 5
        ("layers.5.attn.indexer.wq_b.weight", {5}),  # index source using candidates: itself only
        ("layers.0.attn.wkv.weight", {0}),  # window only
    ],
)
def test_each_block_type_reads_the_right_source(model, param, changed):
    x = torch.randn(2, 40, model.args.dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    before = _attention_stack(model, x)
    p = dict(model.named_parameters())[param]
    saved = p.detach().clone()
    _perturb(p)
    try:
        after = _attention_stack(model, x)
    finally:
        with torch.no_grad():
            p.copy_(saved)
    moved = {i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not torch.equal(a, b)}
    assert moved == changed


def test_block_types_of_the_tiny_schedule(model):
    kinds = [
        (
            layer.attn.compress_ratio,
            layer.attn.compressor is not None,
            layer.attn.indexer is not None,
            layer.attn.indexer is not None and layer.attn.indexer.is_candidate_source,
            layer.attn.indexer is not None and layer.attn.indexer.uses_candidates,
        )
        for layer in model.layers
    ]
    assert kinds == [
        (0, False, False, False, False),
        (2, True, True, False, False),
        (2, False, False, False, False),
        (1, True, True, True, False),
        (1, False, False, False, False),
        (1, False, True, False, True),
    ]
    assert model.layers[1].attn.compressor.wgate is not None
    assert not hasattr(model.layers[3].attn.compressor, "wgate")  # ratio 1: no pooling gate
