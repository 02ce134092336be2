"""The tensors a config implies: every name of the published (fp8/fp4) checkpoint with its dtype and shape.

This is the checkpoint as Hugging Face stores it (full, unsharded shapes), derived from ModelArgs the
way upstream model.py sizes its modules. `plan` checks a source against it; a bf16/fp32 source is the
same list without scales, with float dtypes and logical shapes (experts [out, in], not [out, in/2]).
"""

from __future__ import annotations

from dsv41_convert.config import ModelArgs

Layout = dict[str, tuple[str, tuple[int, ...]]]  # name -> (published dtype, shape)

FP8_BLOCK = 32


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _fp8(out: Layout, name: str, n_out: int, n_in: int) -> None:
    out[f"{name}.weight"] = ("F8_E4M3", (n_out, n_in))
    out[f"{name}.scale"] = ("F8_E8M0", (_ceil(n_out, FP8_BLOCK), _ceil(n_in, FP8_BLOCK)))


def _bf16(out: Layout, name: str, *shape: int) -> None:
    out[name] = ("BF16", tuple(shape))


def _f32(out: Layout, name: str, *shape: int) -> None:
    out[name] = ("F32", tuple(shape))


def published_layout(a: ModelArgs) -> Layout:
    """name -> (dtype, shape) for every tensor of the published checkpoint with config `a`.

    mtp.K.embed / head are not listed: the published checkpoint does not carry them (they are tied to
    the backbone and dropped if present).
    """
    out: Layout = {}
    _bf16(out, "embed.weight", a.vocab_size, a.dim)
    _bf16(out, "head.weight", a.vocab_size, a.dim)
    _bf16(out, "norm.weight", a.dim)
    n_mtp = a.n_mtp_layers if a.dspark_block_size else 0  # as upstream: no DSpark, no mtp stages
    for layer_id in range(a.n_layers + n_mtp):
        _block(out, a, layer_id)
    if a.vision_enabled:
        _vision(out, a)
    return out


def _block(out: Layout, a: ModelArgs, layer_id: int) -> None:
    is_mtp = layer_id >= a.n_layers
    p = f"mtp.{layer_id - a.n_layers}." if is_mtp else f"layers.{layer_id}."
    # attention
    _f32(out, p + "attn.attn_sink", a.n_heads)
    _fp8(out, p + "attn.wq_a", a.q_lora_rank, a.dim)
    _bf16(out, p + "attn.q_norm.weight", a.q_lora_rank)
    _fp8(out, p + "attn.wq_b", a.n_heads * a.head_dim, a.q_lora_rank)
    _fp8(out, p + "attn.wkv", a.head_dim, a.dim)
    _bf16(out, p + "attn.kv_norm.weight", a.head_dim)
    _fp8(out, p + "attn.wo_a", a.o_groups * a.o_lora_rank, a.n_heads * a.head_dim // a.o_groups)
    _fp8(out, p + "attn.wo_b", a.dim, a.o_groups * a.o_lora_rank)
    if not is_mtp and layer_id in a.kv_source_layers:
        _bf16(out, p + "attn.compressor.norm.weight", a.head_dim)
        _bf16(out, p + "attn.compressor.wkv.weight", a.head_dim, a.dim)
        if a.compress_ratios[layer_id] > 1:
            _bf16(out, p + "attn.compressor.wgate.weight", a.head_dim, a.dim)
    if not is_mtp and layer_id in a.index_source_layers:
        _fp8(out, p + "attn.indexer.wq_b", a.index_n_heads * a.index_head_dim, a.q_lora_rank)
        _bf16(out, p + "attn.indexer.weights_proj.weight", a.index_n_heads, a.dim)
        if layer_id in a.kv_source_layers:
            _bf16(out, p + "attn.indexer.wk.weight", a.index_head_dim, a.head_dim)
            _bf16(out, p + "attn.indexer.k_norm.weight", a.index_head_dim)
    # MoE
    n_experts, _ = a.moe_config(layer_id)
    _bf16(out, p + "ffn.gate.weight", n_experts, a.dim)
    _f32(out, p + "ffn.gate.bias", n_experts)
    if a.vision_enabled:
        _f32(out, p + "ffn.gate.bias_vl", n_experts)
    for e in range(n_experts):
        for w, (n_out, n_in) in _expert_shapes(a).items():
            out[f"{p}ffn.experts.{e}.{w}.weight"] = ("I8", (n_out, n_in // 2))
            out[f"{p}ffn.experts.{e}.{w}.scale"] = ("F8_E8M0", (n_out, _ceil(n_in, 32)))
    for w, (n_out, n_in) in _expert_shapes(a).items():
        _fp8(out, f"{p}ffn.shared_experts.{w}", n_out * a.n_shared_experts, n_in)
    # Engram
    if not is_mtp and layer_id in a.engram_layer_ids:
        rows = a.engram_num_embeddings[a.engram_layer_ids.index(layer_id)]
        out[p + "engram.embed.weight"] = ("F8_E4M3", (rows, a.engram_head_dim))
        out[p + "engram.embed.scale"] = ("F8_E8M0", (rows, _ceil(a.engram_head_dim, 32)))
        n_cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads
        _fp8(out, p + "engram.wkv", a.dim * (a.hc_mult + 1), n_cols * a.engram_head_dim)
        _bf16(out, p + "engram.q_weight", a.hc_mult, a.dim)
        _bf16(out, p + "engram.k_weight", a.hc_mult, a.dim)
    # norms and hyper-connections
    _bf16(out, p + "attn_norm.weight", a.dim)
    _bf16(out, p + "ffn_norm.weight", a.dim)
    mix = (2 + a.hc_mult) * a.hc_mult
    for site in ("attn", "ffn"):
        _f32(out, f"{p}hc_{site}_fn", mix, a.hc_mult * a.dim)
        _f32(out, f"{p}hc_{site}_base", mix)
        _f32(out, f"{p}hc_{site}_scale", 3)
    # DSpark stages
    stage = layer_id - a.n_layers
    if is_mtp and stage == 0:
        _fp8(out, p + "main_proj", a.dim, a.dim * len(a.dspark_target_layer_ids))
        _bf16(out, p + "main_norm.weight", a.dim)
    if is_mtp and stage == a.n_mtp_layers - 1:
        _bf16(out, p + "norm.weight", a.dim)
        _bf16(out, p + "markov_head.embed.weight", a.vocab_size, a.dspark_markov_rank)
        _bf16(out, p + "markov_head.head.weight", a.vocab_size, a.dspark_markov_rank)
        _bf16(out, p + "confidence_head.proj.weight", 1, a.dim + a.dspark_markov_rank)


def _expert_shapes(a: ModelArgs) -> dict[str, tuple[int, int]]:
    """w1/w3: dim -> moe_inter_dim, w2: moe_inter_dim -> dim, as [out, in]."""
    return {"w1": (a.moe_inter_dim, a.dim), "w2": (a.dim, a.moe_inter_dim), "w3": (a.moe_inter_dim, a.dim)}


def _vision(out: Layout, a: ModelArgs) -> None:
    vd = a.vision_dim
    _bf16(out, "vision.patch_embed.proj.weight", vd, 3 * a.vision_patch_size**2)
    _bf16(out, "vision.patch_embed.proj.bias", vd)
    for i in range(a.vision_n_layers):
        p = f"vision.blocks.{i}."
        _bf16(out, p + "attn.wqkv.weight", 3 * vd, vd)
        _bf16(out, p + "attn.wqkv.bias", 3 * vd)
        _bf16(out, p + "attn.wo.weight", vd, vd)
        _bf16(out, p + "attn.wo.bias", vd)
        _bf16(out, p + "mlp.w1.weight", 2 * a.vision_inter_dim, vd)
        _bf16(out, p + "mlp.w2.weight", vd, a.vision_inter_dim)
        _bf16(out, p + "norm1.weight", vd)
        _bf16(out, p + "norm2.weight", vd)
    _bf16(out, "vision.norm.weight", vd)
    _bf16(out, "aligner.w1.weight", a.dim, vd * a.vision_downsample_ratio**2)
    _bf16(out, "aligner.w1.bias", a.dim)
    _bf16(out, "aligner.w2.weight", a.dim, a.dim)
    _bf16(out, "aligner.w2.bias", a.dim)
    for name in ("image_start", "image_end", "image_newline"):
        _bf16(out, name, a.dim)
