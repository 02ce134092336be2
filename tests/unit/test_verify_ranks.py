"""verify.ranks: every rank's load error is gathered before the forward pass, and the twin's bytes are compared
tensor by tensor."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from dsv41_convert.verify import ranks
from dsv41_convert.verify.ranks import LoadFailure, RankJob, RankResult


def test_a_load_failure_on_any_rank_stops_every_rank_naming_only_those_that_failed(monkeypatch):
    """Rank 1 of 3 cannot load its shard while ranks 0 and 2 can: every rank must return the failure (rank 0
    went on to the forward pass, whose collectives hung on the rank that stopped), listing rank 1 alone."""
    monkeypatch.setattr(ranks, "load_model_args", lambda _path: SimpleNamespace(with_runtime=lambda **_: "args"))
    monkeypatch.setattr(ranks, "build_model", lambda *_args, **_kw: nn.Linear(2, 2))
    monkeypatch.setattr(ranks, "_try_load", lambda _model, _folder: "")  # this rank (0) loads
    monkeypatch.setattr(ranks.parallel, "is_distributed", lambda: True)
    monkeypatch.setattr(ranks.parallel, "world_size", lambda: 3)

    def all_gather_object(out: list, mine: str) -> None:
        out[:] = [mine, "model1-mp3.safetensors: layers.0.attn.wkv.weight missing", ""]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)

    def every_rank_loads(out: list, mine: str) -> None:
        out[:] = [mine, "", ""]

    job = RankJob("folder", 64, [], [], 0, "cpu")
    got = ranks.run_converted(job)
    assert got == LoadFailure([(1, "model1-mp3.safetensors: layers.0.attn.wkv.weight missing")])
    monkeypatch.setattr(torch.distributed, "all_gather_object", every_rank_loads)
    assert ranks.run_converted(job) == RankResult([], None, 0.0, None)


def _bytes_differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.numpy().view(np.uint8) != b.numpy().view(np.uint8)).sum())


def test_differing_weights_names_each_tensor_whose_bytes_differ_and_counts_them():
    """The twin check compares every weight byte for byte, a bf16 twin tensor widened to the fp32 parameter as
    the load widens it (exactly): equal tensors are not listed, a changed one is, with its count of bytes."""
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8)  # exact in bf16
        model[1].weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) - 2.5)
    want = {"0.weight": model[0].weight.detach().to(torch.bfloat16), "1.weight": model[1].weight.detach().clone()}
    assert ranks.differing_weights(model, want) == []
    want["1.weight"][1, 2] = 7.0
    n = _bytes_differing(model[1].weight.detach(), want["1.weight"])
    assert 0 < n <= 4
    assert ranks.differing_weights(model, want) == [f"1.weight on rank 0: {n} of 24 bytes differ"]


def test_a_shard_whose_header_is_damaged_is_a_load_failure_not_a_crash(tmp_path: Path):
    """A rank file cut short (its header unreadable: HeaderError) must be reported as this rank's load failure,
    which the ranks exchange before any collective; raised, it ended this rank while its peers waited."""
    (tmp_path / "model0-mp1.safetensors").write_bytes(b"\x10\x00")
    assert "model0-mp1.safetensors: file is 2 bytes, too short" in ranks._try_load(nn.Linear(2, 2), tmp_path)
