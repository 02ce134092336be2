"""verify.teacher's deviation measure and the reference file's teacher-forcing tensors."""

from __future__ import annotations

import math

import torch
from safetensors.torch import save_file

from dsv41_convert.verify import reffile
from dsv41_convert.verify.runner import ModelInput
from dsv41_convert.verify.teacher import ModuleDeviations, bf16_ulps, forced_prefill, judge
from dsv41_convert.verify.verdict import FAIL, INCONCLUSIVE, PASS, decide


def test_bf16_ulps_counts_in_ulps_of_the_row_scale():
    ref = torch.tensor([[1.0, 0.5, -0.25], [8.0, 0.0, 1e-3]])
    assert bf16_ulps(ref, ref.clone()) == 0.0
    got = ref.clone()
    got[0, 2] += 2**-7  # one bf16 ulp of 1.0 (the row's largest), 4 of the element -0.25 itself
    assert bf16_ulps(ref, got) == 1.0
    got[1, 1] += 3 * 2**-4  # three ulps of 8.0
    assert bf16_ulps(ref, got) == 3.0
    assert math.isnan(bf16_ulps(ref, torch.full_like(ref, float("nan"))))


def test_judge_fails_a_module_over_the_bound_and_too_many_indexer_flips():
    quiet = ModuleDeviations({"layers.0.attn": 1.0, "layers.0.ffn": 0.0}, {"layers.1.attn.indexer": 1}, 40)
    loud = ModuleDeviations({"layers.0.attn": 0.0, "layers.0.ffn": 9.0}, {"layers.1.attn.indexer": 20}, 40)
    held = judge([quiet], ["a"])
    assert not held.decisive and not held.exact and not held.failures  # a bound held: evidence, not proof
    failed = judge([quiet, loud], ["a", "b"])
    assert not failed.decisive
    assert any(f.startswith("teacher layers.0.ffn: 9 bf16 ulps > 2 (b)") for f in failed.failures), failed.failures
    assert any(f.startswith("teacher layers.1.attn.indexer") for f in failed.failures), failed.failures
    assert judge([ModuleDeviations({"norm": float("nan")})], ["a"]).failures
    # the summary's worst is the NaN module, not the largest number (it named layers.0.attn at 1 ulp: an audit)
    nan = judge([ModuleDeviations({"layers.0.attn": 1.0, "layers.1.attn": float("nan"), "norm": 0.5})], ["a"])
    assert "(worst: layers.1.attn nan ulps;" in nan.note, nan.note
    # a prompt may still differ at two positions; at 1 % of a long one
    assert not judge([ModuleDeviations({}, {"layers.1.attn.indexer": 2}, 8)], ["a"]).failures
    assert judge([ModuleDeviations({}, {"layers.1.attn.indexer": 3}, 8)], ["a"]).failures
    assert not judge([ModuleDeviations({}, {"layers.1.attn.indexer": 3}, 300)], ["a"]).failures
    assert judge([ModuleDeviations({}, {"layers.1.attn.indexer": 4}, 300)], ["a"]).failures
    # a held teacher check does not decide the run (an audit found a reached fault at 1.6 ulps, bound 2);
    # --statistical accepts it; a broken one fails it (verify.verdict); all modules bit for bit equal decide
    assert decide([held], [], statistical=False) == INCONCLUSIVE
    assert decide([held], [], statistical=True) == PASS
    assert decide([failed], [], statistical=False) == FAIL
    equal = judge([ModuleDeviations({"layers.0.attn": 0.0}, {"layers.1.attn.indexer": 0}, 40)], ["a"])
    assert equal.exact and equal.decisive and decide([equal], [], statistical=False) == PASS


def test_reference_file_checks_the_dtype_of_teacher_tensors(tmp_path):
    base = {"input_ids": torch.zeros(1, 4, dtype=torch.int64), "logits": torch.zeros(1, 8)}
    good = base | {
        "hidden.layers.0.pre_mix": torch.zeros(1, 4, 2),
        "hidden.layers.1.attn.indexer": torch.zeros(1, 4, 3, dtype=torch.int64),
        "hidden.layers.0.engram": torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16),
    }
    save_file(good, str(tmp_path / "good.safetensors"))
    assert reffile.validate_reference_file(tmp_path / "good.safetensors") == []
    bad = good | {"hidden.layers.0.pre_mix": torch.zeros(1, 4, 2, dtype=torch.bfloat16)}
    save_file(bad, str(tmp_path / "bad.safetensors"))
    problems = reffile.validate_reference_file(tmp_path / "bad.safetensors")
    assert len(problems) == 1 and "hidden.layers.0.pre_mix" in problems[0] and "float32" in problems[0], problems


def test_judge_takes_each_module_at_its_worst_prompt_nan_included():
    """The bound judges each module's worst prompt, whichever comes first: a later prompt's smaller value does
    not replace an earlier larger one, and a NaN wins over any number in either order."""
    over = ModuleDeviations({"layers.0.ffn": 9.0}, {}, 40)
    under = ModuleDeviations({"layers.0.ffn": 0.5}, {}, 40)
    nan = ModuleDeviations({"layers.0.ffn": float("nan")}, {}, 40)
    for prompts, said in (([over, under], "9 bf16 ulps > 2 (a)"), ([under, nan], "nan bf16 ulps > 2 (b)")):
        failures = judge(prompts, ["a", "b"]).failures
        assert failures == [f"teacher layers.0.ffn: {said}"], failures


def test_a_nan_of_the_first_prompt_is_not_replaced_by_a_later_one():
    """A module NaN in prompt a and bit for bit in prompt b came out exact, decisive, PASS: the number coming
    after the NaN replaced it (a mutation audit)."""
    nan = ModuleDeviations({"layers.0.ffn": float("nan")}, {}, 40)
    equal = ModuleDeviations({"layers.0.ffn": 0.0}, {}, 40)
    check = judge([nan, equal], ["a", "b"])
    assert check.failures == ["teacher layers.0.ffn: nan bf16 ulps > 2 (a)"], check.failures
    assert not check.decisive and decide([check], [], statistical=False) == FAIL


def test_only_zero_ulps_and_no_indexer_flip_is_bit_for_bit():
    """Within the bound is evidence, not proof: one ulp, or one position whose indexer chose otherwise (its
    top-k then forced to the reference's), leaves the teacher check inexact, so it decides nothing."""
    one_ulp = judge([ModuleDeviations({"layers.0.attn": 1.0, "norm": 0.0}, {}, 40)], ["a"])
    flipped = judge([ModuleDeviations({"layers.0.attn": 0.0}, {"layers.1.attn.indexer": 1}, 40)], ["a"])
    for check in (one_ulp, flipped):
        assert not check.failures and not check.exact and not check.decisive
        assert decide([check], [], statistical=False) == INCONCLUSIVE


def test_the_check_applies_only_where_every_prompt_has_its_hidden_states():
    from types import SimpleNamespace

    from dsv41_convert.verify import teacher
    from dsv41_convert.verify.runner import ModelInput, PromptRun

    args = SimpleNamespace(
        dim=2, hc_mult=1, vision_enabled=True, n_layers=1, engram_layer_ids=[], index_source_layers=[]
    )
    keys = teacher.required_keys(args, 4)
    assert keys == ["embed", "norm", "layers.0", "layers.0.pre_mix", "layers.0.attn", "layers.0.ffn"]
    full = {k: torch.zeros(4, 2) for k in keys}

    def ref(*hidden):
        runs = [PromptRun(torch.zeros(4, 8), torch.empty(0), torch.empty(0, 8), None, h) for h in hidden]
        inputs = [ModelInput(torch.zeros(4, dtype=torch.int64)) for _ in hidden]
        return reffile.Reference(inputs, runs, list("ab"[: len(hidden)]), 8, "fp8", "cpu", weights="converted")

    assert teacher.applies(ref(full, full), args, "cpu")
    partial = {k: v for k, v in full.items() if k != "layers.0.ffn"}
    assert not teacher.applies(ref(full, partial), args, "cpu")
    assert not teacher.applies(ref(partial, full), args, "cpu")
    assert not teacher.applies(ref(full, full), args, "cuda")  # bounds measured on the CPU


def test_an_index_source_needs_its_choice_once_a_compressed_group_is_complete():
    from types import SimpleNamespace

    from dsv41_convert.verify import teacher

    args = SimpleNamespace(
        dim=2,
        hc_mult=1,
        vision_enabled=False,
        n_layers=2,
        engram_layer_ids=[0],
        index_source_layers=[1],
        compress_ratios=[0, 4],
        index_topk=8,
        candidate_source_layer=1,
    )
    layer0 = ["layers.0", "layers.0.pre_mix", "layers.0.attn", "layers.0.ffn", "layers.0.engram"]
    layer1 = ["layers.1", "layers.1.pre_mix", "layers.1.attn", "layers.1.ffn"]
    assert teacher.required_keys(args, 3) == ["embed", "norm", *layer0, *layer1]
    assert teacher.required_keys(args, 4) == ["embed", "norm", *layer0, *layer1, "layers.1.attn.indexer"]


class _EmbedOnly(torch.nn.Module):
    """A model of no layers, as forced_prefill drives one: embed, then the final norm (an identity) and logits
    that are the normed rows' sums."""

    hc_mult = 1

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.embed = torch.nn.Embedding.from_pretrained(table)
        self.layers = torch.nn.ModuleList()
        self.norm = torch.nn.Identity()

    def forward(self, ids, start_pos, images, types, all_logits=False):
        h = self.norm(self.embed(ids))
        return None, h.float().sum(-1, keepdim=True), None


def test_the_image_rows_are_measured_apart_as_vision():
    """A prompt with an image span: the embedding's image rows are compared with the reference's `vision` rows
    apart (a fault of the tower was charged to `embed`: an audit), a text row's deviation is not `vision`'s,
    and without an image no `vision` is measured."""
    table = torch.arange(1, 13, dtype=torch.float32).reshape(4, 3).to(torch.bfloat16)
    ids = torch.tensor([0, 1, 2, 3])
    types = torch.tensor([-1, 0, 0, -1])  # positions 1 and 2: the image span
    rows = table[ids]
    image = torch.zeros_like(rows)
    image[1:3] = rows[1:3]
    inp = ModelInput(ids, types)
    bumped = image.clone()
    bumped[1, 0] = bumped[1, 0] * 2
    got = forced_prefill(_EmbedOnly(table), inp, {"embed": rows, "norm": rows, "vision": bumped}, None, "cpu")
    assert got.ulps["vision"] > 0 and got.ulps["embed"] == 0 and got.ulps["norm"] == 0
    same = forced_prefill(_EmbedOnly(table), inp, {"embed": rows, "norm": rows, "vision": image}, None, "cpu")
    assert same.ulps["vision"] == 0
    text = rows.clone()
    text[0, 0] = text[0, 0] * 2  # a text row: the embedding's, not the tower's
    off = forced_prefill(_EmbedOnly(table), inp, {"embed": text, "norm": rows, "vision": image}, None, "cpu")
    assert off.ulps["embed"] > 0 and off.ulps["vision"] == 0
    plain = forced_prefill(_EmbedOnly(table), ModelInput(ids), {"embed": rows, "norm": rows}, None, "cpu")
    assert "vision" not in plain.ulps


def _reference(tp: int, threads: int):
    """A Reference with only the fields the teacher's settings read."""
    from types import SimpleNamespace

    return SimpleNamespace(tp=tp, threads=threads)


def test_the_teacher_runs_at_the_references_threads():
    from dsv41_convert.verify.teacher import teacher_threads

    assert teacher_threads(_reference(1, 2), "cpu", 1) == 2  # the reference's sums, in its order
    assert teacher_threads(_reference(1, 2), "cpu", 3) == 2  # --threads 3 too: the bound holds at the reference's
    assert teacher_threads(_reference(1, 0), "cpu", 3) == 3  # not recorded: the run's (--threads, else cores / tp)
    assert teacher_threads(_reference(1, 2), "cuda", 1) == 1  # CPU threads do not order a GPU's sums


def test_a_reference_computed_at_tp_above_1_has_the_wider_bound():
    """3 ulps: over the bound against a tp-1 reference, noise against a tp-2 one (both sides split their sums)."""
    from dsv41_convert.verify.teacher import ULPS_BOUND, ULPS_BOUND_SPLIT_REFERENCE, ulps_bound

    assert ulps_bound(_reference(1, 1)) == ULPS_BOUND < 3 < ulps_bound(_reference(2, 1)) == ULPS_BOUND_SPLIT_REFERENCE
    three = [ModuleDeviations(positions=8, ulps={"layers.0.attn": 3.0})]
    assert judge(three, ["p"]).failures == ["teacher layers.0.attn: 3 bf16 ulps > 2 (p)"]
    assert judge(three, ["p"], ULPS_BOUND_SPLIT_REFERENCE).failures == []


def test_a_near_tie_broken_the_other_way_is_not_a_differing_choice():
    """Indexer scores are bf16 and tie exactly; another tp's reduction moves one by an ulp, and the tie breaks the
    other way (a helper's hunt: a correct tp-8 conversion FAILed at 4 of 28 positions). Counted: a reference
    choice more than TIE_ULPS below this run's worst chosen score, or one not reachable here."""
    from dsv41_convert.verify.teacher import TIE_ULPS, differing_choices

    offset = 4  # window rows before the compressed ones
    scores = torch.tensor([[1.0, 0.5, 0.5, -torch.inf], [2.0, 1.0, 1.0 - 2**-8, 0.25]], dtype=torch.bfloat16)
    own = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32) + offset
    assert differing_choices(own, own.clone(), scores, offset) == 0
    tie = torch.tensor([[0, 2], [0, 2]], dtype=torch.int32) + offset  # an exact tie; one ulp (2**-8 of 1.0) below
    assert differing_choices(own, tie, scores, offset) == 0
    far = torch.tensor([[0, 1], [0, 3]], dtype=torch.int32) + offset  # 0.25: 0.75 below, ulps of 2.0 are 2**-6
    assert TIE_ULPS * 2**-6 < 0.75 and differing_choices(own, far, scores, offset) == 1
    # the ulps are the row's largest score's (as bf16_ulps): a tie near a small score is as near as the sums' noise
    small = torch.tensor([[8.0, 2**-4, 2**-4 - 2**-7, -1.0]], dtype=torch.bfloat16)  # 2**-7: 32 ulps of 2**-4
    assert differing_choices(own[:1], torch.tensor([[0, 2]], dtype=torch.int32) + offset, small, offset) == 0
    assert differing_choices(own[:1], torch.tensor([[0, 3]], dtype=torch.int32) + offset, small, offset) == 1
    masked = torch.tensor([[0, 3], [0, 1]], dtype=torch.int32) + offset  # a row this run's candidates masked
    assert differing_choices(own, masked, scores, offset) == 1
    unreachable = torch.tensor([[0, -1], [0, 1]], dtype=torch.int32)  # fewer reachable rows than this run's
    unreachable[0, 0] += offset
    unreachable[1] += offset
    assert differing_choices(own, unreachable, scores, offset) == 1


def test_candidate_blocks_differing_by_a_near_tie_are_not_counted():
    """The candidate source's first-level choice ties as the top-k does (a helper's hunt: blocks 1 and 3 of a
    tp-1 run tied at 0.0231934, one ulp apart at tp 8). Counted: a reference block more than TIE_ULPS below this
    run's worst kept block, or another number of blocks. The newest block is always kept (+inf)."""
    from dsv41_convert.model.indexer import candidate_block_scores, select_candidate_blocks
    from dsv41_convert.verify.teacher import differing_blocks

    scores = torch.tensor(
        [[[1.0, 0.25, 0.5, 0.0, 0.5, 0.0, 0.125, 0.0, 0.375]]], dtype=torch.bfloat16
    )  # one query, 9 positions, blocks of 2: best 1.0, 0.5, 0.5, 0.125, 0.375 (the newest)
    lens = 9
    blocks = candidate_block_scores(scores, lens, 2)[0]
    assert blocks[0].tolist() == [1.0, 0.5, 0.5, 0.125, math.inf]
    own = select_candidate_blocks(scores, lens, 3, 2)[0]  # blocks 0, one of 1 / 2, 4
    assert differing_blocks(own, own.clone(), blocks, 2) == 0

    def mask(*kept: int) -> torch.Tensor:
        m = torch.zeros(1, 9, dtype=torch.bool)
        for b in kept:
            m[0, 2 * b : 2 * b + 2] = True
        return m

    left_out = next(b for b in (1, 2) if not bool(own[0, 2 * b]))  # the tied block this run did not keep
    assert differing_blocks(own, mask(0, left_out, 4), blocks, 2) == 0
    assert differing_blocks(own, mask(0, 3, 4), blocks, 2) == 1  # 0.125: far below 0.5 (2 ulps of 1.0: 2**-6)
    assert differing_blocks(own, mask(0, 1, 2, 4), blocks, 2) == 1  # another number of blocks
