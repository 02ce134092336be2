"""Tiny random V4.1 models for the model tests: config, weights in the shards' format, tp sharding.

`shard_state_dict` applies upstream convert.py's split rules to a tp=1 state dict; it exists so
the model tests need neither the synthetic-checkpoint generator nor the converter.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv41_convert.config import ModelArgs
from dsv41_convert.model import Transformer
from dsv41_convert.model.attention import Attention
from dsv41_convert.model.head import ParallelHead
from dsv41_convert.model.layers import Linear, dense_dtype
from dsv41_convert.model.load import expected_tensors
from dsv41_convert.quant.fp4 import encode_mxfp4
from dsv41_convert.quant.fp8 import encode_fp8_blocks

# Six layers, one of each attention block type:
# 0 window only | 1 kv+index source, ratio 2 | 2 ratio-2 consumer | 3 kv+index+candidate source,
# ratio 1 | 4 ratio-1 consumer | 5 index source that uses the candidates
TINY = dict(
    vocab_size=256,
    dim=64,
    moe_inter_dim=64,
    n_layers=6,
    n_mtp_layers=0,
    n_heads=8,
    n_routed_experts=8,
    n_shared_experts=1,
    n_activated_experts=2,
    score_func="sqrtsoftplus",
    route_scale=1.5,
    swiglu_limit=10.0,
    q_lora_rank=64,
    head_dim=64,
    rope_head_dim=16,
    norm_eps=1e-20,
    o_groups=8,
    o_lora_rank=32,
    window_size=8,
    compress_ratios=(0, 2, 2, 1, 1, 1),
    kv_source_layers=(1, 3),
    index_source_layers=(1, 3, 5),
    compress_rope_theta=40000.0,
    original_seq_len=32,
    rope_theta=10000.0,
    rope_factor=4.0,
    beta_fast=32,
    beta_slow=1,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=8,
    candidate_source_layer=3,
    candidate_topk_blocks=3,
    candidate_block_size=4,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    engram_layer_ids=(),
    engram_num_embeddings=(),
    engram_max_ngram_size=0,
    engram_vocab_size=0,
    engram_n_heads=0,
    engram_head_dim=0,
    engram_pad_id=2,
    engram_compressed_vocab_size=0,
    dspark_block_size=0,
    dspark_noise_token_id=0,
    dspark_target_layer_ids=(),
    dspark_markov_rank=0,
    dspark_n_routed_experts=0,
    dspark_n_activated_experts=0,
    vision_n_layers=0,
    vision_dim=0,
    vision_n_heads=0,
    vision_inter_dim=0,
    vision_patch_size=0,
    vision_rope_theta=0.0,
    vision_downsample_ratio=0,
    vision_max_n_token=0,
    vision_min_pixels=0,
    vision_max_wh_ratio=None,
    image_token_id=255,
    dtype="fp8",
    expert_dtype="fp4",
    max_batch_size=2,
    max_seq_len=64,
    temperature=0.0,
)


def tiny_args(**overrides) -> ModelArgs:
    args = ModelArgs(**{**TINY, **overrides})
    args.validate("tiny test config")
    return args


# Mean of each norm weight and gain of each projection (times fan_in^-0.5), chosen near the
# released checkpoint's statistics: unit norms everywhere make the MoE output swamp the small
# residual and make the stack far more sensitive than the real model.
NORM_MEAN = {"attn_norm": 0.03, "ffn_norm": 0.2, "q_norm": 1.0, "kv_norm": 0.4, "k_norm": 0.5, "norm": 0.6}
GAIN = {"wq_a": 1.6, "wq_b": 1.0, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5, "w2": 1.0}
EMBED_STD = 0.12


def _file_dtype(p: torch.Tensor, owner: torch.nn.Module) -> torch.dtype:
    """The shards keep fp32 Linear/head weights in bf16 (the model widens them on load)."""
    if p.dtype == torch.float32 and isinstance(owner, Linear | ParallelHead):
        return torch.bfloat16
    return p.dtype


def random_state_dict(args: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tp=1 state dict in the shards' dtypes: fp8 + 32x32 e8m0 scales, MXFP4 experts, bf16/fp32 rest."""
    gen = torch.Generator().manual_seed(seed)
    model = Transformer(args)
    out: dict[str, torch.Tensor] = {}
    for name, (p, owner) in expected_tensors(model).items():
        if name in out:
            continue
        owner_name, _, leaf = name.rpartition(".")
        short = owner_name.rsplit(".", 1)[-1]
        shape = tuple(p.shape)
        if p.dtype == torch.float8_e8m0fnu:
            continue  # written with its weight
        if p.dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
            fan_in = shape[1] * (2 if p.dtype == torch.float4_e2m1fn_x2 else 1)
            w = torch.randn(shape[0], fan_in, generator=gen) * fan_in**-0.5 * GAIN.get(short, 1.0)
            q, s = encode_fp8_blocks(w) if p.dtype == torch.float8_e4m3fn else encode_mxfp4(w)
            out[name], out[f"{owner_name}.scale"] = q, s
            continue
        if leaf == "weight" and "norm" in short:
            mean = NORM_MEAN.get(short, 1.0)
            v = mean * (1 + 0.1 * torch.randn(shape, generator=gen))
        elif owner_name == "embed":
            v = torch.randn(shape, generator=gen) * EMBED_STD
        elif len(shape) == 2:
            v = torch.randn(shape, generator=gen) * shape[1] ** -0.5 * GAIN.get(short, 1.0)
        else:
            v = 0.5 * torch.randn(shape, generator=gen)
        out[name] = v.to(_file_dtype(p, owner)).contiguous()
    return out


_DIM0 = re.compile(
    r"(embed\.weight|head\.weight|.*\.wq_b\.(weight|scale)|.*\.wo_a\.weight|.*\.attn_sink"
    r"|.*\.weights_proj\.weight|.*markov_head\.(embed|head)\.weight)"
)
_DIM1 = re.compile(r".*\.wo_b\.(weight|scale)")
_EXPERT = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.(\d+)\..*")


def shard_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs, world: int) -> list[dict[str, torch.Tensor]]:
    """Split a tp=1 state dict into `world` per-rank dicts by upstream convert.py's rules."""
    per_rank = args.n_routed_experts // world
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name, t in sd.items():
        if m := _EXPERT.fullmatch(name):
            ranks[int(m.group(2)) // per_rank][name] = t
            continue
        dim = 0 if _DIM0.fullmatch(name) else 1 if _DIM1.fullmatch(name) else None
        for r in range(world):
            ranks[r][name] = t if dim is None else t.chunk(world, dim=dim)[r].contiguous()
    return ranks


def write_shards(sd: dict[str, torch.Tensor], args: ModelArgs, folder: Path, world: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for r, part in enumerate(shard_state_dict(sd, args, world)):
        save_file(part, str(folder / f"model{r}-mp{world}.safetensors"))


def with_runtime(args: ModelArgs, **kw) -> ModelArgs:
    return dataclasses.replace(args, **kw)


def random_attention(
    args: ModelArgs, layer_id: int, seed: int, norm_weights: dict[str, float] | None = None
) -> Attention:
    """Attention(layer_id) with random weights for the formula tests: matrices N(0, 1/in), norm weights
    1 + 0.1 N(0, 1) (or, for a name in `norm_weights`, that value + 0.1 U(0, 1): far from 1, so that a dropped
    norm shows), the sinks spread over -1 .. 3 (some heads lean hard on the sink)."""
    with dense_dtype(args):
        attn = Attention(layer_id, args)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name == "attn_sink":
                p.copy_(torch.linspace(-1.0, 3.0, p.numel()))
            elif name in (norm_weights or {}):
                p.copy_(norm_weights[name] + 0.1 * torch.rand(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return attn
