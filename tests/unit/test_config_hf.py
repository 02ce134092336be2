"""ModelArgs from the nested HF config.json and from the inference config: every key the published config
maps is required, every key nobody knows is refused (at every level), and the derived values follow the
fields (a mutation audit found each of these untested)."""

from __future__ import annotations

import copy
import json

import pytest
from tiny_ckpt import REAL_CONFIG

from dsv41_convert.config import ModelArgs
from dsv41_convert.errors import ConfigError

PUBLISHED = json.loads(REAL_CONFIG.read_text())
# text_config keys of the published config that carry no ModelArgs field: the model supports one value of each
# (or they are a framework's bookkeeping), so a config may leave them out
TEXT_OPTIONAL = {
    "attention_bias",
    "attention_dropout",
    "hidden_act",
    "initializer_range",
    "max_position_embeddings",
    "model_type",
    "num_key_value_heads",
    "tie_word_embeddings",
    "topk_method",
    "use_cache",
}
VISION_OPTIONAL = {"model_type"}


def _published() -> dict:
    return copy.deepcopy(PUBLISHED)


def _required_paths() -> list[tuple[str, ...]]:
    text, vision = PUBLISHED["text_config"], PUBLISHED["vision_config"]
    paths = [("text_config", k) for k in sorted(set(text) - TEXT_OPTIONAL - {"rope_scaling"})]
    paths += [("text_config", "rope_scaling", k) for k in sorted(set(text["rope_scaling"]) - {"rope_type"})]
    paths += [("vision_config", k) for k in sorted(set(vision) - VISION_OPTIONAL)]
    return [*paths, ("image_token_id",)]


def _parent(cfg: dict, path: tuple[str, ...]) -> dict:
    for key in path[:-1]:
        cfg = cfg[key]
    return cfg


def test_the_published_config_reads():
    args = ModelArgs.from_hf_dict(_published())
    assert (args.dtype, args.expert_dtype, args.norm_topk_prob) == ("fp8", "fp4", True)
    assert (args.beta_fast, args.beta_slow, args.original_seq_len, args.rope_factor) == (32, 1, 65536, 16)
    assert args.image_token_id == 129264


@pytest.mark.parametrize("path", _required_paths(), ids=lambda p: ".".join(p))
def test_every_mapped_key_of_the_published_config_is_required(path):
    """A key left out is refused, naming it: none is defaulted (norm_topk_prob, the YaRN settings, the vision
    tower's sizes and image_token_id included), since a default may not be what the weights were trained with."""
    cfg = _published()
    del _parent(cfg, path)[path[-1]]
    with pytest.raises(ConfigError, match=path[-1]):
        ModelArgs.from_hf_dict(cfg)


@pytest.mark.parametrize("path", [(k,) for k in sorted(TEXT_OPTIONAL)], ids=lambda p: p[0])
def test_an_optional_text_key_may_be_left_out(path):
    cfg = _published()
    del cfg["text_config"][path[0]]
    assert ModelArgs.from_hf_dict(cfg) == ModelArgs.from_hf_dict(_published())


@pytest.mark.parametrize(
    "where", [(), ("text_config",), ("text_config", "rope_scaling"), ("vision_config",), ("quantization_config",)]
)
@pytest.mark.parametrize("key", ["rope_parameters_v2", "modules_to_not_convert"])
def test_an_unknown_key_is_refused_at_every_level(where, key):
    cfg = _published()
    _parent(cfg, (*where, key))[key] = None
    with pytest.raises(ConfigError, match=f"unknown keys.*{key}"):
        ModelArgs.from_hf_dict(cfg)


def test_a_quantization_config_without_scale_fmt_is_refused():
    cfg = _published()
    del cfg["quantization_config"]["scale_fmt"]
    with pytest.raises(ConfigError, match="scale_fmt None, expected 'ue8m0'"):
        ModelArgs.from_hf_dict(cfg)


def test_a_quantization_config_without_expert_dtype_keeps_the_experts_in_dtype():
    """No expert_dtype: the experts are stored as the rest (fp8), as upstream's rank-file configs say it; not
    the published fp4."""
    cfg = _published()
    del cfg["quantization_config"]["expert_dtype"]
    args = ModelArgs.from_hf_dict(cfg)
    assert (args.dtype, args.expert_dtype) == ("fp8", None)


def test_the_mtp_stages_take_the_dspark_expert_counts_from_the_first_stage_on():
    cfg = _published()
    text = cfg["text_config"]
    n_layers = text["num_hidden_layers"]
    args = ModelArgs.from_hf_dict(cfg)
    assert args.moe_config(n_layers - 1) == (384, 6)
    for stage in range(text["num_nextn_predict_layers"]):
        assert args.moe_config(n_layers + stage) == (128, 3)
    text["dspark_n_routed_experts"] = text["dspark_num_experts_per_tok"] = 0  # unset: the backbone's
    assert ModelArgs.from_hf_dict(cfg).moe_config(n_layers) == (384, 6)


def test_an_inference_config_missing_any_field_is_refused_naming_it():
    full = ModelArgs.from_hf_dict(_published()).to_inference_dict()
    for key in sorted(set(full) - {"norm_topk_prob"}):
        data = {k: v for k, v in full.items() if k != key}
        with pytest.raises(ConfigError, match=rf"missing keys \['{key}'\]"):
            ModelArgs.from_inference_dict(data)
    assert ModelArgs.from_inference_dict({k: v for k, v in full.items() if k != "norm_topk_prob"}).norm_topk_prob


@pytest.mark.parametrize(("key", "value"), [("engram_n_heads", 10**7), ("engram_max_ngram_size", 10**6)])
def test_an_engram_typo_past_the_primes_searched_is_refused_by_the_bound_alone(monkeypatch, key, value):
    """A head count or n-gram size typed far too large needs millions of bucket primes, found one by one (minutes,
    on every config read: a helper's hunt): refused by their least sum alone, no prime searched."""
    from dsv41_convert import config as config_module
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import preset_files

    hf, _ = preset_files(PRESETS["tiny"])
    hf["text_config"][key] = value

    def searched(*_args):
        raise AssertionError("bucket primes searched one by one")

    monkeypatch.setattr(config_module, "engram_table_rows", searched)
    with pytest.raises(ConfigError, match=rf"{key} {value}\b.* give tables of at least \[\d+(, \d+)*\] rows"):
        ModelArgs.from_hf_dict(hf, "config.json")


@pytest.mark.parametrize(
    ("text", "searchable"),
    [
        ({"engram_n_heads": 10**6}, "100,000"),  # as many rows as the least bound asks: it passes that bound
        ({"engram_n_heads": 1000, "engram_vocab_size": 2**62}, "5,528"),  # 6,000 primes near 2**62
    ],
)
def test_engram_bucket_primes_past_what_is_searched_are_refused_without_a_search(monkeypatch, text, searchable):
    """A config of far too many bucket primes whose rows pass the least bound (or of primes so large that each
    costs tens of numbers tested) searched them all one by one: minutes on every config read, then a refusal
    or not. Refused at once, naming the counts; no prime searched."""
    from dsv41_convert import config as config_module
    from dsv41_convert.engram_buckets import engram_least_rows
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import preset_files

    hf, _ = preset_files(PRESETS["tiny"])
    tc = hf["text_config"]
    tc.update(text)
    least = engram_least_rows(tc["engram_max_ngram_size"], tc["engram_n_heads"], tc["engram_vocab_size"])
    tc["engram_num_embeddings"] = [min(least, 2**63 - 1)] * len(tc["engram_layer_ids"])  # no tensor holds more

    def searched(*_args):
        raise AssertionError("bucket primes searched one by one")

    monkeypatch.setattr(config_module, "engram_table_rows", searched)
    with pytest.raises(ConfigError, match=rf"config.json: .* bucket primes above .*at most {searchable} primes"):
        ModelArgs.from_hf_dict(hf, "config.json")


def test_engram_bucket_primes_within_what_is_searched_are_checked():
    """The bound refuses nothing the tool can search: 5,000 primes near 2**62 are found and the rows compared."""
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import preset_files

    hf, _ = preset_files(PRESETS["tiny"])
    hf["text_config"].update(engram_layer_ids=[0], engram_num_embeddings=[1], engram_max_ngram_size=2)
    hf["text_config"].update(engram_n_heads=5000, engram_vocab_size=2**62)
    with pytest.raises(ConfigError, match=r"engram_num_embeddings \[1\], but .* give tables of \[\d+\] rows"):
        ModelArgs.from_hf_dict(hf, "config.json")


def test_engram_bucket_primes_exactly_as_many_as_searched_are_searched(monkeypatch):
    """The bound is the most primes searched: a config of exactly that many is searched and its rows compared,
    one of a prime more is refused."""
    from dsv41_convert import config as config_module
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import preset_files

    hf, _ = preset_files(PRESETS["tiny"])
    tc = hf["text_config"]
    n = len(tc["engram_layer_ids"]) * (tc["engram_max_ngram_size"] - 1) * tc["engram_n_heads"]
    monkeypatch.setattr(config_module, "engram_primes_searchable", lambda *_args: n)
    ModelArgs.from_hf_dict(copy.deepcopy(hf), "config.json")  # the tiny preset's own rows: searched, equal
    monkeypatch.setattr(config_module, "engram_primes_searchable", lambda *_args: n - 1)
    with pytest.raises(ConfigError, match=rf"= {n:,} bucket primes above .*at most {n - 1:,} primes"):
        ModelArgs.from_hf_dict(hf, "config.json")


class _Compared(int):
    """A layer id that counts the comparisons made of it (json gives ints; an int subclass is one to the checks)."""

    made = 0

    def __eq__(self, other):
        _Compared.made += 1
        return int(self) == other

    def __lt__(self, other):
        _Compared.made += 1
        return int(self) < other

    def __le__(self, other):
        _Compared.made += 1
        return int(self) <= other

    __hash__ = int.__hash__


def test_long_layer_id_lists_are_checked_without_comparing_every_pair():
    """kv_source_layer_ids, index_source_layer_ids and dspark_target_layer_ids of 100,000 layers (compress_ratios
    as long) took minutes to read: every source was scanned for the one before each compressed layer, and each id
    counted through the whole list for repeats (30,000 dspark targets: 12 s, 10,000 compressed layers: 7 s). Now
    sorted and bisected, and counted once: a few dozen comparisons an id, not one per other id."""
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import preset_files

    hf, _ = preset_files(PRESETS["tiny"])
    text, n = hf["text_config"], 2000
    text["compress_ratios"] = [1] * n + [0] * text["num_nextn_predict_layers"]
    text["num_hidden_layers"] = n
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "dspark_target_layer_ids"):
        text[key] = [_Compared(i) for i in range(n)]
    _Compared.made = 0
    args = ModelArgs.from_hf_dict(hf, "config.json")
    assert args.n_layers == n and len(args.dspark_target_layer_ids) == n
    assert _Compared.made < 50 * 3 * n, f"{_Compared.made:,} comparisons of {3 * n:,} layer ids"
