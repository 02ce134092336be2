"""The rule table against the real 96,085-tensor catalog and against upstream's own way of choosing splits."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from dsv41_convert.config import load_model_args
from dsv41_convert.convert.catalogue import published_layout, routed_expert_layout
from dsv41_convert.convert.rules import RULES, Op, Split, canonical_name, classify, expert_index, match_rule
from dsv41_convert.errors import PlanError

REF = Path(__file__).resolve().parents[1] / "data" / "reference"  # see tests/reference_data.py


@pytest.fixture(scope="module")
def catalog() -> dict[str, tuple[str, tuple[int, ...]]]:
    rows = json.loads((REF / "v41-flash.tensor-catalog.json").read_text())
    out = {}
    for row in rows:
        for combo in itertools.product(*row["axes"]):
            out[row["pattern"].format(*combo)] = (row["dtype"], tuple(row["shape"]))
    return out


def test_catalog_size(catalog):
    assert len(catalog) == 96085


def test_every_catalog_name_has_a_rule_accepting_its_dtype(catalog):
    for name, (dtype, _) in catalog.items():
        assert dtype in match_rule(name).src, (name, dtype)


@pytest.mark.slow
def test_every_catalog_name_matches_exactly_one_rule_unmemoized(catalog):

    compiled = [(re.compile(r.pattern), r) for r in RULES]
    for name in catalog:
        hits = [r for rx, r in compiled if rx.fullmatch(name)]
        assert len(hits) == 1, (name, [h.pattern for h in hits])
        assert match_rule(name) is hits[0]


def _upstream_split(name: str) -> Split:
    """Upstream's choice, restated: experts by index, Engram rows padded, else a split by the
    second-to-last name component (the last one for hc_*, attn_sink, image_*)."""
    if ".experts." in name and "shared_experts" not in name:
        return Split.EXPERT
    if ".engram.embed." in name:
        return Split.ROWS_PADDED
    parts = name.split(".")
    key = parts[-1] if any(x in name for x in ("hc", "attn_sink", "image_")) else parts[-2]
    dims = {"embed": 0, "head": 0, "wq_b": 0, "wo_a": 0, "attn_sink": 0, "weights_proj": 0, "wo_b": 1}
    if key not in dims:
        return Split.NONE
    return Split.DIM0 if dims[key] == 0 else Split.DIM1


def test_splits_agree_with_upstreams_name_logic(catalog):
    for name in catalog:
        assert match_rule(name).split is _upstream_split(name), name


def test_wo_a_and_experts_ops():
    assert match_rule("layers.3.attn.wo_a.weight").op is Op.DEQUANT_BF16
    assert match_rule("mtp.0.attn.wo_a.scale").op is Op.FOLD_INTO_WEIGHT
    assert match_rule("layers.3.ffn.experts.7.w1.weight").src == ("I8", "F8_E4M3")  # published, export --format fp8
    assert match_rule("mtp.1.embed.weight").op is Op.DROP
    assert match_rule("vision.blocks.0.mlp.w1.weight").op is Op.KEEP


def test_layout_of_the_real_config_is_the_catalog(catalog):
    args = load_model_args(REF / "v41-flash.config.json")
    assert published_layout(args) == catalog


def test_routed_expert_layout_is_the_rest_of_the_layout(catalog):
    """validate checks the routed experts from routed_expert_layout and the rest from published_layout without
    them: together they must be the real layout, every name once."""
    args = load_model_args(REF / "v41-flash.config.json")
    experts = {
        prefix + str(e) + tail: (dtype, shape)
        for prefix, n_experts, forms in routed_expert_layout(args)
        for e in range(n_experts)
        for tail, dtype, shape in forms
    }
    rest = published_layout(args, routed_experts=False)
    assert len(experts) == 94464 and not experts.keys() & rest.keys()
    assert experts | rest == catalog


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("model.layers.0.self_attn.wq_b.weight_scale_inv", "layers.0.attn.wq_b.scale"),
        ("model.layers.0.mlp.gate.e_score_correction_bias", "layers.0.ffn.gate.bias"),
        ("vision.blocks.0.mlp.w1.weight", "vision.blocks.0.mlp.w1.weight"),
    ],
)
def test_canonical_names(old, new):
    assert canonical_name(old) == new


def test_unknown_name_is_an_error_not_a_replica():
    with pytest.raises(PlanError, match=r"layers\.0\.attn\.mystery\.weight: no rule"):
        match_rule("layers.0.attn.mystery.weight")
    with pytest.raises(PlanError, match="no rule"):
        match_rule("layers.0.ffn.experts.x.w1.weight")


def _two_steps(name: str):
    rule = match_rule(name)
    return rule, expert_index(name) if rule.split is Split.EXPERT else None


def test_classify_is_match_rule_and_expert_index(catalog):
    """classify's memo for routed experts gives, for every real name and for names the memo could confuse
    (the id not a number, a part that only an expert layer may have, an MTP expert), what the two steps give;
    a name no rule matches stays an error, every time it is seen."""
    odd = [
        "mtp.0.ffn.experts.7.w2.scale",
        "layers.1.ffn.experts.3.w4.weight",
        "layers.1.ffn.experts.x.w1.weight",
        "layers.1.ffn.experts.3",
        "layers.1.ffn.shared_experts.w1.weight",
        "layers.2.attn.experts.3.w1.weight",
    ]
    for name in [*catalog, *odd]:
        try:
            want = _two_steps(name)
        except PlanError as exc:
            for _ in range(2):
                with pytest.raises(PlanError, match=re.escape(str(exc))):
                    classify(name)
            continue
        assert classify(name) == want, name
