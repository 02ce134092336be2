"""The one table of tensor rules: what happens to every checkpoint tensor on its way to the rank files.

No other module matches on tensor names. Every (renamed) checkpoint name must fully match exactly one
rule; there is no catch-all, so an unknown tensor stops the plan instead of being replicated.

A rule states three things, all as upstream convert.py does them for the published checkpoint:
- `split`: how the tensor is divided over tp ranks;
- `op`: the family of the tensor (a plain copy, an fp8 weight, its scale, a routed expert, ...);
- `src`: the dtype the published checkpoint stores it in (checked against the header); the first is the
  published one, a second is what `export --format fp8` writes (routed experts).
`actions` turns (op, source dtype, --expert-dtype) into what the plan does, for published (fp8/fp4)
sources and for unquantized (bf16/fp32) ones alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from dsv41_convert.errors import PlanError
from dsv41_convert.expert_names import ROUTED_EXPERT


class Split(StrEnum):
    NONE = "none"  # replicated on every rank
    DIM0 = "dim0"  # column / vocab parallel: rows r*k .. (r+1)*k
    DIM1 = "dim1"  # row parallel: columns r*k .. (r+1)*k
    EXPERT = "expert"  # whole, on rank E // (n_experts / tp)
    ROWS_PADDED = "rows_padded"  # ceil(rows/tp) rows each, the tail padded (0 weight, 1.0 scale)


def split_dim(split: Split) -> int:
    """The dim `split` cuts a tensor along: 1 for DIM1, 0 for DIM0 and ROWS_PADDED, -1 for NONE and EXPERT (whole
    on a rank). A piece of no more dims than that is no piece of such a split (an edited header)."""
    return {Split.DIM0: 0, Split.ROWS_PADDED: 0, Split.DIM1: 1}.get(split, -1)


class Op(StrEnum):
    KEEP = "keep"  # bf16/f32 tensor, copied (a source of another float dtype is cast)
    FP8 = "fp8"  # e4m3 weight with 32x32 e8m0 scales (a bf16 source is quantized)
    SCALE = "scale"  # the e8m0 scale of the weight beside it; follows its split at block granularity
    AS_FP4 = "as_fp4"  # routed expert: I8 bytes are e2m1 pairs (a bf16 source is quantized to MXFP4)
    ENGRAM_ROWS = "engram_rows"  # Engram table, e4m3 rows with per-32 scales
    DEQUANT_BF16 = "dequant_bf16"  # wo_a: weight x scale -> bf16
    FOLD_INTO_WEIGHT = "fold_into_weight"  # wo_a's scale, consumed by the dequantization
    DROP = "drop"  # mtp.K.embed / head: tied to the backbone's


@dataclass(frozen=True)
class Rule:
    pattern: str  # full-match regex over the (renamed) checkpoint name
    split: Split
    op: Op = Op.KEEP
    src: tuple[str, ...] = ()  # header dtypes of the published checkpoint


_L = r"(layers|mtp)\.\d+\."  # backbone layer or MTP stage
_F8, _E8, _BF, _F32 = ("F8_E4M3",), ("F8_E8M0",), ("BF16",), ("F32",)

RULES: tuple[Rule, ...] = (
    # embeddings, head, final norm, image tokens
    Rule(r"embed\.weight", Split.DIM0, Op.KEEP, _BF),
    Rule(r"head\.weight", Split.DIM0, Op.KEEP, _BF),
    Rule(r"norm\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(r"image_(start|end|newline)", Split.NONE, Op.KEEP, _BF),
    # attention, backbone and MTP
    Rule(_L + r"attn\.(wq_a|wkv)\.weight", Split.NONE, Op.FP8, _F8),
    Rule(_L + r"attn\.(wq_a|wkv)\.scale", Split.NONE, Op.SCALE, _E8),
    Rule(_L + r"attn\.wq_b\.weight", Split.DIM0, Op.FP8, _F8),
    Rule(_L + r"attn\.wq_b\.scale", Split.DIM0, Op.SCALE, _E8),
    Rule(_L + r"attn\.wo_a\.weight", Split.DIM0, Op.DEQUANT_BF16, _F8),
    Rule(_L + r"attn\.wo_a\.scale", Split.DIM0, Op.FOLD_INTO_WEIGHT, _E8),
    Rule(_L + r"attn\.wo_b\.weight", Split.DIM1, Op.FP8, _F8),
    Rule(_L + r"attn\.wo_b\.scale", Split.DIM1, Op.SCALE, _E8),
    Rule(_L + r"attn\.attn_sink", Split.DIM0, Op.KEEP, _F32),
    Rule(_L + r"attn\.(q_norm|kv_norm)\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(r"layers\.\d+\.attn\.compressor\.(wkv|wgate|norm)\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(r"layers\.\d+\.attn\.indexer\.wq_b\.weight", Split.DIM0, Op.FP8, _F8),
    Rule(r"layers\.\d+\.attn\.indexer\.wq_b\.scale", Split.DIM0, Op.SCALE, _E8),
    Rule(r"layers\.\d+\.attn\.indexer\.weights_proj\.weight", Split.DIM0, Op.KEEP, _BF),
    Rule(r"layers\.\d+\.attn\.indexer\.(wk|k_norm)\.weight", Split.NONE, Op.KEEP, _BF),
    # block norms and hyper-connections
    Rule(_L + r"(attn_norm|ffn_norm)\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(_L + r"hc_(attn|ffn)_(fn|base|scale)", Split.NONE, Op.KEEP, _F32),
    # MoE
    Rule(_L + r"ffn\.gate\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(_L + r"ffn\.gate\.(bias|bias_vl)", Split.NONE, Op.KEEP, _F32),
    Rule(_L + r"ffn\.shared_experts\.w[123]\.weight", Split.NONE, Op.FP8, _F8),
    Rule(_L + r"ffn\.shared_experts\.w[123]\.scale", Split.NONE, Op.SCALE, _E8),
    # I8 packed e2m1 as published; F8_E4M3 with 32x32 scales in an `export --format fp8` checkpoint
    Rule(_L + r"ffn\.experts\.\d+\.w[123]\.weight", Split.EXPERT, Op.AS_FP4, ("I8", "F8_E4M3")),
    Rule(_L + r"ffn\.experts\.\d+\.w[123]\.scale", Split.EXPERT, Op.SCALE, _E8),
    # Engram
    Rule(r"layers\.\d+\.engram\.embed\.weight", Split.ROWS_PADDED, Op.ENGRAM_ROWS, _F8),
    Rule(r"layers\.\d+\.engram\.embed\.scale", Split.ROWS_PADDED, Op.SCALE, _E8),
    Rule(r"layers\.\d+\.engram\.wkv\.weight", Split.NONE, Op.FP8, _F8),
    Rule(r"layers\.\d+\.engram\.wkv\.scale", Split.NONE, Op.SCALE, _E8),
    Rule(r"layers\.\d+\.engram\.(q_weight|k_weight)", Split.NONE, Op.KEEP, _BF),
    # DSpark MTP stages
    Rule(r"mtp\.\d+\.(embed|head)\.weight", Split.NONE, Op.DROP, _BF),
    Rule(r"mtp\.\d+\.main_proj\.weight", Split.NONE, Op.FP8, _F8),
    Rule(r"mtp\.\d+\.main_proj\.scale", Split.NONE, Op.SCALE, _E8),
    Rule(r"mtp\.\d+\.(main_norm|norm)\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(r"mtp\.\d+\.markov_head\.(embed|head)\.weight", Split.DIM0, Op.KEEP, _BF),
    Rule(r"mtp\.\d+\.confidence_head\.proj\.weight", Split.NONE, Op.KEEP, _BF),
    # vision tower and aligner (mlp keeps its name here)
    Rule(r"vision\.blocks\.\d+\.attn\.(wqkv|wo)\.(weight|bias)", Split.NONE, Op.KEEP, _BF),
    Rule(r"vision\.blocks\.\d+\.mlp\.w[12]\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(r"vision\.blocks\.\d+\.norm[12]\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(r"vision\.norm\.weight", Split.NONE, Op.KEEP, _BF),
    Rule(r"vision\.patch_embed\.proj\.(weight|bias)", Split.NONE, Op.KEEP, _BF),
    Rule(r"aligner\.w[12]\.(weight|bias)", Split.NONE, Op.KEEP, _BF),
)

_COMPILED = tuple((re.compile(r.pattern), r) for r in RULES)
_SCALED = (Op.FP8, Op.AS_FP4, Op.ENGRAM_ROWS, Op.DEQUANT_BF16)  # published with a `.scale` beside


def canonical_name(name: str) -> str:
    """The inference name of a checkpoint name: older spellings renamed as upstream convert.py does
    (`model.` prefix, self_attn -> attn, mlp -> ffn outside vision, weight_scale_inv -> scale,
    e_score_correction_bias -> bias)."""
    name = name.removeprefix("model.")
    name = name.replace("self_attn", "attn")
    if not name.startswith("vision."):
        name = name.replace("mlp", "ffn")
    return name.replace("weight_scale_inv", "scale").replace("e_score_correction_bias", "bias")


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a whole-component number: layer, stage, expert, block id
_MEMO: dict[str, Rule] = {}


def match_rule(name: str) -> Rule:
    """The one rule whose pattern fully matches `name` (a canonical name); PlanError for none or two.

    Every `\\d+` in the table stands for a whole dot-separated component, so names that differ only in
    such numbers match the same rule; the answer is memoized per such template (96k names, ~150 templates).
    """
    template = _INDEX.sub("#", name)
    rule = _MEMO.get(template)
    if rule is not None:
        return rule
    hits = [r for rx, r in _COMPILED if rx.fullmatch(name)]
    if len(hits) == 1:
        _MEMO[template] = hits[0]
        return hits[0]
    if not hits:
        raise PlanError(f"{name}: no rule in dsv41_convert/convert/rules.py matches this tensor; another revision?")
    raise PlanError(f"{name}: matches {len(hits)} rules ({', '.join(r.pattern for r in hits)}); the table is ambiguous")


def rule_of(name: str) -> Rule | None:
    """match_rule's rule, or None where no rule matches: no tensor of the model, which the strict load of the
    model names (a checker that reads the rule first leaves such a name to it)."""
    try:
        return match_rule(name)
    except PlanError:
        if any(rx.fullmatch(name) for rx, _ in _COMPILED):
            raise  # two rules: the table's fault
        return None


_EXPERT_RULES: dict[tuple[str, str], Rule] = {}  # (name before the expert id, after it) -> its rule


def classify(name: str) -> tuple[Rule, tuple[bool, int] | None]:
    """(match_rule(name), and for a rule that splits by expert expert_index(name), else None) of a canonical name.

    A routed expert's name (94k of the real checkpoint's 96k) takes a shortcut: names that differ only in the
    expert id have one template in match_rule's sense (the id is a whole dot-separated number), so one rule,
    memoized here per the name's two other parts and found without match_rule's regex; and as every expert
    rule reads `(layers|mtp).L.ffn.experts.E.`, the id is the number after `.experts.`.
    """
    head, sep, tail = name.partition(".experts.")
    expert_id, _, rest = tail.partition(".")
    if not (sep and expert_id.isdecimal()):
        rule = match_rule(name)
        return rule, expert_index(name) if rule.split is Split.EXPERT else None
    rule = _EXPERT_RULES.get((head, rest)) or _EXPERT_RULES.setdefault((head, rest), match_rule(name))
    return rule, (head.startswith("mtp."), int(expert_id)) if rule.split is Split.EXPERT else None


def has_scale(op: Op) -> bool:
    """Whether the published checkpoint stores a `.scale` beside weights of this family."""
    return op in _SCALED


def expert_index(name: str) -> tuple[bool, int] | None:
    """(is_mtp, expert id) of a routed-expert tensor name, None for any other name."""
    m = ROUTED_EXPERT.match(name)
    return None if m is None else (m["stack"] == "mtp", int(m["expert"]))


def expert_prefix(name: str) -> str | None:
    """The part of a routed-expert name before its expert id (`layers.3.ffn.experts.7.w1.weight` ->
    `layers.3.ffn.experts.`): what every tensor of the layer's experts, and no other, starts with. None for a
    name without `.experts.`."""
    head, sep, _ = name.partition(".experts.")
    return head + sep if sep else None


def scale_name(weight_name: str) -> str:
    """`x.weight` -> `x.scale`."""
    return weight_name.removesuffix(".weight") + ".scale"


def weight_name(scale: str) -> str:
    """`x.scale` -> `x.weight`."""
    return scale.removesuffix(".scale") + ".weight"
