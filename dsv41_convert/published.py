"""The published V4.1-Flash config.json (dsv41_convert/data/v41-flash.config.json) as the yardstick of a
config that describes its tensors: the settings no tensor shows are compared with it."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from importlib import resources
from typing import Any

from dsv41_convert.config import HF_NAMES, ModelArgs
from dsv41_convert.convert.catalogue import catalogue

REAL_CONFIG = "v41-flash.config.json"


def real_config() -> dict[str, Any]:
    """The published V4.1-Flash config.json (nested HF form)."""
    return json.loads(resources.files("dsv41_convert").joinpath("data", REAL_CONFIG).read_text(encoding="utf-8"))


@functools.cache
def published_args() -> ModelArgs:
    return ModelArgs.from_hf_dict(real_config(), f"dsv41_convert/data/{REAL_CONFIG}")


@functools.lru_cache(maxsize=4)  # the published model's, built once (48k parameters, ~65 ms)
def _tensors(args: ModelArgs) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, format) of every parameter `args` implies (the routed experts too), whatever their storage
    (a bf16 export or an fp8-expert one implies the published model's)."""
    return [(p.name, p.shape, p.fmt.value) for p in catalogue(args)]


def settings_unlike_published(args: ModelArgs, names: Mapping[str, str] = HF_NAMES) -> list[str]:
    """Each setting of `args` unlike the published V4.1-Flash config's, as "text_config.sliding_window 256
    (published 128)", where every tensor `args` implies is the published one's (names, shapes, formats, in any
    storage); [] where any differs (make-tiny's presets, a pruned or widened model: nothing to compare with).
    names: each field's key in the file `args` came from (HF_NAMES; {} for an inference config, whose keys are
    the field names: "window_size 256 (published 128)").

    Such a setting shapes no tensor (rope betas, sliding_window, index_topk, qk_rope_head_dim within its
    bound, the special token ids): the model runs as the config says, and verify passes the conversion (it
    runs source and conversion with this one config), with other logits than the published model's."""
    published = published_args()
    if _tensors(args) != _tensors(published):
        return []
    return [
        f"{names.get(f.name, f.name)} {getattr(args, f.name)!r} (published {getattr(published, f.name)!r})"
        for f in dataclasses.fields(ModelArgs)
        if f.compare and f.name not in ("dtype", "expert_dtype") and getattr(args, f.name) != getattr(published, f.name)
    ]
