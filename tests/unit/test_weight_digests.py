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
    """A tiny source, its tp-2 rank files, and the records of its tp-1, 2, 4 and 8 conversions in memory."""
    root = tmp_path_factory.mktemp("digests")
    src = make_tiny(root / "src", vision=False)
    execute(build_plan(src, 2, "fp4"), root / "mp2")
    records = {}
    for tp in (1, 2, 4, 8):
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


def test_a_correct_conversion_matches_the_record_of_every_tp(conversion):
    """tp-2 rank files against records made at tp 1, 2, 4 and 8: at another tp than the record's they were "not
    compared" unless the record was tp 1; now cut into the record's ranks from their merge (Engram padding,
    experts on their owners, dim-1 pieces), every tensor equal."""
    folder, records = conversion
    how = {1: "merged to tp 1", 2: "each rank file", 4: "cut to tp 4", 8: "cut to tp 8"}
    with RankFiles(folder) as ranks:
        for tp, said in how.items():
            found, note = weight_digests.compare(records[tp], ranks)
            assert found == [] and said in note, (tp, found)
        found, _ = weight_digests.compare(weight_digests.record([{}] * 4, "fp4"), ranks)
        assert found and all("not in the reference's record" in f for f in found)


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
        cut, _ = weight_digests.compare(records[8], ranks)
        skipped, note = weight_digests.compare(records[2] | {"expert_dtype": "fp8"}, ranks)
    assert len(same_tp) == 1 and same_tp[0].startswith(f"{name} on rank {rank}: sha256 "), same_tp
    # a tensor one rank file holds (an expert) names that file also against a record of another tp (it
    # did not: an audit); a tensor all of them hold pieces of cannot be blamed on one
    held_by = f" (in model{rank}-mp2.safetensors)" if ".experts." in name else ""
    assert len(merged) == 1 and merged[0].startswith(f"{name}{held_by}: sha256 "), merged
    # the first byte's tp-8 piece: rank 0's (a row split), or the expert's owner
    owner = next(r for r in range(8) if name in records[8]["ranks"][r])
    assert len(cut) == 1 and cut[0].startswith(f"{name} in tp-8 rank {owner}{held_by}: sha256 "), cut
    if ".experts." in name:  # another expert dtype in the record: the experts are not compared, and said so
        assert skipped == [] and "routed experts not compared" in note
    else:
        assert skipped == same_tp


def test_a_malformed_record_is_named(conversion):
    """An edited or damaged record is refused with the file (exit 2), not blamed on CONVERTED: a tp of 0 crashed
    verify (ZeroDivisionError, exit 1, no JSON), a digest "zz" and an impossible tp 3 failed CONVERTED, and an
    expert dtype edited to fp8 switched the experts' comparison off, so a faulty expert passed (an audit)."""
    import json

    folder, records = conversion
    model = json.loads((folder / "config.json").read_text())  # the inference config a reference records
    good = records[2]
    assert weight_digests.problems(good, model) == [] and weight_digests.problems(good) == []
    digest = "0" * 64
    shape = 'metadata provenance.weights must be {"tp", "expert_dtype", "ranks": [{name: sha256}]}'
    for bad in (
        [],
        {"tp": 2, "expert_dtype": "fp4", "ranks": [{}]},
        {"tp": 1, "expert_dtype": "x", "ranks": [{}]},
        {"tp": 0, "expert_dtype": "fp4", "ranks": []},
        {"tp": True, "expert_dtype": "fp4", "ranks": [{}]},
    ):
        assert weight_digests.problems(bad) == [shape], bad
    for digest_bad in (1, "zz", "A" * 64):
        found = weight_digests.problems({"tp": 1, "expert_dtype": "fp4", "ranks": [{"a": digest_bad}]})
        assert found and "64 lowercase hex digits" in found[0], digest_bad
    found = weight_digests.problems(good | {"expert_dtype": "fp8"}, model)
    assert found and "expert_dtype 'fp8', but the model it ran" in found[0] and "as fp4" in found[0]
    found = weight_digests.problems({"tp": 3, "expert_dtype": "fp4", "ranks": [{"a": digest}] * 3}, model)
    assert found and found[0].startswith("metadata provenance.weights.tp 3: ") and "cannot run at tp 3" in found[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_the_weights_check_reads_a_block_at_a_time(conversion, monkeypatch, tp):
    """verify of the real model (an Engram table is 98 GB merged, 12 GB per rank at tp 8) must not hold a
    tensor whole: the first version merged each tensor, the next read each rank's piece whole. Every read of
    the check is one block, and its verdict is unchanged."""
    from dsv41_convert.convert import unshard
    from dsv41_convert.store import safetensors_header

    folder, records = conversion
    block = 2048
    monkeypatch.setattr(unshard, "MERGE_BLOCK", block)
    sizes = []
    real = safetensors_header.pread_exact
    for module in (unshard, safetensors_header):  # every read of the check: merges, pieces (pread_blocks)
        monkeypatch.setattr(
            module, "pread_exact", lambda fd, buf, at, path: sizes.append(len(buf)) or real(fd, buf, at, path)
        )
    with RankFiles(folder) as ranks:
        assert weight_digests.compare(records[tp], ranks)[0] == []
        widest_row = max(
            i.nbytes // max(i.shape[0], 1) if i.shape else i.nbytes for h in ranks.headers for i in h.tensors.values()
        )
        largest = max(i.nbytes for h in ranks.headers for i in h.tensors.values())
    assert widest_row <= block < largest // 8  # the fixture has tensors many blocks long
    assert sizes and max(sizes) <= block


@pytest.mark.parametrize("block", [None, 300])
def test_the_streamed_source_digests_are_the_tp1_record(conversion, monkeypatch, block):
    """weight_digests.of_source (reference-logits --stream-layers) gives the whole-model tp-1 record's digests,
    also with the copied tensors (the Engram tables, experts) hashed a few rows at a time (block: bytes)."""
    from dsv41_convert.verify.source import SourceWeights

    folder, records = conversion
    if block:
        monkeypatch.setattr(weight_digests, "MERGE_BLOCK", block)
    weights = SourceWeights(folder.parent / "src")
    blocks: dict[str, int] = {}
    real = weights.copied_blocks

    def counted(t, size):
        for view in real(t, size):
            blocks[t.name] = blocks.get(t.name, 0) + 1
            yield view

    monkeypatch.setattr(weights, "copied_blocks", counted)
    seen = []
    try:
        got, none = weight_digests.of_source(weights, lambda label, done, total: seen.append((done, total)))
    finally:
        weights.close()
    assert got == records[1]["ranks"][0] and none is None
    assert seen and seen[-1][0] == seen[-1][1] == max(t for _, t in seen)  # bytes, to the whole
    table = blocks["layers.1.engram.embed.weight"]  # 3264 bytes in the tiny preset
    assert table > 4 if block else table == 1


def _fp8_expert_digests(folder) -> dict[str, str]:
    """The routed experts' sha256 as `shard --expert-dtype fp8` wrote them into the rank files of `folder`."""
    out = {}
    for path in sorted(folder.glob("model*-mp*.safetensors")):
        for name, t in load_file(str(path)).items():
            if weight_digests._routed(name):
                out[name] = weight_digests.tensor_sha256(t)
    return out


def test_the_experts_as_fp8_are_what_shard_writes(conversion, tmp_path):
    """The record's `experts_as`: each routed expert's weight and scale as `shard --expert-dtype fp8` writes
    them, computed from the source (SourceWeights in fp8), and in one read with the other digests (of_source
    with weights_as): equal to the digests of the files shard itself wrote, at tp 1 and tp 4."""
    from dsv41_convert.verify.source import SourceWeights

    src = conversion[0].parent / "src"
    for tp in (1, 4):
        execute(build_plan(src, tp, "fp8"), tmp_path / f"f8-mp{tp}")
    written = _fp8_expert_digests(tmp_path / "f8-mp1")
    assert written == _fp8_expert_digests(tmp_path / "f8-mp4") and len(written) > 100
    assert {n.rsplit(".", 1)[1] for n in written} == {"weight", "scale"}
    weights, weights_as = SourceWeights(src), SourceWeights(src, "fp8")
    try:
        seen = []
        alone = weight_digests.of_experts_as(weights_as, lambda *event: seen.append(event))
        found, beside = weight_digests.of_source(weights, None, weights_as)
    finally:
        weights.close()
        weights_as.close()
    assert alone == beside == written
    assert found == conversion[1][1]["ranks"][0]  # the fp4 digests unchanged beside them
    assert seen[-1][1:] == (len(written) // 2, len(written) // 2)  # experts counted, each weight with its scale


def test_fp8_experts_are_compared_with_the_records_experts_as(conversion, tmp_path):
    """fp8 experts against a record of fp4 ones: skipped ("partial") without `experts_as`, compared with it at
    the record's tp and at another; one changed byte of an expert's weight or scale is named with its file."""
    src = conversion[0].parent / "src"
    execute(build_plan(src, 2, "fp8"), tmp_path / "mp2")
    as_fp8 = _fp8_expert_digests(tmp_path / "mp2")
    for tp in (1, 2):
        plain = conversion[1][tp]
        with_experts = weight_digests.record(plain["ranks"], "fp4", as_fp8)
        with RankFiles(tmp_path / "mp2") as ranks:
            assert not weight_digests.compares_every_weight(plain, ranks)
            found, note = weight_digests.compare(plain, ranks)
            assert found == [] and "routed experts not compared (fp8 here, fp4 in the reference)" in note
            assert weight_digests.compares_every_weight(with_experts, ranks)
            found, note = weight_digests.compare(with_experts, ranks)
            assert found == [] and "routed experts as fp8, against the reference's record" in note, found
    for name in ("layers.1.ffn.experts.6.w2.weight", "layers.1.ffn.experts.6.w2.scale"):
        bad = tmp_path / name
        bad.mkdir()
        for f in (tmp_path / "mp2").iterdir():
            if f.is_file():
                (bad / f.name).write_bytes(f.read_bytes())
        rank = 0 if name in load_file(str(bad / "model0-mp2.safetensors")) else 1
        _changed(bad, rank, name)
        with RankFiles(bad) as ranks:
            found, _ = weight_digests.compare(weight_digests.record(conversion[1][1]["ranks"], "fp4", as_fp8), ranks)
        assert len(found) == 1 and found[0].startswith(f"{name} (in model{rank}-mp2.safetensors): sha256"), found


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"expert_dtype": "fp4", "sha256": {}}, "experts_as must be"),
        ({"expert_dtype": "fp8", "sha256": {"layers.0.ffn.experts.0.w1.weight": "zz"}}, "64 lowercase hex"),
        ({"expert_dtype": "fp8", "sha256": {"norm.weight": "0" * 64}}, "norm.weight, which is not a routed expert"),
    ],
)
def test_a_malformed_experts_as_is_named(conversion, entry, said):
    record = dict(conversion[1][1]) | {"experts_as": entry}
    assert any(said in p for p in weight_digests.problems(record)), weight_digests.problems(record)
    assert weight_digests.problems(dict(conversion[1][1]) | {"experts_as": {"expert_dtype": "fp8", "sha256": {}}}) == []


def test_a_changed_byte_on_the_last_rank_is_named(conversion, tmp_path):
    """Every rank is compared, the last one too: the last byte of the vocabulary-split embedding is rank 1's
    piece at tp 2 and the last tp-4 rank's in the cut."""
    folder, records = conversion
    name = "embed.weight"
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    path = bad / "model1-mp2.safetensors"
    tensors = load_file(str(path))
    raw = tensors[name].view(torch.uint8).clone()
    raw.view(-1)[-1] ^= 1
    tensors[name] = raw.view(tensors[name].dtype)
    save_file(tensors, str(path))
    with RankFiles(bad) as ranks:
        same_tp, _ = weight_digests.compare(records[2], ranks)
        cut, _ = weight_digests.compare(records[4], ranks)
        merged, _ = weight_digests.compare(records[1], ranks)
    assert len(same_tp) == 1 and same_tp[0].startswith(f"{name} on rank 1: sha256 "), same_tp
    assert len(cut) == 1 and cut[0].startswith(f"{name} in tp-4 rank 3: sha256 "), cut
    assert len(merged) == 1 and merged[0].startswith(f"{name}: sha256 "), merged


def test_a_record_naming_a_tensor_the_rank_files_lack_is_named(conversion):
    """A record that lists a tensor the rank files do not hold (edited, or another model's) is not taken as held:
    verify refuses such a record (exit 2), so the comparison must name the name."""
    folder, records = conversion
    extra = "layers.0.attn.wq_c.weight"
    for tp in (2, 4):
        ranks_record = [dict(r) for r in records[tp]["ranks"]]
        ranks_record[-1][extra] = "0" * 64
        with RankFiles(folder) as ranks:
            found, _ = weight_digests.compare(weight_digests.record(ranks_record, "fp4"), ranks)
        where = " on rank 1" if tp == 2 else " in tp-4 rank 3"
        assert found == [f"{extra}{where}: {weight_digests.NOT_HELD}"], found


def test_a_routed_expert_in_two_rank_files_is_named(conversion, tmp_path):
    """fp8 experts compared with the record's `experts_as`: an expert is whole on its owner rank, so a second,
    identical copy in another rank file is no conversion's, though both copies have the recorded digest."""
    src = conversion[0].parent / "src"
    execute(build_plan(src, 2, "fp8"), tmp_path / "mp2")
    as_fp8 = _fp8_expert_digests(tmp_path / "mp2")
    name = "layers.1.ffn.experts.0.w2.weight"
    first, second = (tmp_path / "mp2" / f"model{r}-mp2.safetensors" for r in range(2))
    owner, other = (first, second) if name in load_file(str(first)) else (second, first)
    tensors = load_file(str(other))
    tensors[name] = load_file(str(owner))[name]
    save_file(tensors, str(other))
    with RankFiles(tmp_path / "mp2") as ranks:
        found, _ = weight_digests.compare(weight_digests.record(conversion[1][2]["ranks"], "fp4", as_fp8), ranks)
    assert found == [f"{name}: in more than one rank file"], found
