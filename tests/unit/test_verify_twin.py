"""verify.twin.cut and verify.localize.diff_tensors on hand-made tensors."""

import pytest
import torch

from dsv41_convert.errors import PlanError
from dsv41_convert.verify.localize import diff_tensors, first_divergence, module_order
from dsv41_convert.verify.twin import cut


def test_cut_rows_columns_replicated():
    full = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(cut(full, torch.Size([3, 4]), 1, 2, "w"), full[3:])
    assert torch.equal(cut(full, torch.Size([6, 2]), 1, 2, "w"), full[:, 2:])
    assert cut(full, torch.Size([6, 4]), 1, 2, "w") is full
    with pytest.raises(PlanError, match=r"w: cannot cut a \[6, 4\]"):
        cut(full, torch.Size([5, 4]), 0, 2, "w")


def test_cut_pads_the_last_rank_with_zero_weights_and_unit_scales():
    w = torch.ones(5, 2).to(torch.float8_e4m3fn)
    s = torch.full((5, 1), 4.0).to(torch.float8_e8m0fnu)
    last_w, last_s = cut(w, torch.Size([3, 2]), 1, 2, "w"), cut(s, torch.Size([3, 1]), 1, 2, "s")
    assert last_w.float().tolist() == [[1, 1], [1, 1], [0, 0]]
    assert last_s.view(torch.uint8).flatten().tolist() == [129, 129, 127]


def _fp4(codes):
    from dsv41_convert.quant.fp4 import pack_nibbles

    return pack_nibbles(torch.tensor(codes, dtype=torch.uint8)).view(torch.float4_e2m1fn_x2)


def test_diff_names_the_tensor_and_rank_and_ignores_signed_zero():
    name = "layers.0.ffn.experts.1.w1.weight"
    want = _fp4([[1, 2, 0, 3]])
    plus_zero_as_minus = _fp4([[1, 2, 8, 3]])  # code 8 is -0: the same value
    assert diff_tensors([{name: plus_zero_as_minus}, {}], {name: want}, ()) == []
    wrong = _fp4([[1, 2, 0, 11]])  # 1.5 -> -1.5
    (d,) = diff_tensors([{}, {name: wrong}], {name: want}, ("layers.0.ffn.",))
    assert d.name == name and d.ranks == (1,) and d.in_scope and d.what.startswith("1 of 4 values differ")


def test_diff_finds_the_rank_of_a_bad_split_piece_and_a_diverged_replica():
    col, rep = "layers.0.attn.wq_b.weight", "layers.0.attn_norm.weight"
    want = {col: torch.arange(8.0).reshape(4, 2).bfloat16(), rep: torch.ones(3).bfloat16()}
    bad = want[col].clone()
    bad[3, 0] = -1
    ranks = [{col: want[col][:2], rep: want[rep]}, {col: bad[2:], rep: want[rep] * 2}]
    diffs = {d.name: d for d in diff_tensors(ranks, want, ())}
    assert diffs[col].ranks == (1,) and diffs[rep].ranks == (1,)


def test_a_replica_changed_on_every_rank_names_every_rank():
    """The first differing copy alone was named (ranks [0] for a norm changed in both rank files: an audit)."""
    rep = "layers.0.attn_norm.weight"
    want = {rep: torch.ones(3).bfloat16()}
    (d,) = diff_tensors([{rep: want[rep] * 2}, {rep: want[rep] * 2}, {rep: want[rep]}], want, ())
    assert d.ranks == (0, 1) and d.what.startswith("3 of 3 values differ"), d


@pytest.mark.parametrize("which", ["weight", "scale"])
def test_engram_padding_rows_other_than_the_fill_are_named(which):
    """The padding rows past an Engram table's rows were cut off before the comparison: a changed padding row
    (the twin's weights check fails it) got no tensor named (an audit at tp 4)."""
    name = f"layers.0.engram.embed.{which}"
    values = torch.tensor([[1.0, 2.0], [4.0, 0.5], [8.0, 0.25], [2.0, 1.0], [0.5, 4.0]])
    want = values.to(torch.float8_e4m3fn if which == "weight" else torch.float8_e8m0fnu)
    parts = [cut(want, torch.Size([2, 2]), r, 3, name) for r in range(3)]  # row 5 of 6 is padding, on rank 2
    assert diff_tensors([{name: p} for p in parts], {name: want}, ()) == []
    parts[2] = parts[2].clone()
    parts[2].view(torch.uint8)[1, 0] += 1
    (d,) = diff_tensors([{name: p} for p in parts], {name: want}, ())
    assert d.ranks == (2,) and d.what.startswith("padding rows 5..5 are not the fill byte"), d


def test_first_divergence_in_forward_order():
    keys = ["norm", "layers.1", "layers.0.ffn", "embed", "layers.1.attn", "layers.0.attn", "layers.0"]
    assert sorted(keys, key=module_order) == [
        "embed", "layers.0.attn", "layers.0.ffn", "layers.0", "layers.1.attn", "layers.1", "norm",
    ]  # fmt: skip
    ref = {k: torch.ones(4) for k in keys}
    conv = dict(ref, **{"layers.1.attn": torch.ones(4) * 1.01, "layers.1": torch.ones(4) * 2})
    first, errors = first_divergence([ref], [conv], 0.0)
    assert first == "layers.1.attn"
    assert first_divergence([ref], [conv], 0.05)[0] == "layers.1"
    assert dict(errors)["layers.0"] == 0.0


def test_first_divergence_takes_each_module_at_its_worst_prompt():
    """A module that differs in one prompt only is the divergence, whichever prompt that is, and with the exact
    mode's tolerance a last-bit difference is one; a NaN output diverges at any tolerance."""
    from dsv41_convert.verify.thresholds import default_thresholds

    keys = ["embed", "layers.0.attn", "layers.0.ffn", "layers.0", "norm"]
    ref = {k: torch.ones(256, dtype=torch.bfloat16) for k in keys}  # one ulp: a relative error of 2**-8 / 16
    one_ulp = ref["layers.0.ffn"].clone()
    one_ulp[2] = torch.nextafter(one_ulp[2], torch.tensor(2.0, dtype=torch.bfloat16))
    differs = dict(ref, **{"layers.0.ffn": one_ulp})
    rtol = default_thresholds("exact").hidden_rtol
    for prompts in ([ref, differs], [differs, ref]):
        first, errors = first_divergence([ref, ref], prompts, rtol)
        assert first == "layers.0.ffn" and dict(errors)["layers.0.ffn"] > 0, (first, errors)
    nan = dict(ref, **{"layers.0.attn": torch.full((256,), float("nan"), dtype=torch.bfloat16)})
    assert first_divergence([ref, ref], [ref, nan], 0.2)[0] == "layers.0.attn"


def test_diff_names_a_nan_where_the_converter_wrote_a_number():
    name = "layers.0.attn_norm.weight"
    want = torch.ones(3).bfloat16()
    got = want.clone()
    got[1] = float("nan")
    (d,) = diff_tensors([{name: got}, {name: want}], {name: want}, ())
    assert d.ranks == (0,) and d.what.startswith("1 of 3 values differ"), d
    both = torch.tensor([1.0, float("nan"), 1.0]).bfloat16()  # NaN where the converter wrote NaN: the same
    assert diff_tensors([{name: both}, {name: both}], {name: both}, ()) == []


def test_the_vision_tower_is_its_own_module_before_the_embeddings():
    """A vision tower fault was localized to "embed" (the image rows enter the stream there): the image spans'
    rows are a module of their own, first in forward order, and its weights (tower, aligner, the delimiters'
    embeddings) are its scope; the token embeddings stay "embed"."""
    from dsv41_convert.verify.localize import module_of

    keys = ["embed", "layers.0.attn", "vision", "norm"]
    assert sorted(keys, key=module_order) == ["vision", "embed", "layers.0.attn", "norm"]
    ref = {k: torch.ones(4) for k in keys}
    both = dict(ref, vision=torch.ones(4) * 2, embed=torch.ones(4) * 2)
    assert first_divergence([ref], [both], 0.0)[0] == "vision"
    text_only = dict(ref, embed=torch.ones(4) * 2)  # the image rows agree: the token embeddings differ
    assert first_divergence([ref], [text_only], 0.0)[0] == "embed"
    for name in ("vision.blocks.0.mlp.w1.weight", "aligner.w2.weight", "image_newline", "image_start"):
        assert module_of(name, 2) == "vision", name
    assert module_of("embed.weight", 2) == "embed"


def test_the_final_norm_and_the_head_are_named_apart_as_the_hidden_states_name_them():
    """A norm.weight fault found by bytes (replicas, weights) was localized as "head", while one found through the
    hidden states was "norm" (README's name): one tensor under two names. The final norm's weights are "norm", the
    head's "head"; each module's scope lists its own."""
    from dsv41_convert.verify.localize import module_of, scope

    assert module_of("norm.weight", 2) == "norm"
    assert module_of("head.weight", 2) == "head"
    assert module_of("mtp.0.head.weight", 2) == "mtp"
    assert "norm.weight".startswith(scope("norm", 2)) and not "head.weight".startswith(scope("norm", 2))
    assert "head.weight".startswith(scope("head", 2)) and not "norm.weight".startswith(scope("head", 2))
    assert "layers.1.hc_ffn_base".startswith(scope("norm", 2))  # the last layer's mix feeds the final norm


def test_image_rows_keep_the_image_spans_and_zero_the_text():
    """hidden["vision"]: the rows merge_image_spans wrote, zeros at text positions and for a text-only prompt."""
    from dsv41_convert.model.transformer import image_rows

    h = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3).bfloat16() + 1
    mask = torch.tensor([[False, True, True, False, False], [False, False, False, False, True]])
    rows = image_rows(h, mask)
    assert torch.equal(rows[mask], h[mask]) and not rows[~mask].any()
    assert not image_rows(h, None).any() and image_rows(h, None).shape == h.shape


def test_a_differing_scale_is_said_in_scale_values_not_bytes():
    """An e8m0 scale whose byte 127 became 128 was reported "1 of 4 values differ (first at [1, 0]), max |diff|
    1": the bytes' difference. A byte is an exponent: the report says the scales (2**0 vs 2**1) beside the
    bytes, and the exponents' largest step; a padding row's fill byte likewise."""
    name = "layers.0.attn.wq_b.scale"
    want = torch.tensor([[1.0, 2.0], [1.0, 0.25]]).to(torch.float8_e8m0fnu)
    got = want.clone()
    got.view(torch.uint8)[1, 0] += 1  # 2**0 -> 2**1
    got.view(torch.uint8)[1, 1] -= 3  # 2**-2 -> 2**-5
    (d,) = diff_tensors([{name: want[:1]}, {name: got[1:]}], {name: want}, ())
    assert d.ranks == (1,), d
    assert d.what == (
        "2 of 4 scales differ (first at [1, 0]: 2**1 vs expected 2**0, bytes 128 vs 127), largest exponent step 3"
    ), d.what
    table = "layers.0.engram.embed.scale"
    values = torch.tensor([[1.0, 2.0], [4.0, 0.5], [8.0, 0.25]]).to(torch.float8_e8m0fnu)
    parts = [cut(values, torch.Size([2, 2]), r, 2, table) for r in range(2)]  # row 3 of 4 is padding
    parts[1].view(torch.uint8)[1, 0] = 130
    (d,) = diff_tensors([{table: p} for p in parts], {table: values}, ())
    assert d.what == "padding rows 3..3 are not the fill byte 127 (scale 2**0)", d.what
