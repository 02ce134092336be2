"""A candidate block wider than the compressed positions is one block of all of them.

`candidate_block_size` 10**12 in config.json was accepted (any positive number), then the indexer padded its
scores to a multiple of the block: reference-logits died in the allocator's traceback ("you tried to allocate
80000000000000 bytes", exit 1; a helper's bug hunt, 2026-12-07). The block is now cut to the positions there,
which keeps the same blocks."""

from __future__ import annotations

import torch

from dsv41_convert.model.indexer import select_candidate_blocks


def test_a_block_wider_than_the_positions_keeps_what_one_block_of_them_keeps():
    torch.manual_seed(0)
    scores = torch.randn(1, 3, 10)
    scores[0, 0, 5:] = -torch.inf  # the first query sees 5 positions
    lens = torch.tensor([[5], [10], [10]])
    want = select_candidate_blocks(scores, lens, 2, 10)
    assert torch.equal(select_candidate_blocks(scores, lens, 2, 10**12), want)
    assert torch.equal(select_candidate_blocks(scores, 7, 1, 10**12), select_candidate_blocks(scores, 7, 1, 10))
