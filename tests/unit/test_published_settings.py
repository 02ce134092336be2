"""published.settings_unlike_published: the settings no tensor shows, compared with the published config only
where every tensor is the published one's."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_ckpt import tiny_config

from dsv41_convert.config import ModelArgs
from dsv41_convert.published import published_args, settings_unlike_published


def test_the_published_config_and_its_other_storage_forms_differ_in_nothing():
    published = published_args()
    assert settings_unlike_published(published) == []
    assert settings_unlike_published(dataclasses.replace(published, dtype="bf16", expert_dtype=None)) == []
    assert settings_unlike_published(dataclasses.replace(published, expert_dtype="fp8")) == []
    assert settings_unlike_published(published.with_runtime(max_seq_len=64, max_batch_size=1)) == []


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("window_size", 256, "text_config.sliding_window 256 (published 128)"),
        ("index_topk", 1024, "text_config.index_topk 1024 (published 512)"),
        ("beta_slow", 2, "text_config.rope_scaling.beta_slow 2 (published 1)"),
        ("engram_pad_id", 3, "text_config.engram_pad_token_id 3 (published 2)"),
        ("image_token_id", 7, "image_token_id 7 (published 129264)"),
    ],
)
def test_a_setting_no_tensor_shows_is_named_with_the_published_value(field, value, said):
    assert settings_unlike_published(dataclasses.replace(published_args(), **{field: value})) == [said]


@pytest.mark.parametrize("field", ["dim", "n_routed_experts", "n_layers", "vocab_size"])
def test_another_architecture_is_not_compared(field):
    """A model whose tensors are not the published ones (a pruned or widened one) has nothing to compare with,
    its other settings included."""
    published = published_args()
    other = dataclasses.replace(published, **{field: getattr(published, field) // 2}, window_size=64)
    assert settings_unlike_published(other) == []


def test_make_tinys_configs_are_not_compared():
    assert settings_unlike_published(ModelArgs.from_hf_dict(tiny_config())) == []


@pytest.mark.parametrize(("dtype", "experts"), [("bf16", None), ("fp8", "fp8")])
def test_an_edited_setting_is_named_in_every_storage_form(dtype, experts):
    """A bf16 export (for fine-tuning) or an fp8-expert one of the published model is the published tensors too."""
    edited = dataclasses.replace(published_args(), dtype=dtype, expert_dtype=experts, window_size=256)
    assert settings_unlike_published(edited) == ["text_config.sliding_window 256 (published 128)"]
