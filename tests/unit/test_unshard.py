"""convert.unshard: rank files merged back to tp 1 equal the converter's tp-1 output byte for byte, and every
disagreement between rank files (the faults a merge exists to expose) raises, naming tensor and ranks."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.unshard import RankFiles, replica_mismatches, unshard_names, unshard_tensors
from dsv41_convert.errors import ShardConsistencyError, VerifyInputError

ENGRAM = "layers.1.engram.embed"  # 102 rows (primes 19, 23, 29, 31): tp 4 and tp 8 pad 2 rows


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("unshard")
    src = make_tiny(root / "src", vision=False)
    out = {}
    for tp in (1, 2, 4, 8):
        out[tp] = root / f"mp{tp}"
        execute(build_plan(src, tp), out[tp])
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # every dtype compared as its bytes


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_merge_is_the_tp1_output_byte_for_byte(shards, tp):
    want = load_file(str(shards[1] / "model0-mp1.safetensors"))
    assert unshard_names(shards[tp]) == sorted(want)
    got = unshard_tensors(shards[tp])
    assert set(got) == set(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(_bytes(g), _bytes(w)), name


def test_named_tensors_only(shards):
    names = ["layers.0.attn.wo_b.weight", f"{ENGRAM}.scale", "layers.2.ffn.experts.5.w2.weight"]
    got = unshard_tensors(shards[4], names)
    assert list(got) == names
    assert got[f"{ENGRAM}.scale"].shape[0] == 102


def _copy(shards, tp: int, tmp_path: Path) -> Path:
    dst = tmp_path / f"bad-mp{tp}"
    shutil.copytree(shards[tp], dst)
    return dst


def _edit(folder: Path, rank: int, tp: int, fn) -> None:
    path = folder / f"model{rank}-mp{tp}.safetensors"
    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


def test_replicated_tensor_differs(shards, tmp_path):
    bad = _copy(shards, 4, tmp_path)
    name = "layers.0.attn.wkv.scale"

    def bump(t):
        raw = t[name].view(torch.uint8).clone()
        raw[0, 0] += 1
        t[name] = raw.view(torch.float8_e8m0fnu)

    _edit(bad, 2, 4, bump)
    with pytest.raises(ShardConsistencyError, match=rf"{name}: replicated, but rank 2's copy differs"):
        unshard_tensors(bad, [name])
    unshard_tensors(bad, ["layers.0.attn.wkv.weight"])  # other tensors still merge


def _bump(name: str):
    def bump(t):
        raw = t[name].view(torch.uint8).clone()
        raw.view(-1)[0] += 1
        t[name] = raw.view(t[name].dtype)

    return bump


def test_the_odd_replica_is_named_also_on_rank_0(shards, tmp_path):
    """A copy damaged on rank 0 was reported as "ranks [1, 2, 3] differ from rank 0", blaming the three right
    ones (an audit). The copies are grouped: the one rank against the others is named; two ranks cannot
    say which is wrong; three copies among four ranks are listed."""
    name = "layers.1.ffn_norm.weight"
    bad = _copy(shards, 4, tmp_path)
    _edit(bad, 0, 4, _bump(name))
    with RankFiles(bad) as ranks:
        assert replica_mismatches(ranks) == [f"{name}: replicated, but rank 0's copy differs from the other 3 ranks'"]
    _edit(bad, 1, 4, lambda t: t.__setitem__(name, t[name] * 2))
    with RankFiles(bad) as ranks:
        assert replica_mismatches(ranks) == [
            f"{name}: replicated, but the ranks hold 3 different copies: ranks [0] / ranks [1] / ranks [2, 3]"
        ]
    two = _copy(shards, 2, tmp_path)
    _edit(two, 0, 2, _bump(name))
    with RankFiles(two) as ranks:
        assert replica_mismatches(ranks) == [
            f"{name}: replicated, but ranks 0 and 1 hold different copies (two copies cannot say which is wrong)"
        ]


def test_a_replica_missing_from_a_rank_is_named_missing(shards, tmp_path):
    """A replicated tensor deleted from rank 1 of a tp-2 set was reported "ranks 0 and 1 hold different copies"
    (rank 1 holds none); at tp 4, from rank 2, as one of "2 different copies". It is named missing, with its
    ranks, as the merge names a missing piece of a split tensor."""
    name = "layers.1.ffn_norm.weight"
    two = _copy(shards, 2, tmp_path)
    _edit(two, 1, 2, lambda t: t.pop(name))
    with RankFiles(two) as ranks:
        assert [m for m in replica_mismatches(ranks) if m.startswith(name)] == [
            f"{name}: replicated, but missing from rank files [1] (every rank must hold a copy)"
        ]
    four = _copy(shards, 4, tmp_path)
    _edit(four, 2, 4, lambda t: t.pop(name))
    _edit(four, 3, 4, lambda t: t.pop(name))
    with RankFiles(four) as ranks:
        assert [m for m in replica_mismatches(ranks) if m.startswith(name)] == [
            f"{name}: replicated, but missing from rank files [2, 3] (every rank must hold a copy)"
        ]
    # from rank 0 alone: the replicas were rank 0's names, so the check said nothing and only the model's load
    # (or the merge of the replay) caught it
    first = _copy(shards, 4, tmp_path / "first")
    _edit(first, 0, 4, lambda t: t.pop(name))
    with RankFiles(first) as ranks:
        assert [m for m in replica_mismatches(ranks) if m.startswith(name)] == [
            f"{name}: replicated, but missing from rank files [0] (every rank must hold a copy)"
        ]


def test_expert_on_the_wrong_rank(shards, tmp_path):
    bad = _copy(shards, 2, tmp_path)
    name = "layers.0.ffn.experts.1.w1.weight"  # 8 experts, tp 2: rank 0 owns 0..3
    moved = load_file(str(bad / "model0-mp2.safetensors"))[name]
    _edit(bad, 0, 2, lambda t: t.pop(name))
    _edit(bad, 1, 2, lambda t: t.__setitem__(name, moved))
    with pytest.raises(ShardConsistencyError, match=rf"{name}: held by ranks \[1\], expected rank 0"):
        unshard_tensors(bad, [name])


def test_split_pieces_of_different_shape(shards, tmp_path):
    bad = _copy(shards, 2, tmp_path)
    name = "layers.0.attn.wq_b.weight"
    _edit(bad, 1, 2, lambda t: t.__setitem__(name, t[name][:-32].contiguous()))
    with pytest.raises(ShardConsistencyError, match=rf"{name}: rank pieces differ in shape"):
        unshard_tensors(bad, [name])


def test_missing_engram_padding_row(shards, tmp_path):
    bad = _copy(shards, 4, tmp_path)
    for kind in ("weight", "scale"):
        _edit(bad, 3, 4, lambda t, k=f"{ENGRAM}.{kind}": t.__setitem__(k, t[k][:-1].contiguous()))
    with pytest.raises(ShardConsistencyError, match=rf"{ENGRAM}.weight: rank pieces differ in shape"):
        unshard_tensors(bad, [f"{ENGRAM}.weight"])


@pytest.mark.parametrize(("tp", "rows", "want"), [(4, 25, 26), (2, 52, 51)])
def test_engram_pieces_of_equal_but_wrong_height_are_refused(shards, tmp_path, tp, rows, want):
    """Every rank's piece of the 102-row table cut to (or padded to) another equal height: the pieces agree in
    shape, but a tp-N conversion holds ceil(102 / N) rows each; merged anyway, the table's rows shift between
    ranks (or its last rows are missing) without a word."""

    def resize(t):
        for kind, fill in (("weight", 0), ("scale", 127)):
            name = f"{ENGRAM}.{kind}"
            raw = t[name].view(torch.uint8)
            grown = torch.full((rows, raw.shape[1]), fill, dtype=torch.uint8)
            grown[: min(rows, raw.shape[0])] = raw[:rows]
            t[name] = grown.view(t[name].dtype)

    bad = _copy(shards, tp, tmp_path)
    for rank in range(tp):
        _edit(bad, rank, tp, resize)
    with pytest.raises(ShardConsistencyError, match=rf"{ENGRAM}.weight: {rows} rows per rank, expected .*= {want}"):
        unshard_tensors(bad, [f"{ENGRAM}.weight"])


def test_engram_padding_not_the_fill(shards, tmp_path):
    bad = _copy(shards, 8, tmp_path)
    name = f"{ENGRAM}.weight"

    def dirty(t):
        raw = t[name].view(torch.uint8).clone()
        raw[-1, 0] = 0x38  # 1.0 in a padding row
        t[name] = raw.view(torch.float8_e4m3fn)

    _edit(bad, 7, 8, dirty)
    with pytest.raises(ShardConsistencyError, match=rf"{name}: padding rows 102..103"):
        unshard_tensors(bad, [name])


def test_missing_rank_file(shards, tmp_path):
    bad = _copy(shards, 4, tmp_path)
    (bad / "model3-mp4.safetensors").unlink()
    # an input error (verify exits 2), as a truncated file is: the folder is incomplete, not inconsistent
    with pytest.raises(VerifyInputError, match=r"tp 4 needs 4 rank files; missing model3-mp4\.safetensors"):
        unshard_tensors(bad, ["norm.weight"])


def test_a_rank_past_the_tp_is_refused(shards, tmp_path):
    """model4-mp4 (a copy of another rank dropped in) was ignored: verify passed the folder without a word."""
    import shutil

    bad = _copy(shards, 4, tmp_path)
    shutil.copy(bad / "model3-mp4.safetensors", bad / "model4-mp4.safetensors")
    with pytest.raises(VerifyInputError, match=r"model4-mp4\.safetensors: no such rank in a tp-4 conversion"):
        unshard_tensors(bad, ["norm.weight"])


def test_a_folder_named_like_a_rank_file_is_no_rank_file_and_named_a_folder(shards, tmp_path):
    """A folder at rank 1's name is not taken for its file; it was reported "missing model1-mp2.safetensors"
    while `check` said "a folder": both now say what is there, exit 2 (a helper's verify hunt)."""
    bad = _copy(shards, 2, tmp_path)
    (bad / "model1-mp2.safetensors").unlink()
    (bad / "model1-mp2.safetensors").mkdir()
    with pytest.raises(VerifyInputError, match=r"model1-mp2\.safetensors: not a regular file \(a folder\)"):
        RankFiles(bad)
    (bad / "model1-mp2.safetensors").rmdir()  # a link to a moved file was "missing" too
    (bad / "model1-mp2.safetensors").symlink_to(tmp_path / "moved.safetensors")
    with pytest.raises(VerifyInputError, match=r"model1-mp2\.safetensors: not a regular file \(a link that leads"):
        RankFiles(bad)


def test_replica_mismatches_names_every_damaged_replica_and_rank(shards, tmp_path):
    """Bytes of replicated tensors compared across ranks: a flipped low bit on one rank, a header dtype change
    on another, a tensor dropped from a third; split tensors and experts are not compared."""
    bad = _copy(shards, 4, tmp_path)
    with RankFiles(bad) as ranks:
        assert replica_mismatches(ranks) == []

    def flip(t):
        raw = t["norm.weight"].view(torch.uint8).clone()
        raw[0] ^= 1
        t["norm.weight"] = raw.view(t["norm.weight"].dtype)

    _edit(bad, 1, 4, flip)
    _edit(bad, 2, 4, lambda t: t.__setitem__("layers.0.attn_norm.weight", t["layers.0.attn_norm.weight"].float()))
    _edit(bad, 3, 4, lambda t: t.pop("layers.1.ffn_norm.weight"))
    _edit(
        bad,
        3,
        4,
        lambda t: t.__setitem__("layers.0.attn.wq_b.weight", torch.zeros_like(t["layers.0.attn.wq_b.weight"])),
    )
    with RankFiles(bad) as ranks:
        found = replica_mismatches(ranks)
    assert found == [
        "layers.0.attn_norm.weight: replicated, but rank 2's copy differs from the other 3 ranks'",
        "layers.1.ffn_norm.weight: replicated, but missing from rank files [3] (every rank must hold a copy)",
        "norm.weight: replicated, but rank 1's copy differs from the other 3 ranks'",
    ]


def test_rank_files_read_each_header_once_and_close(shards, monkeypatch):
    """One RankFiles serves many merges: the headers are read once, the files opened once and closed at the end."""
    import os

    import dsv41_convert.convert.unshard as unshard

    reads, opened = [], []
    real_read, real_open = unshard.read_header, os.open
    monkeypatch.setattr(unshard, "read_header", lambda p: reads.append(p) or real_read(p))
    monkeypatch.setattr(unshard.os, "open", lambda p, f: opened.append(real_open(p, f)) or opened[-1])
    with RankFiles(shards[4]) as ranks:
        for name in ("norm.weight", "layers.0.attn.wq_b.weight", f"{ENGRAM}.weight"):
            unshard_tensors(ranks, [name])
        replica_mismatches(ranks)
    assert len(reads) == 4 and len(opened) == 4
    for fd in opened:
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.parametrize("tp", [2, 8])
def test_a_merge_in_small_blocks_is_the_same_bytes(shards, tp, monkeypatch):
    """Blocks of 777 bytes cut rows of every split (dim-1 pieces interleaved row by row, a padded table
    stopped before its padding) at other places than the tensors' ends: the merge and its sha256 unchanged."""
    import hashlib

    import dsv41_convert.convert.unshard as unshard

    want = load_file(str(shards[1] / "model0-mp1.safetensors"))
    monkeypatch.setattr(unshard, "MERGE_BLOCK", 777)
    got = unshard_tensors(shards[tp])
    with RankFiles(shards[tp]) as ranks:
        for name, w in want.items():
            assert torch.equal(_bytes(got[name]), _bytes(w)), name
            assert unshard.merged_sha256(ranks, name) == hashlib.sha256(_bytes(w).numpy()).hexdigest(), name


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_replica_differing_in_any_block_is_named(shards, tmp_path, monkeypatch, where):
    import dsv41_convert.convert.unshard as unshard

    bad = _copy(shards, 4, tmp_path)
    name = "layers.0.attn.wkv.weight"

    def flip(t):
        raw = t[name].view(torch.uint8).clone()
        raw.view(-1)[0 if where == "first" else -1] ^= 1
        t[name] = raw.view(t[name].dtype)

    _edit(bad, 3, 4, flip)
    monkeypatch.setattr(unshard, "MERGE_BLOCK", 256)
    with RankFiles(bad) as ranks:
        assert ranks.headers[3].tensors[name].nbytes > 4 * 256  # several blocks
        with pytest.raises(ShardConsistencyError, match=rf"{name}: replicated, but rank 3's copy differs"):
            unshard.merged_sha256(ranks, name)
        assert replica_mismatches(ranks) == [f"{name}: replicated, but rank 3's copy differs from the other 3 ranks'"]


def test_split_pieces_of_different_dtype(shards, tmp_path):
    bad = _copy(shards, 2, tmp_path)
    name = "layers.0.attn_norm.weight"  # replicated: named by the replica check
    split = "layers.0.attn.wo_a.weight"  # bf16, a split

    def widen(t):
        t[split] = t[split].float()

    _edit(bad, 1, 2, widen)
    with pytest.raises(
        ShardConsistencyError, match=rf"{split}: rank pieces differ in dtype \(rank 0: BF16, rank 1: F32\)"
    ):
        unshard_tensors(bad, [split])
    unshard_tensors(bad, [name])


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_cut_to_any_tp_is_that_conversion_byte_for_byte(shards, m, monkeypatch):
    """cut_sha256 of tp-M rank files to tp N: each rank's piece hashes as the tp-N conversion's own (the
    converter's output computed in memory), for every tensor and every (M, N), in blocks of 777 bytes."""
    import hashlib

    import dsv41_convert.convert.unshard as unshard
    from dsv41_convert.verify.source import plan_state

    src = shards[1].parent / "src"
    monkeypatch.setattr(unshard, "MERGE_BLOCK", 777)
    with RankFiles(shards[m]) as ranks:
        for n in (1, 2, 4, 8):
            want = [plan_state(build_plan(src, n), r) for r in range(n)]
            for name in ranks.names():
                got = unshard.cut_sha256(ranks, name, n)
                expected = [hashlib.sha256(_bytes(w[name]).numpy()).hexdigest() if name in w else None for w in want]
                assert got == expected, (m, n, name)


def test_replica_mismatches_also_reads_the_engram_padding(shards, tmp_path):
    """A padding row of an Engram table bumped on the last rank: only the tp-1 replay's merge saw it, so
    verify against a same-tp file without digests passed it (an audit). The replicas check reads the padding
    rows (a few rows per table) at every tp."""
    name = f"{ENGRAM}.weight"
    bad = _copy(shards, 4, tmp_path)

    def dirty(t):
        raw = t[name].view(torch.uint8).clone()
        raw[-1, 0] = 0x38
        t[name] = raw.view(t[name].dtype)

    _edit(bad, 3, 4, dirty)
    with RankFiles(bad) as ranks:
        assert replica_mismatches(ranks) == [f"{name}: padding rows 102..103 (ranks 3..3) are not the fill byte 0"]
    scale = f"{ENGRAM}.scale"  # its fill byte said as the scale it means (the byte alone was left to decode)

    def dirty_scale(t):
        raw = t[scale].view(torch.uint8).clone()
        raw[-1, 0] = 128
        t[scale] = raw.view(t[scale].dtype)

    _edit(bad, 3, 4, dirty_scale)
    with RankFiles(bad) as ranks:
        assert f"{scale}: padding rows 102..103 (ranks 3..3) are not the fill byte 127 (scale 2**0)" in (
            replica_mismatches(ranks)
        )


def test_the_replica_comparison_reports_its_bytes_as_it_reads(shards, monkeypatch):
    """progress(REPLICAS, done, total): rising in MERGE_BLOCK steps to a total of tp copies of every replicated
    tensor (on the real model 29 GB at tp 8, minutes of a slow disk that showed no bar)."""
    import dsv41_convert.convert.unshard as unshard
    from dsv41_convert.convert.rules import Split, match_rule

    monkeypatch.setattr(unshard, "MERGE_BLOCK", 4096)
    calls = []
    with RankFiles(shards[4]) as ranks:
        assert replica_mismatches(ranks, lambda *a: calls.append(a)) == []
        tensors = ranks.headers[0].tensors
        want = 4 * sum(i.nbytes for n, i in tensors.items() if match_rule(n).split is Split.NONE)
    assert {(label, total) for label, _, total in calls} == {(unshard.REPLICAS, want)}
    done = [d for _, d, _ in calls]
    assert done == sorted(done) and done[-1] == want
    assert len(done) > len([n for n in tensors if match_rule(n).split is Split.NONE])  # blocks, not tensors


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_weights_reads_engram_rows_from_the_rank_that_holds_them(shards, tp):
    """verify --stream-layers reads Engram rows straight from the rank files: rank r holds rows r*k .. (r+1)*k,
    k = ceil(rows / tp), so each requested row (the last ones, next to the padding, included) is the merge's."""
    from dsv41_convert.verify.rank_weights import RankWeights

    names = [f"{ENGRAM}.weight", f"{ENGRAM}.scale"]
    with RankFiles(shards[tp]) as ranks:
        whole = unshard_tensors(ranks, names)
    n = whole[names[0]].shape[0]
    rows = torch.tensor(sorted({0, 1, n // 2, -(-n // tp), n - 2, n - 1}))
    weights = RankWeights(shards[tp])
    try:
        got = weights.rows(names, rows)
    finally:
        weights.close()
    for name in names:
        assert torch.equal(_bytes(got[name]), _bytes(whole[name][rows])), name


def test_rank_weights_refuse_rank_files_whose_replicas_differ(shards, tmp_path):
    """`reference-logits MP --stream-layers` over rank files that disagree on a replicated tensor would compute a
    reference of rank 0's copy: RankWeights refuses the set, naming the tensor, before any unit is read."""
    from dsv41_convert.verify.rank_weights import RankWeights

    name = "layers.0.attn.wkv.scale"
    bad = _copy(shards, 2, tmp_path)
    _edit(bad, 1, 2, _bump(name))
    with pytest.raises(VerifyInputError, match=rf"{bad}: the rank files are not one conversion \({name}"):
        RankWeights(bad)
    RankWeights(shards[2]).close()  # the set it was copied from is one conversion


def test_rank_weights_refuse_a_folder_of_two_tp_sizes(shards, tmp_path):
    """Rank files of tp 1 and tp 2 side by side: which set a reference ran is not known, so RankWeights names both
    sizes instead of reading one."""
    from dsv41_convert.verify.rank_weights import RankWeights, rank_file_tp

    both = _copy(shards, 2, tmp_path)
    shutil.copy(shards[1] / "model0-mp1.safetensors", both)
    with pytest.raises(VerifyInputError, match=r"rank files of several tp sizes \[1, 2\]; keep one set"):
        RankWeights(both)
    assert rank_file_tp(shards[2]) == 2 and rank_file_tp(shards[1]) == 1


def test_rank_weights_read_each_ranks_rows_at_its_own_offsets(shards, tmp_path):
    """Rank files need not share a layout: a longer header (other metadata; on the real model, expert numbers of
    more digits) moves every tensor of one rank. Each Engram row is read at its own rank's offset."""
    from dsv41_convert.verify.rank_weights import RankWeights

    names = [f"{ENGRAM}.weight", f"{ENGRAM}.scale"]
    moved = _copy(shards, 2, tmp_path)
    path = moved / "model1-mp2.safetensors"
    save_file(load_file(str(path)), str(path), metadata={"note": "x" * 200})
    with RankFiles(shards[2]) as ranks:
        whole = unshard_tensors(ranks, names)
    n = whole[names[0]].shape[0]
    rows = torch.tensor([0, n // 2 - 1, n // 2 + 1, n - 1])
    weights = RankWeights(moved)
    try:
        assert weights.headers[1].tensors[names[0]].begin != weights.headers[0].tensors[names[0]].begin
        got = weights.rows(names, rows)
    finally:
        weights.close()
    for name in names:
        assert torch.equal(_bytes(got[name]), _bytes(whole[name][rows])), name


def test_an_engram_table_of_a_layer_without_engram_is_a_consistency_error(shards, tmp_path):
    """An Engram table named at a layer the config gives no Engram (a renamed tensor, on every rank): merge_of
    looked its rows up in engram_layer_ids and raised a bare ValueError, which `verify --reference SRC` met
    sizing the twin before any rank ran (a traceback, exit 1, where the model's load FAILs the rank files)."""
    from dsv41_convert.verify import run

    bad = _copy(shards, 2, tmp_path)
    stray = "layers.3.engram.embed.weight"
    for rank in range(2):
        _edit(bad, rank, 2, lambda t: t.__setitem__(stray, t.pop(f"{ENGRAM}.weight")))
    with pytest.raises(ShardConsistencyError, match=rf"{stray}: layer 3 has no Engram table"):
        unshard_tensors(bad, [stray])
    with RankFiles(bad, None) as ranks:
        merges = run._merges(ranks)  # verify's count of the twin: the model's load names it
    assert stray not in merges and f"{ENGRAM}.scale" in merges


@pytest.mark.parametrize(
    ("name", "cut", "dim"),
    [("layers.0.attn.wo_b.weight", torch.flatten, 1), ("layers.0.attn.wq_b.weight", lambda t: t.flatten()[0], 0),
     (f"{ENGRAM}.weight", lambda t: t.flatten()[0], 0)],
)  # fmt: skip
def test_a_split_tensor_without_the_dim_it_is_cut_on_is_a_consistency_error_not_a_traceback(
    shards, tmp_path, name, cut, dim
):
    """A split tensor whose header has no dim its split cuts, on every rank (an edited file: a column split 1-D, a row
    split or an Engram table 0-D): merge_of read that dim and raised a bare IndexError, which `verify --reference SRC`
    met sizing the twin before any rank ran, and the tensor diff met again joining the pieces (a traceback, exit 1,
    for rank files the model's load FAILs)."""
    from dsv41_convert.verify import localize, run

    bad = _copy(shards, 2, tmp_path)
    for rank in range(2):
        _edit(bad, rank, 2, lambda t: t.__setitem__(name, cut(t[name]).clone()))
    with pytest.raises(ShardConsistencyError, match=rf"{name}: .* split cuts dim {dim}"):
        unshard_tensors(bad, [name])
    with RankFiles(bad, None) as ranks:
        assert name not in run._merges(ranks)  # verify's count of the twin: the model's load names it
    pieces = [load_file(str(bad / f"model{rank}-mp2.safetensors")) for rank in range(2)]
    want = load_file(str(shards[1] / "model0-mp1.safetensors"))
    (diff,) = [d for d in localize.diff_tensors(pieces, want, ()) if d.name == name]
    assert diff.ranks == (0, 1) and f"split cuts dim {dim}; found rank 0: [" in diff.what, diff


def test_a_rank_file_of_a_huge_tp_names_the_first_missing_at_once(tmp_path, monkeypatch):
    """A lone model0-mp1000000000000000000.safetensors (a typo, or a hostile name): every rank below 10**18 was
    listed as missing, and verify ran until killed (a helper's hunt). The first MISSING_NAMED are named and the
    rest counted; no span of ranks is walked one by one."""
    from dsv41_convert.convert import unshard
    from dsv41_convert.convert.unshard import rank_tp

    tp = 10**18
    (tmp_path / f"model0-mp{tp}.safetensors").write_bytes(b"")
    (tmp_path / f"model2-mp{tp}.safetensors").write_bytes(b"")

    def bounded(*args):
        span = range(*args)
        assert len(span) <= 10**5, f"{len(span)} ranks walked one by one"
        return span

    monkeypatch.setattr(unshard, "range", bounded, raising=False)
    names = [f"model{r}-mp{tp}.safetensors" for r in (1, 3, 4)]
    with pytest.raises(VerifyInputError, match=rf"tp {tp} needs {tp} rank files; missing {', '.join(names)}, "):
        rank_tp(tmp_path)
    with pytest.raises(VerifyInputError, match=r"-mp\d+\.safetensors, \.\.\. \(999,999,999,999,999,998 in all\)$"):
        rank_tp(tmp_path)
