"""ModelArgs: the inference configuration, and its one mapping from the nested HF config.json.

Field names are the inference names (upstream `ModelArgs`, the keys of the inference config
written beside the shards). The HF config goes through `HF_TO_ARGS` and its two siblings; a key
in none of the tables is an error, and so is a missing one.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv41_convert import strict_json
from dsv41_convert.engram_buckets import engram_least_rows, engram_primes_searchable, engram_table_rows
from dsv41_convert.errors import NOT_JSON, ConfigError
from dsv41_convert.file_kinds import refuse_non_file

# text_config key -> ModelArgs field
HF_TO_ARGS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_attention_heads": "n_heads",
    "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "route_scale",
    "swiglu_limit": "swiglu_limit",
    "q_lora_rank": "q_lora_rank",
    "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "o_groups": "o_groups",
    "o_lora_rank": "o_lora_rank",
    "sliding_window": "window_size",
    "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "compress_rope_theta": "compress_rope_theta",
    "rope_theta": "rope_theta",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "candidate_source_layer_id": "candidate_source_layer",
    "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size",
    "hc_mult": "hc_mult",
    "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps",
    "engram_layer_ids": "engram_layer_ids",
    "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size",
    "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads",
    "engram_head_dim": "engram_head_dim",
    "engram_pad_token_id": "engram_pad_id",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size",
    "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id",
    "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank",
    "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}

# text_config.rope_scaling key -> ModelArgs field
HF_ROPE_TO_ARGS: dict[str, str] = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "original_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
}

# vision_config key -> ModelArgs field
HF_VISION_TO_ARGS: dict[str, str] = {
    "num_hidden_layers": "vision_n_layers",
    "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size",
    "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio",
    "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels",
    "max_wh_ratio": "vision_max_wh_ratio",
}

# Keys that carry no ModelArgs field. A value given here is the only one the model supports (a tuple: the
# values it supports, null among them where that means the default); None means any value (provenance only).
# What a framework's save_pretrained adds to a config for its own use (transformers writes the dtype and its
# version into every sub-config, the run's settings where a model class sets them): the weights mean the same.
HF_BOOKKEEPING: dict[str, Any] = dict.fromkeys(
    (
        "_name_or_path",
        "_attn_implementation_autoset",
        "_commit_hash",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "output_router_logits",
        "router_aux_loss_coef",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
)
HF_TEXT_FIXED: dict[str, Any] = HF_BOOKKEEPING | {
    "model_type": None,
    "num_key_value_heads": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": None,
    "initializer_range": None,
    "tie_word_embeddings": False,
    "max_position_embeddings": None,
    "topk_method": ("noaux_tc", None),  # the gate bias in the choice, as the model routes (HF's "greedy" drops it)
    "rope_scaling": None,  # handled through HF_ROPE_TO_ARGS
}
HF_ROPE_FIXED: dict[str, Any] = {"rope_type": "yarn"}
HF_VISION_FIXED: dict[str, Any] = HF_BOOKKEEPING | {"model_type": None}
HF_TOP_FIXED: dict[str, Any] = HF_BOOKKEEPING | {
    "architectures": None,
    "model_type": None,
    "tie_word_embeddings": False,  # transformers 5 writes it at the top
    "image_token_id": None,  # -> image_token_id
    "quantization_config": None,
    "text_config": None,
    "vision_config": None,
}
HF_QUANT_KEYS = ("quant_method", "activation_scheme", "weight_block_size", "scale_fmt", "expert_dtype")
# the published checkpoint's quantization_config, in its key order
HF_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}

# ModelArgs fields that size runtime buffers rather than describe the checkpoint; they are not
# part of config.json and are chosen by the caller.
RUNTIME_FIELDS = ("max_batch_size", "max_seq_len", "temperature")

ENGRAM_PRIMES_SEARCHED = 100_000  # bucket primes of 24 bits found one by one in ~2.5 s (larger: fewer); published: 48

TUPLE_FIELDS = (
    "compress_ratios",
    "kv_source_layers",
    "index_source_layers",
    "engram_layer_ids",
    "engram_num_embeddings",
    "dspark_target_layer_ids",
)


@dataclass(frozen=True)
class ModelArgs:
    """The inference configuration of DeepSeek V4.1 (names as in upstream inference/config.json).

    `compress_ratios` has one entry per layer, backbone then MTP stages. Vision is off when
    `vision_n_layers == 0`; Engram is off when `engram_layer_ids` is empty.
    """

    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_mtp_layers: int
    n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    score_func: str
    route_scale: float
    swiglu_limit: float
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    norm_eps: float
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    compress_rope_theta: float
    original_seq_len: int
    rope_theta: float
    rope_factor: float
    beta_fast: int
    beta_slow: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    vision_n_layers: int
    vision_dim: int
    vision_n_heads: int
    vision_inter_dim: int
    vision_patch_size: int
    vision_rope_theta: float
    vision_downsample_ratio: int
    vision_max_n_token: int
    vision_min_pixels: int
    vision_max_wh_ratio: float | None
    image_token_id: int
    dtype: str  # "fp8" (published) or "bf16" (an unquantized source)
    # routed experts: "fp4" (published: I8 packed e2m1 + per-32 scales), "fp8" (an `export --format fp8`
    # checkpoint: e4m3 + 32x32 scales) or None (rank-file configs: experts in `dtype`, as upstream)
    expert_dtype: str | None
    norm_topk_prob: bool = True
    max_batch_size: int = field(default=4, compare=False)
    max_seq_len: int = field(default=4096, compare=False)
    temperature: float = field(default=0.0, compare=False)

    @property
    def vision_enabled(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def max_positions(self) -> int | None:
        """The positions the model supports: its YaRN context, rope_scaling `factor` x
        `original_max_position_embeddings` (rope_factor x original_seq_len; the published config's
        max_position_embeddings, 16 x 65,536 = 1,048,576). None where YaRN is off (original_seq_len 0): the
        config states no context."""
        if self.original_seq_len <= 0:
            return None
        return math.floor(self.rope_factor * self.original_seq_len)

    @property
    def n_all_layers(self) -> int:
        """Backbone layers plus MTP stages; MTP stage k is layer `n_layers + k`."""
        return self.n_layers + self.n_mtp_layers

    def moe_config(self, layer_id: int) -> tuple[int, int]:
        """(routed, activated) experts of a layer; MTP stages use the dspark counts."""
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    def with_runtime(self, **runtime: Any) -> ModelArgs:
        """A copy with runtime fields (max_batch_size, max_seq_len, temperature) changed."""
        unknown = set(runtime) - set(RUNTIME_FIELDS)
        if unknown:
            raise ValueError(f"not runtime fields: {sorted(unknown)}")
        return dataclasses.replace(self, **runtime)

    def to_inference_dict(self) -> dict[str, Any]:
        """The inference config.json written beside the shards (runtime fields left out)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in RUNTIME_FIELDS:
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_inference_dict(cls, data: dict[str, Any], source: str = "<inference config>") -> ModelArgs:
        """Build from the inference config (ModelArgs names). Every field must be present."""
        names = {f.name for f in dataclasses.fields(cls)}
        optional = set(RUNTIME_FIELDS) | {"norm_topk_prob"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{source}: unknown keys {unknown}; is this a V4.1 inference config?")
        missing = sorted(names - set(data) - optional)
        if missing:
            raise ConfigError(f"{source}: missing keys {missing}")
        check_values(data, source, {})
        kwargs = {k: tuple(v) if k in TUPLE_FIELDS else v for k, v in data.items()}
        args = cls(**kwargs)
        args.validate(source)
        return args

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], source: str = "<config.json>") -> ModelArgs:
        """Build from the nested Hugging Face config.json (text_config / vision_config /
        quantization_config). Unknown and missing keys are errors."""
        if not isinstance(data.get("text_config"), dict):
            raise ConfigError(f"{source}: no text_config object; is this a V4.1 config.json?")
        _check_keys(data, HF_TOP_FIXED, {}, source)
        text = data["text_config"]
        kwargs: dict[str, Any] = {}
        _check_keys(text, HF_TEXT_FIXED, HF_TO_ARGS, f"{source} text_config")
        for hf_key, arg in HF_TO_ARGS.items():
            if hf_key not in text:
                raise ConfigError(f"{source}: text_config.{hf_key} is missing (-> ModelArgs.{arg})")
            kwargs[arg] = text[hf_key]
        rope = text.get("rope_scaling")
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: text_config.rope_scaling must be a YaRN dict, found {rope!r}")
        _check_keys(rope, HF_ROPE_FIXED, HF_ROPE_TO_ARGS, f"{source} text_config.rope_scaling")
        for hf_key, arg in HF_ROPE_TO_ARGS.items():
            if hf_key not in rope:
                raise ConfigError(f"{source}: text_config.rope_scaling.{hf_key} is missing")
            kwargs[arg] = rope[hf_key]

        vision = _object_or_none(data, "vision_config", source)
        if vision is None:
            kwargs.update(_NO_VISION)
        else:
            _check_keys(vision, HF_VISION_FIXED, HF_VISION_TO_ARGS, f"{source} vision_config")
            for hf_key, arg in HF_VISION_TO_ARGS.items():
                if hf_key not in vision:
                    raise ConfigError(f"{source}: vision_config.{hf_key} is missing")
                kwargs[arg] = vision[hf_key]
        if "image_token_id" not in data:
            raise ConfigError(f"{source}: image_token_id is missing")
        kwargs["image_token_id"] = data["image_token_id"]

        quant = _object_or_none(data, "quantization_config", source)
        if quant is None:
            kwargs["dtype"], kwargs["expert_dtype"] = "bf16", None
        else:
            unknown = sorted(set(quant) - set(HF_QUANT_KEYS))
            if unknown:
                raise ConfigError(f"{source}: quantization_config has unknown keys {unknown}")
            block = quant.get("weight_block_size")
            if quant.get("quant_method") != "fp8" or not isinstance(block, list | tuple) or list(block) != [32, 32]:
                raise ConfigError(
                    f"{source}: quantization_config must be fp8 with weight_block_size [32, 32], "
                    f"found {quant.get('quant_method')!r} {quant.get('weight_block_size')!r}"
                )
            if quant.get("scale_fmt") != "ue8m0":
                raise ConfigError(f"{source}: scale_fmt {quant.get('scale_fmt')!r}, expected 'ue8m0'")
            # the model quantizes each activation per block as it runs (act_quant): a "static" scheme's stored input
            # scales were never read, and reference-logits and verify ran, exit 0, on another model than the config's
            scheme = quant.get("activation_scheme", "dynamic")
            if scheme != "dynamic":
                raise ConfigError(
                    f"{source}: quantization_config.activation_scheme {scheme!r}, expected 'dynamic' (activations "
                    "are quantized per block as the model runs; a static scheme's stored input scales are not read)"
                )
            kwargs["dtype"] = "fp8"
            kwargs["expert_dtype"] = quant.get("expert_dtype")
        check_values(kwargs, source, HF_NAMES)
        for name in TUPLE_FIELDS:
            kwargs[name] = tuple(kwargs[name])
        args = cls(**kwargs)
        args.validate(source)
        _one_context(text.get("max_position_embeddings"), args.max_positions, source)
        return args

    def validate(self, source: str) -> None:
        """Cross-field checks the model relies on."""
        n_all = self.n_all_layers
        if len(self.compress_ratios) != n_all:
            raise ConfigError(
                f"{source}: compress_ratios has {len(self.compress_ratios)} entries, expected "
                f"n_layers + n_mtp_layers = {n_all}"
            )
        if any(r not in (0, 1, 2, 4) for r in self.compress_ratios):
            raise ConfigError(f"{source}: compress_ratios {self.compress_ratios} holds unsupported ratios")
        stages = list(self.compress_ratios[self.n_layers :])
        if any(stages):  # model/mtp.py: the DSpark stages attend over the window only
            raise ConfigError(
                f"{source}: compress_ratios {list(self.compress_ratios)}: the DSpark stages' entries {stages} (after "
                f"the {self.n_layers} backbone layers) must be 0; the stages attend over the window only"
            )
        for layer in self.kv_source_layers:
            if not 0 <= layer < self.n_layers or self.compress_ratios[layer] == 0:
                raise ConfigError(f"{source}: kv source layer {layer} must be a backbone layer with compress_ratio > 0")
        for layer in self.index_source_layers:
            if not 0 <= layer < self.n_layers or self.compress_ratios[layer] == 0:
                raise ConfigError(
                    f"{source}: index source layer {layer} must be a backbone layer with compress_ratio > 0"
                )
        # a compressed layer reads the compressed KV and the chosen rows the last kv / index source at or before it
        # published (model/attention.py), at its own ratio: with none there reference-logits and verify died in a
        # TypeError traceback; with another ratio there they ran, reading its positions at the wrong ratio (audits)
        compressed = [(i, ratio) for i, ratio in enumerate(self.compress_ratios[: self.n_layers]) if ratio]
        for key, sources in (
            ("kv_source_layer_ids", self.kv_source_layers),
            ("index_source_layer_ids", self.index_source_layers),
        ):
            ordered = sorted(sources)  # bisected: every source scanned for each layer, 100,000 took minutes
            for i, ratio in compressed:
                before = bisect.bisect_right(ordered, i)
                owner = ordered[before - 1] if before else None
                if owner is None:
                    raise ConfigError(
                        f"{source}: layer {i} has compress_ratio {ratio} but no {key} layer at or before it "
                        f"({list(sources)}): a compressed layer reads what the last one before it wrote"
                    )
                if self.compress_ratios[owner] != ratio:
                    raise ConfigError(
                        f"{source}: layer {i} has compress_ratio {ratio} but reads what {key} layer {owner} wrote "
                        f"at compress_ratio {self.compress_ratios[owner]}: a layer and its source share one ratio"
                    )
        # only an indexer publishes candidate blocks; every index layer after candidate_source_layer reads them
        readers = [i for i in self.index_source_layers if 0 <= self.candidate_source_layer < i]
        if readers and self.candidate_source_layer not in self.index_source_layers:
            raise ConfigError(
                f"{source}: candidate_source_layer_id = {self.candidate_source_layer} is no index_source_layer_ids "
                f"layer, yet the index layers {readers} after it read its candidate blocks"
            )
        if len(self.engram_layer_ids) != len(self.engram_num_embeddings):
            raise ConfigError(f"{source}: engram_layer_ids and engram_num_embeddings differ in length")
        # each layer's rows are the sum of its own distinct primes, each at least engram_vocab_size: where the
        # primes are too many to search one by one (a typo of a head count, 10**7: plan ran for minutes), a config
        # that asks for fewer rows is refused by that bound alone
        n_primes = len(self.engram_layer_ids) * max(self.engram_max_ngram_size - 1, 0) * self.engram_n_heads
        least = engram_least_rows(self.engram_max_ngram_size, self.engram_n_heads, self.engram_vocab_size)
        if n_primes > ENGRAM_PRIMES_SEARCHED and any(n < least for n in self.engram_num_embeddings):
            raise ConfigError(
                f"{source}: engram_num_embeddings {list(self.engram_num_embeddings)}, but engram_vocab_size "
                f"{self.engram_vocab_size}, engram_max_ngram_size {self.engram_max_ngram_size} and engram_n_heads "
                f"{self.engram_n_heads} give tables of at least {[least] * len(self.engram_layer_ids)} rows "
                "(each layer's bucket primes summed)"
            )
        # a config of as many rows as that bound asks (or of huge engram_vocab_size: primes near 2**62, each found
        # in tens of numbers tested) still searched them one by one: minutes on every config read (a helper's hunt)
        searchable = engram_primes_searchable(ENGRAM_PRIMES_SEARCHED, self.engram_vocab_size)
        if n_primes > searchable:
            raise ConfigError(
                f"{source}: engram_layer_ids ({len(self.engram_layer_ids)} layers) x (engram_max_ngram_size "
                f"{self.engram_max_ngram_size} - 1) x engram_n_heads {self.engram_n_heads} = {n_primes:,} bucket "
                f"primes above engram_vocab_size {self.engram_vocab_size:,}: more than this tool searches (at most "
                f"{searchable:,} primes of that size; the published config needs 48 above 16,000,000)"
            )
        rows = engram_table_rows(
            len(self.engram_layer_ids), self.engram_max_ngram_size, self.engram_n_heads, self.engram_vocab_size
        )
        # an n-gram's hash picks a row by these primes: a table of other rows read zeros for the hashes past its end
        # (or never read its last rows), silently, in the reference and the converted model alike (an audit)
        if tuple(self.engram_num_embeddings) != rows:
            raise ConfigError(
                f"{source}: engram_num_embeddings {list(self.engram_num_embeddings)}, but engram_vocab_size "
                f"{self.engram_vocab_size}, engram_max_ngram_size {self.engram_max_ngram_size} and engram_n_heads "
                f"{self.engram_n_heads} give tables of {list(rows)} rows (each layer's bucket primes summed)"
            )
        if self.dtype not in ("fp8", "bf16"):
            raise ConfigError(f"{source}: dtype {self.dtype!r}, expected 'fp8' or 'bf16'")
        if self.expert_dtype not in ("fp4", "fp8", None):
            raise ConfigError(f"{source}: expert_dtype {self.expert_dtype!r}, expected 'fp4', 'fp8' or none")
        if self.head_dim % self.o_groups or (self.n_heads * self.head_dim) % self.o_groups:
            raise ConfigError(f"{source}: n_heads * head_dim must divide into o_groups={self.o_groups}")
        rotated = {"head_dim": self.head_dim}  # the attention rotates the last qk_rope_head_dim dims of its heads
        if self.index_source_layers:  # an indexer those of its own: wider, it changed no tensor, then a traceback
            rotated["index_head_dim"] = self.index_head_dim  # in reference-logits and verify (an audit)
        if not 0 < self.rope_head_dim <= min(rotated.values()) or self.rope_head_dim % 2:
            within = " and ".join(f"{key} {dim}" for key, dim in rotated.items())
            raise ConfigError(f"{source}: qk_rope_head_dim {self.rope_head_dim} must be even and within {within}")
        # the vision tower splits hidden_size into heads and rotates each head's two halves by a 2D RoPE, half the
        # angles by the patch row, half by the column (model/vision.py): heads that do not divide it ended an image
        # prompt in a view() traceback; a head of 2 ran, exit 0, rotated by angles of another size (an audit)
        # heads of a multiple of 4 (no heads at all: check_values' zero sizes)
        if self.vision_enabled and self.vision_n_heads > 0 and self.vision_dim % (4 * self.vision_n_heads):
            raise ConfigError(
                f"{source}: vision_config.hidden_size {self.vision_dim} in {self.vision_n_heads} heads "
                f"(num_attention_heads) of {self.vision_dim / self.vision_n_heads:g}: each head's size must be a "
                "multiple of 4 (a 2D RoPE rotates its halves, half the angles by the patch row, half by the column)"
            )
        for layer in range(self.n_all_layers):
            routed, activated = self.moe_config(layer)
            if not 0 < activated <= routed:
                what = "num_experts_per_tok {} must be between 1 and the {} routed experts"
                if layer >= self.n_layers:  # each count falls back to the backbone's when not set
                    what = (
                        "the DSpark stages' experts per token (dspark_num_experts_per_tok, else num_experts_per_tok) "
                        "{} must be between 1 and their routed experts (dspark_n_routed_experts, else "
                        "n_routed_experts) {}"
                    )
                raise ConfigError(f"{source}: {what.format(activated, routed)}")
        for key, layers in (
            ("engram_layer_ids", self.engram_layer_ids),
            ("dspark_target_layer_ids", self.dspark_target_layer_ids),
        ):
            outside = [i for i in layers if not 0 <= i < self.n_layers]
            if outside:
                raise ConfigError(
                    f"{source}: {key} {list(layers)}: {outside} not a backbone layer (0..{self.n_layers - 1})"
                )
            # each is one module or one capture: a repeat gave two Engram tables one name, or a main_proj wider
            # than the captures it multiplies (fp8_gemm's "differ in K" traceback in reference-logits and verify)
            repeated = sorted(i for i, n in Counter(layers).items() if n > 1)  # counted once each: not per id
            if repeated:
                raise ConfigError(f"{source}: {key} {list(layers)}: {repeated} given more than once")


_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(ModelArgs)}  # field -> its annotation

_NO_VISION: dict[str, Any] = {
    "vision_n_layers": 0,
    "vision_dim": 0,
    "vision_n_heads": 0,
    "vision_inter_dim": 0,
    "vision_patch_size": 0,
    "vision_rope_theta": 0.0,
    "vision_downsample_ratio": 0,
    "vision_max_n_token": 0,
    "vision_min_pixels": 0,
    "vision_max_wh_ratio": None,
}


def _object_or_none(data: dict[str, Any], key: str, source: str) -> dict[str, Any] | None:
    """data[key] where it is a JSON object, None where it is absent or null; a ConfigError otherwise."""
    value = data.get(key)
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{source}: {key} must be a JSON object, found {value!r}")
    return value


# keys a newer transformers writes in place of ones this format has: what to write back
RENAMED = {"rope_parameters": "transformers 5's form of rope_scaling and rope_theta: write them back as a YaRN "
           "rope_scaling object and rope_theta, as the published config has them"}  # fmt: skip


def _check_keys(data: dict[str, Any], fixed: dict[str, Any], mapped: dict[str, str], where: str) -> None:
    unknown = sorted(set(data) - set(fixed) - set(mapped))
    renamed = [f"{key}: {RENAMED[key]}" for key in unknown if key in RENAMED]
    if renamed:
        raise ConfigError(f"{where}: " + "; ".join(renamed))
    if unknown:
        raise ConfigError(
            f"{where}: unknown keys {unknown}: a key this tool does not know may change what the weights mean, so "
            "the config is refused (where a framework added it for its own use, remove it; where the published "
            "format gained it, this version predates it)"
        )
    for key, expected in fixed.items():
        allowed = expected if isinstance(expected, tuple) else (expected,)  # a tuple: any of these
        if expected is not None and key in data and data[key] not in allowed:
            raise ConfigError(f"{where}: {key} = {data[key]!r}, this model supports only {allowed[0]!r}")


# fields the model divides by or sizes tensors with: 0 or less is no model
POSITIVE_FIELDS = (
    "vocab_size",
    "dim",
    "moe_inter_dim",
    "n_layers",
    "n_heads",
    "n_routed_experts",
    "n_activated_experts",
    "q_lora_rank",
    "head_dim",
    "rope_head_dim",
    "o_groups",
    "o_lora_rank",
    "window_size",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "hc_mult",
    "n_shared_experts",
)
# sizes of a part of the model, positive where the part is there (its key in the config is non-zero)
PART_SIZES: dict[str, tuple[str, ...]] = {
    "vision_n_layers": (
        "vision_dim",
        "vision_n_heads",
        "vision_inter_dim",
        "vision_patch_size",
        "vision_downsample_ratio",
        "vision_max_n_token",  # 0: an image prompt was "math domain error", named by the image (an audit)
    ),
    "engram_layer_ids": ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"),
    "n_mtp_layers": ("dspark_markov_rank", "dspark_block_size"),
}
# ModelArgs field -> its key in the HF config.json, for messages
HF_NAMES: dict[str, str] = {
    **{arg: f"text_config.{key}" for key, arg in HF_TO_ARGS.items()},
    **{arg: f"text_config.rope_scaling.{key}" for key, arg in HF_ROPE_TO_ARGS.items()},
    **{arg: f"vision_config.{key}" for key, arg in HF_VISION_TO_ARGS.items()},
}
_SCALARS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _fits(annotation: str, value: Any) -> bool:
    """Whether `value` (as JSON gives it) fits a ModelArgs annotation: int, float, str, bool, `X | None` or
    tuple[int, ...] (a JSON list); a bool is no number."""
    if annotation.endswith(" | None"):
        return value is None or _fits(annotation.removesuffix(" | None"), value)
    if annotation == "tuple[int, ...]":
        return isinstance(value, (list, tuple)) and all(_fits("int", v) for v in value)
    if isinstance(value, bool) and annotation != "bool":
        return False
    return isinstance(value, _SCALARS[annotation])


INT64_MAX = 2**63 - 1  # the largest size or position a tensor can have (torch's and safetensors' int64/u64)


def _past_int64(value: Any) -> bool:
    """Whether `value` is an int (a bool is none) whose magnitude no tensor size or position reaches."""
    return type(value) is int and abs(value) > INT64_MAX


def check_values(values: dict[str, Any], source: str, names: dict[str, str]) -> None:
    """ConfigError naming the first ModelArgs value of the wrong JSON type, or a size that is not positive.

    values: ModelArgs field -> value; names: field -> the key as the file spells it (else the field)."""
    for name, value in values.items():
        if name in _FIELD_TYPES and not _fits(_FIELD_TYPES[name], value):
            raise ConfigError(
                f"{source}: {names.get(name, name)} = {value!r} ({type(value).__name__}), expected {_FIELD_TYPES[name]}"
            )
        # an int past any tensor's size (JSON allows 10**400) was a traceback (OverflowError) where plan's memory
        # figures or the catalogue's init scales turned it into a float (an audit)
        big = next((v for v in (value if isinstance(value, (list, tuple)) else (value,)) if _past_int64(v)), None)
        if big is not None:
            raise ConfigError(
                f"{source}: {names.get(name, name)} holds a {len(str(abs(big)))}-digit number, expected at most "
                f"2**63 - 1 ({INT64_MAX})"
            )
    for name in POSITIVE_FIELDS:
        if name in values and values[name] <= 0:
            raise ConfigError(f"{source}: {names.get(name, name)} = {values[name]!r}, expected a positive number")
    for part, sizes in PART_SIZES.items():  # a zero crashed the catalogue or the model with a traceback (an audit)
        for name in sizes if values.get(part) else ():
            if name in values and values[name] <= 0:
                raise ConfigError(
                    f"{source}: {names.get(name, name)} = {values[name]!r}, expected a positive number "
                    f"({names.get(part, part)} = {values[part]!r})"
                )
    _check_runtime_values(values, source, names)
    if values.get("engram_layer_ids") and values.get("engram_max_ngram_size", 2) < 2:
        name = names.get("engram_max_ngram_size", "engram_max_ngram_size")
        raise ConfigError(f"{source}: {name} = {values['engram_max_ngram_size']!r}, expected 2 or more (n-grams)")
    layer, n_layers = values.get("candidate_source_layer", -1), values.get("n_layers", 0)
    block = values.get("candidate_block_size", 1)
    if layer >= 0 and block <= 0:  # read only where a layer publishes candidates (a negative one: none)
        name = names.get("candidate_block_size", "candidate_block_size")
        raise ConfigError(f"{source}: {name} = {block!r}, expected a positive number (a candidate source layer is set)")
    if layer >= n_layers > 0:
        name = names.get("candidate_source_layer", "candidate_source_layer")
        raise ConfigError(
            f"{source}: {name} = {layer!r}: not a backbone layer (0..{n_layers - 1}), or negative for none"
        )


SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")  # the gate's scores (model/moe.py Gate)
# fields the model divides by or takes a logarithm of (YaRN's betas: log(seq_len / (beta * 2 pi)))
POSITIVE_FLOATS = ("rope_factor", "beta_fast", "beta_slow")
THETAS = ("rope_theta", "compress_rope_theta")  # rope bases: the model divides by log(theta)
# the vision tower's floats that must be positive where it is there: its rope base (1 / theta**x: NaN angles for
# 0 or less) and the cap on an image's width/height ratio (None: no cap; 0 or less cut every image to width 0)
VISION_POSITIVE = ("vision_rope_theta", "vision_max_wh_ratio")
# the shortest image span, START, one IMAGE, its NEWLINE and END (model/image_processor.py num_image_tokens(1, 1)):
# a smaller vision_max_n_token fits no image (an image prompt ended in "math domain error" or, at 2 and 3, a grid
# of 0 rows and a RuntimeError traceback in reference-logits and verify: an audit)
MIN_IMAGE_SPAN = 4
# floats where 0 means "off" or "none" and a negative value is no setting (swiglu_limit: no clamp)
NON_NEGATIVE = ("norm_eps", "hc_eps", "swiglu_limit", "original_seq_len")
# the most Sinkhorn rounds a hyper-connection runs per token and layer (the published model: 20, converged long
# before): 10**9 was accepted, and reference-logits and verify then looped until killed (an audit)
MAX_SINKHORN_ITERS = 1000


def _one_context(stated: Any, yarn: int | None, source: str) -> None:
    """ConfigError where text_config.max_position_embeddings (`stated`) is a number other than the YaRN context
    (`yarn`: rope_scaling factor x original_max_position_embeddings, ModelArgs.max_positions), the positions the
    model and upstream use: a config that says it two ways (1024 against 4 x 64) was accepted and the first
    ignored, and runs were bounded by a figure the refusal called its max_position_embeddings (an audit)."""
    if yarn is None or stated is None or isinstance(stated, bool) or not isinstance(stated, int | float):
        return
    if stated != yarn:
        raise ConfigError(
            f"{source}: text_config.max_position_embeddings {stated:,}, but rope_scaling factor x "
            f"original_max_position_embeddings gives {yarn:,} positions: the model's context said two ways (the "
            "published config has them equal: 16 x 65,536 = 1,048,576)"
        )


def _check_runtime_values(values: dict[str, Any], source: str, names: dict[str, str]) -> None:
    """ConfigError naming a value that loads but that the model cannot run with: a float that is not finite
    (json reads NaN and Infinity; written back, strict parsers refuse them), a theta or factor not positive
    (the vision tower's rope base and width/height cap too), an unknown score function, a noise token outside
    the vocabulary, the DSpark stages' layers and the candidate blocks where those parts are there. An audit
    found each of these accepted by plan and shard, then ending verify and reference-logits in a traceback (or
    a division by zero in the catalogue)."""

    def name(field_name: str) -> str:
        return names.get(field_name, field_name)

    for key, value in values.items():
        if "float" in _FIELD_TYPES.get(key, "") and isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: {name(key)} = {value!r}, expected a finite number")
    for key in POSITIVE_FLOATS:
        if key in values and values[key] <= 0:
            raise ConfigError(f"{source}: {name(key)} = {values[key]!r}, expected a positive number")
    for key in VISION_POSITIVE if values.get("vision_n_layers") else ():
        if values.get(key) is not None and values[key] <= 0:
            raise ConfigError(f"{source}: {name(key)} = {values[key]!r}, expected a positive number")
    if values.get("vision_n_layers") and 0 < values.get("vision_max_n_token", MIN_IMAGE_SPAN) < MIN_IMAGE_SPAN:
        raise ConfigError(
            f"{source}: {name('vision_max_n_token')} = {values['vision_max_n_token']!r}, expected {MIN_IMAGE_SPAN} or "
            "more (the shortest image span: START, one image token, its row's NEWLINE, END)"
        )
    for key in THETAS:
        if key in values and values[key] <= 1:
            raise ConfigError(f"{source}: {name(key)} = {values[key]!r}, expected more than 1 (a rope base)")
    for key in NON_NEGATIVE:
        if key in values and values[key] < 0:
            raise ConfigError(f"{source}: {name(key)} = {values[key]!r}, expected 0 or more")
    if values.get("n_shared_experts", 1) != 1:  # model/moe.py builds one shared expert per MoE, as upstream's asserts
        raise ConfigError(
            f"{source}: {name('n_shared_experts')} = {values['n_shared_experts']!r}, this model supports only 1 (one "
            "shared expert per MoE layer, moe_intermediate_size wide)"
        )
    if "score_func" in values and values["score_func"] not in SCORE_FUNCS:
        raise ConfigError(f"{source}: {name('score_func')} = {values['score_func']!r}, expected one of {SCORE_FUNCS}")
    if not 1 <= values.get("hc_sinkhorn_iters", 1) <= MAX_SINKHORN_ITERS:
        raise ConfigError(
            f"{source}: {name('hc_sinkhorn_iters')} = {values['hc_sinkhorn_iters']!r}, expected 1 to "
            f"{MAX_SINKHORN_ITERS:,} (the published: 20)"
        )
    vocab = values.get("vocab_size", 0)
    noise = values.get("dspark_noise_token_id", 0)
    if values.get("n_mtp_layers") and vocab > 0 and not 0 <= noise < vocab:  # the drafts' embedding row
        raise ConfigError(
            f"{source}: {name('dspark_noise_token_id')} = {noise!r}, not a token id (0..{vocab - 1}, "
            f"{name('vocab_size')})"
        )
    pad = values.get("engram_pad_id", 0)
    if values.get("engram_layer_ids") and vocab > 0 and not 0 <= pad < vocab:  # read before the sequence
        raise ConfigError(
            f"{source}: {name('engram_pad_id')} = {pad!r}, not a token id (0..{vocab - 1}, {name('vocab_size')})"
        )
    if values.get("n_mtp_layers") and "dspark_target_layer_ids" in values and not values["dspark_target_layer_ids"]:
        raise ConfigError(
            f"{source}: {name('dspark_target_layer_ids')} is empty: the DSpark stages read the hidden states of "
            f"these layers ({name('n_mtp_layers')} = {values['n_mtp_layers']!r})"
        )
    if values.get("candidate_source_layer", -1) >= 0 and values.get("candidate_topk_blocks", 1) <= 0:
        raise ConfigError(
            f"{source}: {name('candidate_topk_blocks')} = {values['candidate_topk_blocks']!r}, expected a positive "
            "number (a candidate source layer is set)"
        )


def load_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from a file, naming it in the error. A FIFO, socket or device there is refused
    before it is opened: reading one blocked verify and reference-logits until they were killed (an audit).
    A key given twice in one object (a hand-edited config.json, an index naming a tensor twice) is refused:
    json and every reader built on it keep the last value without a word."""
    refuse_non_file(path, ConfigError)
    try:
        data = strict_json.loads(Path(path).read_text(encoding="utf-8"))
    except strict_json.RepeatedKey as exc:
        raise ConfigError(f"{path}: gives {exc.args[0]!r} twice in one object; keep the one you mean") from None
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: not found") from exc
    except NotADirectoryError as exc:  # the folder it should be in is a file
        folder = Path(path).parent
        raise ConfigError(f"{folder}: not a folder (a checkpoint is a folder with {Path(path).name})") from exc
    except NOT_JSON as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a JSON object expected, found a {type(data).__name__}")
    return data


def load_model_args(path: Path) -> ModelArgs:
    """ModelArgs from either config file: the nested HF config.json (has `text_config`) or the
    inference config (flat ModelArgs names)."""
    return model_args_of(load_json(path), path)


def model_args_of(data: dict[str, Any], path: Path) -> ModelArgs:
    """ModelArgs from a config file's parsed object `data` (either form, as load_model_args), `path` naming the
    file in errors."""
    if is_hf_config(data):
        return ModelArgs.from_hf_dict(data, str(path))
    return ModelArgs.from_inference_dict(data, str(path))


def is_hf_config(data: dict[str, Any]) -> bool:
    """Whether a config file's object is the nested Hugging Face config.json (its keys: HF_NAMES of the
    ModelArgs fields), not the inference config beside rank files (its keys: the field names)."""
    return bool({"text_config", "architectures", "model_type"} & set(data))
