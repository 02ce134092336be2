"""make-tiny's config.json against the published one (tests/data/reference): the same keys in the same order at
every level, and every value that is no model size the published value. The presets choose sizes; nothing else
of a synthetic config may differ from the checkpoint it stands in for."""

from __future__ import annotations

import json
from typing import Any

import pytest
from reference_data import REAL_CONFIG

from dsv41_convert.synth.presets import MEDIUM, PRESETS, hf_config

# what a preset sets (sizes, layer schedule, token ids past its vocab), named without their section (text_config.,
# vision_config.); every other value is the published one
SIZES = {
    "image_token_id",
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "max_position_embeddings",
    "rope_scaling.factor",
    "rope_scaling.original_max_position_embeddings",
    "n_routed_experts",
    "num_experts_per_tok",
    "sliding_window",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "candidate_source_layer_id",
    "candidate_topk_blocks",
    "candidate_block_size",
    "engram_layer_ids",
    "engram_num_embeddings",
    "engram_vocab_size",
    "engram_n_heads",
    "engram_head_dim",
    "engram_compressed_vocab_size",
    "dspark_noise_token_id",
    "dspark_target_layer_ids",
    "dspark_markov_rank",
    "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
    "intermediate_size",
    "max_image_tokens",
    "min_pixels",
}


def _flat(config: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf, in file order."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((prefix + key, value))
    return out


def _short(key: str) -> str:
    """`key` without its section (text_config., vision_config.): the name SIZES lists."""
    for section in ("text_config.", "vision_config."):
        if key.startswith(section):
            return key.removeprefix(section)
    return key


def _published() -> dict[str, Any]:
    return json.loads(REAL_CONFIG.read_text())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_keys_and_order_are_the_published_ones(name):
    ours = hf_config(PRESETS[name], compressed_vocab_size=100)
    assert [k for k, _ in _flat(ours)] == [k for k, _ in _flat(_published())]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_value_but_a_size_is_the_published_one(name):
    ours = dict(_flat(hf_config(PRESETS[name], compressed_vocab_size=100)))
    differ = {
        key: (ours[key], value) for key, value in _flat(_published()) if _short(key) not in SIZES and ours[key] != value
    }
    assert differ == {}


def test_medium_vision_tower_is_the_published_one_but_its_depth():
    """medium keeps the real hidden sizes: the vision tower's too (only its layer count is cut)."""
    ours = hf_config(MEDIUM, compressed_vocab_size=100)["vision_config"]
    published = _published()["vision_config"]
    assert {k: v for k, v in ours.items() if k != "num_hidden_layers"} == {
        k: v for k, v in published.items() if k != "num_hidden_layers"
    }


def test_medium_keeps_the_real_attention_schedule_sizes():
    """medium: real window, candidate block, rope scaling, Engram heads and DSpark Markov rank (GPU tests run
    the kernels at the published sizes)."""
    ours = dict(_flat(hf_config(MEDIUM, compressed_vocab_size=100)))
    published = dict(_flat(_published()))
    for key in (
        "text_config.sliding_window",
        "text_config.candidate_block_size",
        "text_config.rope_scaling.factor",
        "text_config.rope_scaling.original_max_position_embeddings",
        "text_config.max_position_embeddings",
        "text_config.engram_n_heads",
        "text_config.engram_head_dim",
        "text_config.dspark_markov_rank",
        "text_config.moe_intermediate_size",
    ):
        assert ours[key] == published[key], key
