"""Size presets for synthetic checkpoints, and the nested HF config.json built from one.

A preset is a frozen record of model sizes. `hf_config` turns it into a config.json with the
published key names and order; two values depend on the written files and are passed in: the
compressed token-map size of the tokenizer (engram_compressed_vocab_size) and whether the
checkpoint is quantized (quantization_config present or not).

`tiny` covers every block type of the real model at a few MB:
    layer 0  ratio 0  window only, Engram
    layer 1  ratio 2  KV + index source, Engram (like the real layer 14)
    layer 2  ratio 2  consumer of layer 1
    layer 3  ratio 1  candidate source (KV + index source)
    layer 4  ratio 1  consumer of layer 3
    layer 5  ratio 1  index source that reads the candidates of layer 3
    mtp 0..2 ratio 0  DSpark stages targeting layers 3, 4, 5
Every tensor-parallel split (dim 0, dim 1, experts) divides by 8 at 32-block granularity.

`medium` keeps the real hidden sizes (dim 5120, 64 x 512 heads, q/o ranks 1280/1024, index heads
32 x 128) with the same 6-layer schedule and few experts: GBs, for GPU tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv41_convert.config import HF_QUANTIZATION_CONFIG
from dsv41_convert.engram_buckets import engram_table_rows

BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


@dataclass(frozen=True)
class Preset:
    """Model sizes of one synthetic checkpoint (inference names, see ModelArgs)."""

    name: str
    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    n_routed_experts: int
    n_activated_experts: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    window_size: int
    candidate_topk_blocks: int
    candidate_block_size: int
    original_seq_len: int
    rope_factor: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    vision_n_layers: int
    vision_dim: int
    vision_n_heads: int
    vision_inter_dim: int
    vision_max_n_token: int
    vision_min_pixels: int
    # the layer schedule (see the module docstring), shared by both presets
    compress_ratios: tuple[int, ...] = (0, 2, 2, 1, 1, 1, 0, 0, 0)
    n_layers: int = 6
    n_mtp_layers: int = 3
    kv_source_layers: tuple[int, ...] = (1, 3)
    index_source_layers: tuple[int, ...] = (1, 3, 5)
    candidate_source_layer: int = 3
    engram_layer_ids: tuple[int, ...] = (0, 1)
    dspark_target_layer_ids: tuple[int, ...] = (3, 4, 5)

    @property
    def image_token_id(self) -> int:
        return self.vocab_size - 2

    @property
    def dspark_noise_token_id(self) -> int:
        return self.vocab_size - 1


TINY = Preset(
    name="tiny",
    vocab_size=512,
    dim=256,
    moe_inter_dim=64,
    n_heads=8,
    head_dim=64,
    rope_head_dim=16,
    q_lora_rank=64,
    o_lora_rank=32,
    o_groups=8,
    n_routed_experts=16,
    n_activated_experts=2,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=8,
    window_size=16,
    candidate_topk_blocks=4,
    candidate_block_size=4,
    original_seq_len=64,  # below a test's max_seq_len, so YaRN is active on compressed layers
    rope_factor=4,
    engram_vocab_size=1000,
    engram_n_heads=4,
    engram_head_dim=32,
    dspark_markov_rank=32,
    dspark_n_routed_experts=8,
    dspark_n_activated_experts=2,
    vision_n_layers=2,
    vision_dim=64,
    vision_n_heads=2,
    vision_inter_dim=128,
    vision_max_n_token=64,
    vision_min_pixels=126 * 126,
)

MEDIUM = Preset(
    name="medium",
    vocab_size=16384,
    dim=5120,
    moe_inter_dim=2304,
    n_heads=64,
    head_dim=512,
    rope_head_dim=64,
    q_lora_rank=1280,
    o_lora_rank=1024,
    o_groups=8,
    n_routed_experts=16,
    n_activated_experts=6,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=64,
    window_size=128,
    candidate_topk_blocks=16,
    candidate_block_size=8,
    original_seq_len=65536,
    rope_factor=16,
    engram_vocab_size=20000,
    engram_n_heads=8,
    engram_head_dim=256,
    dspark_markov_rank=256,
    dspark_n_routed_experts=8,
    dspark_n_activated_experts=3,
    vision_n_layers=2,
    vision_dim=1024,
    vision_n_heads=16,
    vision_inter_dim=2816,
    vision_max_n_token=1024,
    vision_min_pixels=295936,
)

PRESETS: dict[str, Preset] = {"tiny": TINY, "medium": MEDIUM}

QUANTIZATION_CONFIG = HF_QUANTIZATION_CONFIG  # the published one


def hf_config(p: Preset, *, compressed_vocab_size: int, quantized: bool = True, vision: bool = True) -> dict[str, Any]:
    """The nested config.json of a preset, keys and order as published.

    compressed_vocab_size: size of the tokenizer's compressed token map (see synth.tokenizer).
    quantized:             False leaves out quantization_config (an unquantized bf16 source).
    vision:                False leaves out vision_config (the model then has no vision path).
    """
    engram_rows = engram_table_rows(len(p.engram_layer_ids), 4, p.engram_n_heads, p.engram_vocab_size)
    text = {
        "model_type": "deepseek_v41_text",
        "vocab_size": p.vocab_size,
        "hidden_size": p.dim,
        "moe_intermediate_size": p.moe_inter_dim,
        "num_hidden_layers": p.n_layers,
        "num_attention_heads": p.n_heads,
        "num_key_value_heads": 1,
        "head_dim": p.head_dim,
        "qk_rope_head_dim": p.rope_head_dim,
        "q_lora_rank": p.q_lora_rank,
        "o_lora_rank": p.o_lora_rank,
        "o_groups": p.o_groups,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "tie_word_embeddings": False,
        "max_position_embeddings": p.original_seq_len * p.rope_factor,
        "rope_theta": 10000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": p.rope_factor,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": p.original_seq_len,
        },
        "n_routed_experts": p.n_routed_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": p.n_activated_experts,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": p.window_size,
        "compress_ratios": list(p.compress_ratios),
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": list(p.kv_source_layers),
        "index_source_layer_ids": list(p.index_source_layers),
        "index_n_heads": p.index_n_heads,
        "index_head_dim": p.index_head_dim,
        "index_topk": p.index_topk,
        "candidate_source_layer_id": p.candidate_source_layer,
        "candidate_topk_blocks": p.candidate_topk_blocks,
        "candidate_block_size": p.candidate_block_size,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "engram_layer_ids": list(p.engram_layer_ids),
        "engram_num_embeddings": list(engram_rows),
        "engram_max_ngram_size": 4,
        "engram_vocab_size": p.engram_vocab_size,
        "engram_n_heads": p.engram_n_heads,
        "engram_head_dim": p.engram_head_dim,
        "engram_pad_token_id": PAD_ID,
        "engram_compressed_vocab_size": compressed_vocab_size,
        "num_nextn_predict_layers": p.n_mtp_layers,
        "dspark_block_size": 5,
        "dspark_noise_token_id": p.dspark_noise_token_id,
        "dspark_target_layer_ids": list(p.dspark_target_layer_ids),
        "dspark_markov_rank": p.dspark_markov_rank,
        "dspark_n_routed_experts": p.dspark_n_routed_experts,
        "dspark_num_experts_per_tok": p.dspark_n_activated_experts,
    }
    config: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "transformers_version": "5.6.0",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "image_token_id": p.image_token_id,
    }
    if quantized:
        config["quantization_config"] = dict(QUANTIZATION_CONFIG, weight_block_size=[32, 32])
    config["text_config"] = text
    if vision:
        config["vision_config"] = {
            "model_type": "deepseek_v41_vision",
            "num_hidden_layers": p.vision_n_layers,
            "hidden_size": p.vision_dim,
            "num_attention_heads": p.vision_n_heads,
            "intermediate_size": p.vision_inter_dim,
            "patch_size": 14,
            "rope_theta": 10000,
            "downsample_ratio": 3,
            "max_image_tokens": p.vision_max_n_token,
            "min_pixels": p.vision_min_pixels,
            "max_wh_ratio": None,
        }
    return config
