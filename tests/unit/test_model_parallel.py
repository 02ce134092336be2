"""model/parallel.py on a stand-in torch.distributed of two ranks (the real collectives run in the dist tests,
which the quick suite leaves out): what each helper asks of the process group and what it returns."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv41_convert.model import parallel


@pytest.fixture
def two_ranks(monkeypatch) -> list[str]:
    """parallel's `dist` as rank 0 of two, whose peer holds 10 + its own tensor; the collectives called."""
    calls: list[str] = []

    def all_reduce(x: torch.Tensor) -> None:
        calls.append("all_reduce")
        x.add_(x + 10)

    def all_gather(parts: list[torch.Tensor], x: torch.Tensor) -> None:
        calls.append("all_gather")
        parts[0].copy_(x)
        parts[1].copy_(x + 10)

    fake = SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        get_world_size=lambda: 2,
        get_rank=lambda: 0,
        all_reduce=all_reduce,
        all_gather=all_gather,
    )
    monkeypatch.setattr(parallel, "dist", fake)
    return calls


def test_all_reduce_sums_over_two_ranks(two_ranks: list[str]):
    """At tp=2 the row-parallel partial sums must be summed. Catches the reduce skipped below three ranks."""
    x = torch.tensor([1.0, 2.0])
    assert parallel.all_reduce(x) is x
    assert two_ranks == ["all_reduce"] and x.tolist() == [12.0, 14.0]  # 1 + 11, 2 + 12


def test_all_gather_last_concatenates_the_ranks_along_the_last_dim(two_ranks: list[str]):
    """The head's vocab slices: [..., n] from each rank -> [..., 2n], rank 0's columns first. Catches the
    slices stacked along the first dim (rows of another token)."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    got = parallel.all_gather_last(x)
    assert two_ranks == ["all_gather"]
    assert got.tolist() == [[1.0, 2.0, 11.0, 12.0], [3.0, 4.0, 13.0, 14.0]]


def test_one_process_without_a_group_is_rank_0_of_1():
    """No process group: one rank, and the collectives give their input back untouched."""
    assert not parallel.is_distributed() and (parallel.world_size(), parallel.rank()) == (1, 0)
    x = torch.tensor([[1.0, 2.0]])
    assert parallel.all_reduce(x) is x and parallel.all_gather_last(x) is x and x.tolist() == [[1.0, 2.0]]
