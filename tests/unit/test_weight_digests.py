"""verify/weight_digests.py: the sha256 of every weight a reference ran, and rank files against them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_ckpt import make_tiny

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.unshard import RankFiles
from dsv41_convert.verify import weight_digests
from dsv41_convert.verify.source import plan_state


@pytest.fixture(scope="module")
def conversion(tmp_path_factory):
    """A tiny source, its tp-2 rank files, and the records of its tp-1 and tp-2 conversions in memory."""
    root = tmp_path_factory.mktemp("digests")
    src = make_tiny(root / "src", vision=False)
    execute(build_plan(src, 2, "fp4"), root / "mp2")
    records = {}
    for tp in (1, 2):
        plan = build_plan(src, tp, "fp4")
        records[tp] = weight_digests.record([weight_digests.digests(plan_state(plan, r)) for r in range(tp)], "fp4")
    return root / "mp2", records


def _changed(folder, rank: int, name: str):
    path = folder / f"model{rank}-mp2.safetensors"
    tensors = load_file(str(path))
    raw = tensors[name].view(torch.uint8).clone()
    raw.view(-1)[0] ^= 1
    tensors[name] = raw.view(tensors[name].dtype)
    save_file(tensors, str(path))


def test_a_correct_conversion_matches_both_records(conversion):
    folder, records = conversion
    with RankFiles(folder) as ranks:
        for tp, how in ((2, "each rank file"), (1, "merged to tp 1")):
            found, note = weight_digests.compare(records[tp], ranks)
            assert found == [] and how in note, (tp, found)
        assert weight_digests.compare(weight_digests.record([{}] * 4, "fp4"), ranks)[0] is None


@pytest.mark.parametrize("name", ["layers.0.ffn.experts.1.w1.weight", "layers.0.attn.wq_b.scale", "embed.weight"])
def test_one_changed_bit_is_named_against_either_record(conversion, tmp_path, name):
    folder, records = conversion
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    with RankFiles(bad) as ranks:
        rank = next(r for r in range(2) if name in ranks.headers[r].tensors)
    _changed(bad, rank, name)
    with RankFiles(bad) as ranks:
        same_tp, _ = weight_digests.compare(records[2], ranks)
        merged, _ = weight_digests.compare(records[1], ranks)
        skipped, note = weight_digests.compare(records[2] | {"expert_dtype": "fp8"}, ranks)
    assert len(same_tp) == 1 and same_tp[0].startswith(f"{name} on rank {rank}: sha256 "), same_tp
    assert len(merged) == 1 and merged[0].startswith(f"{name}: sha256 "), merged
    if ".experts." in name:  # another expert dtype in the record: the experts are not compared, and said so
        assert skipped == [] and "routed experts not compared" in note
    else:
        assert skipped == same_tp


def test_a_malformed_record_is_named():
    assert weight_digests.problems(weight_digests.record([{"a": "00"}], "fp4")) == []
    for bad in ([], {"tp": 2, "expert_dtype": "fp4", "ranks": [{}]}, {"tp": 1, "expert_dtype": "x", "ranks": [{}]},
                {"tp": 1, "expert_dtype": "fp4", "ranks": [{"a": 1}]}):  # fmt: skip
        assert weight_digests.problems(bad) and "provenance.weights" in weight_digests.problems(bad)[0]


def test_the_merge_to_tp_1_holds_one_tensor_at_a_time(conversion, monkeypatch):
    """verify --no-replay exists for a model too large to merge in one process: the weights check against a
    tp-1 record must not merge it whole either (the first version did)."""
    folder, records = conversion
    real, asked = weight_digests.unshard_tensors, []

    def one_at_a_time(ranks, names=None, tp=None):
        asked.append(None if names is None else len(names))
        return real(ranks, names)

    monkeypatch.setattr(weight_digests, "unshard_tensors", one_at_a_time)
    with RankFiles(folder) as ranks:
        assert weight_digests.compare(records[1], ranks)[0] == []
    assert asked and set(asked) == {1}
