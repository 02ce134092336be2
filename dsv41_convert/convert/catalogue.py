"""The tensor catalogue of a DeepSeek V4.1 checkpoint: every parameter a ModelArgs implies, with
its logical shape, its storage format, the shard group it is published in and the statistics
make-tiny draws it with. Sized from ModelArgs the way upstream model.py sizes its modules.

`published_layout` is the same list as the published (fp8/fp4) files hold it: `plan` checks a
source against it, make-tiny writes it.

A `Param` is one logical weight; `file_tensors` expands it into the tensors a file holds:

    fmt       fp8 source (published)                                   bf16 source
    BF16      name BF16 [*shape]                                       same
    F32       name F32 [*shape]                                        same
    FP8       name.weight F8_E4M3 [out, in]                            name.weight BF16 [out, in]
              name.scale  F8_E8M0 [ceil(out/32), ceil(in/32)]
    FP4       name.weight I8 [out, in/2] (packed e2m1, logical [out, in])  name.weight BF16 [out, in]
              name.scale  F8_E8M0 [out, in/32]
      fp8 experts (`export --format fp8`; expert_dtype "fp8"):
              name.weight F8_E4M3 [out, in]
              name.scale  F8_E8M0 [ceil(out/32), ceil(in/32)]
    FP8_ROWS  name.weight F8_E4M3 [rows, dim]                          name.weight BF16 [rows, dim]
              name.scale  F8_E8M0 [rows, dim/32]

For FP8 / FP4 / FP8_ROWS, `Param.name` is the module prefix (`layers.0.attn.wq_a`); for BF16 and
F32 it is the full tensor name. Groups name the published shards: "vision" (vision + aligner),
"embed" (embed, image_*), "layer.{i}" (a backbone layer without Engram), "head" (head, norm),
"mtp.{k}", "engram.{i}" (all of layer i's Engram tensors).
"""

from __future__ import annotations

import enum
import functools
from typing import NamedTuple

from dsv41_convert.config import ModelArgs

BLOCK = 32  # fp8 weight blocks are BLOCK x BLOCK, fp4 and Engram row scales are per BLOCK


class Fmt(enum.Enum):
    BF16 = "bf16"
    F32 = "f32"
    FP8 = "fp8"  # e4m3 weight, e8m0 scale per 32x32 block
    FP4 = "fp4"  # packed e2m1 weight stored as I8, e8m0 scale per 32 along the row
    FP8_ROWS = "fp8_rows"  # e4m3 table, e8m0 scale per 32 along the row


# Init, Param and FileTensor are frozen records as NamedTuples: the real checkpoint's catalogue has 48k
# Params and 96k file tensors, which `plan` builds on every run, and a frozen dataclass costs ~4x more.
class Init(NamedTuple):
    """How random values are drawn: mean + std * N(0, 1); `jitter` multiplies each 32x32 block by
    2**k, k uniform in {-1, 0, 1}, so quantized blocks get different scale exponents."""

    std: float
    mean: float = 0.0
    jitter: bool = False


class Param(NamedTuple):
    name: str
    shape: tuple[int, ...]
    fmt: Fmt
    group: str
    init: Init


class FileTensor(NamedTuple):
    name: str
    dtype: str  # safetensors dtype string: BF16, F32, F8_E4M3, F8_E8M0, I8
    shape: tuple[int, ...]
    param: str  # Param.name it belongs to


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def file_tensors(p: Param, quantized: bool, fp8_experts: bool = False) -> list[FileTensor]:
    """The file tensors of one Param, in the fp8 (published) or bf16 source layout; `fp8_experts`: routed
    experts (FP4 params) as e4m3 with 32x32 scales, as `export --format fp8` writes them."""
    forms = _forms(p.fmt, p.shape, quantized, fp8_experts)
    return [FileTensor(p.name + suffix, dtype, shape, p.name) for suffix, dtype, shape in forms]


@functools.cache
def _forms(fmt: Fmt, shape: tuple[int, ...], quantized: bool, fp8_experts: bool) -> tuple[tuple[str, str, tuple], ...]:
    """(name suffix, dtype, shape) of the file tensors of a Param of format `fmt` and logical `shape`: the
    real catalogue's 48k Params have a few dozen (format, shape)."""
    if fmt is Fmt.BF16:
        return (("", "BF16", shape),)
    if fmt is Fmt.F32:
        return (("", "F32", shape),)
    if not quantized:
        return ((".weight", "BF16", shape),)
    out, inp = shape
    if fmt is Fmt.FP8 or (fmt is Fmt.FP4 and fp8_experts):
        return ((".weight", "F8_E4M3", (out, inp)), (".scale", "F8_E8M0", (_ceil(out, BLOCK), _ceil(inp, BLOCK))))
    if fmt is Fmt.FP4:
        return ((".weight", "I8", (out, inp // 2)), (".scale", "F8_E8M0", (out, inp // BLOCK)))
    return ((".weight", "F8_E4M3", (out, inp)), (".scale", "F8_E8M0", (out, inp // BLOCK)))


# Weight statistics of the released checkpoint (measured on its layers 0, 2 and 20, as reported with
# the upstream test helper): RMSNorm weight means by owner, and projection std as a multiple of
# fan_in**-0.5 by leaf name. Unit norms with plain fan-in scaling make a random stack far more
# sensitive to rounding than the real model: on `tiny`, fp8 and bf16 logits of the upstream model
# correlated 0.73 that way and 0.99 with these values.
NORM_MEAN = {"attn_norm": 0.025, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6, "k_norm": 0.5}
GAIN = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5, "w2": 1.05}
EMBED_STD = 0.12  # RMS of the released embedding rows


def _linear(name: str, out: int, inp: int, fmt: Fmt, group: str) -> Param:
    gain = GAIN.get(name.rsplit(".", 1)[-1], 1.0)
    return Param(name, (out, inp), fmt, group, Init(gain * inp**-0.5, jitter=fmt is not Fmt.BF16))


def _norm(name: str, dim: int, group: str) -> Param:
    owner = name.removesuffix(".weight")
    mean = next((m for key, m in NORM_MEAN.items() if owner == key or owner.endswith("." + key)), 1.0)
    return Param(name, (dim,), Fmt.BF16, group, Init(0.1 * mean, mean))


def _vector(name: str, dim: int, fmt: Fmt, group: str, std: float, mean: float = 0.0) -> Param:
    return Param(name, (dim,), fmt, group, Init(std, mean))


def _attention(a: ModelArgs, pre: str, layer: int, group: str) -> list[Param]:
    backbone = layer < a.n_layers
    nh_hd = a.n_heads * a.head_dim
    out: list[Param] = [
        _vector(f"{pre}.attn.attn_sink", a.n_heads, Fmt.F32, group, std=0.5),
        _linear(f"{pre}.attn.wq_a", a.q_lora_rank, a.dim, Fmt.FP8, group),
        _norm(f"{pre}.attn.q_norm.weight", a.q_lora_rank, group),
        _linear(f"{pre}.attn.wq_b", nh_hd, a.q_lora_rank, Fmt.FP8, group),
        _linear(f"{pre}.attn.wkv", a.head_dim, a.dim, Fmt.FP8, group),
        _norm(f"{pre}.attn.kv_norm.weight", a.head_dim, group),
        _linear(f"{pre}.attn.wo_a", a.o_groups * a.o_lora_rank, nh_hd // a.o_groups, Fmt.FP8, group),
        _linear(f"{pre}.attn.wo_b", a.dim, a.o_groups * a.o_lora_rank, Fmt.FP8, group),
    ]
    if backbone and layer in a.kv_source_layers:
        out.append(_norm(f"{pre}.attn.compressor.norm.weight", a.head_dim, group))
        out.append(Param(f"{pre}.attn.compressor.wkv.weight", (a.head_dim, a.dim), Fmt.BF16, group, Init(a.dim**-0.5)))
        if a.compress_ratios[layer] > 1:
            shape = (a.head_dim, a.dim)
            out.append(Param(f"{pre}.attn.compressor.wgate.weight", shape, Fmt.BF16, group, Init(a.dim**-0.5)))
    if backbone and layer in a.index_source_layers:
        ih = a.index_n_heads
        out.append(_linear(f"{pre}.attn.indexer.wq_b", ih * a.index_head_dim, a.q_lora_rank, Fmt.FP8, group))
        out.append(Param(f"{pre}.attn.indexer.weights_proj.weight", (ih, a.dim), Fmt.BF16, group, Init(a.dim**-0.5)))
        if layer in a.kv_source_layers:
            shape = (a.index_head_dim, a.head_dim)
            out.append(Param(f"{pre}.attn.indexer.wk.weight", shape, Fmt.BF16, group, Init(a.head_dim**-0.5)))
            out.append(_norm(f"{pre}.attn.indexer.k_norm.weight", a.index_head_dim, group))
    return out


def _ffn(a: ModelArgs, pre: str, layer: int, group: str, routed_experts: bool = True) -> list[Param]:
    n_experts, _ = a.moe_config(layer)
    out = [
        Param(f"{pre}.ffn.gate.weight", (n_experts, a.dim), Fmt.BF16, group, Init(GAIN["gate"] * a.dim**-0.5)),
        _vector(f"{pre}.ffn.gate.bias", n_experts, Fmt.F32, group, std=0.01),
    ]
    if a.vision_enabled:
        out.append(_vector(f"{pre}.ffn.gate.bias_vl", n_experts, Fmt.F32, group, std=0.01))
    # _linear once per weight, not once per expert (48k in the real model): every expert is expert 0 renamed
    first = _expert0(a, pre, group)
    for e in range(n_experts if routed_experts else 0):
        ex = f"{pre}.ffn.experts.{e}"
        out += (Param(f"{ex}.w{i}", p.shape, p.fmt, group, p.init) for i, p in enumerate(first, 1))
    inter = a.moe_inter_dim * a.n_shared_experts
    sh = f"{pre}.ffn.shared_experts"
    out.append(_linear(f"{sh}.w1", inter, a.dim, Fmt.FP8, group))
    out.append(_linear(f"{sh}.w2", a.dim, inter, Fmt.FP8, group))
    out.append(_linear(f"{sh}.w3", inter, a.dim, Fmt.FP8, group))
    return out


def _block_common(a: ModelArgs, pre: str, group: str) -> list[Param]:
    mix = (2 + a.hc_mult) * a.hc_mult
    hc_dim = a.hc_mult * a.dim
    out = [_norm(f"{pre}.attn_norm.weight", a.dim, group), _norm(f"{pre}.ffn_norm.weight", a.dim, group)]
    for part in ("attn", "ffn"):
        out.append(Param(f"{pre}.hc_{part}_fn", (mix, hc_dim), Fmt.F32, group, Init(0.1 * hc_dim**-0.5)))
        out.append(_vector(f"{pre}.hc_{part}_base", mix, Fmt.F32, group, std=0.1))
        out.append(_vector(f"{pre}.hc_{part}_scale", 3, Fmt.F32, group, std=0.05, mean=0.5))
    return out


def _engram(a: ModelArgs, layer: int) -> list[Param]:
    group, pre = f"engram.{layer}", f"layers.{layer}.engram"
    rows = a.engram_num_embeddings[a.engram_layer_ids.index(layer)]
    n_cols = (a.engram_max_ngram_size - 1) * a.engram_n_heads
    return [
        Param(f"{pre}.embed", (rows, a.engram_head_dim), Fmt.FP8_ROWS, group, Init(1.0)),
        _linear(f"{pre}.wkv", a.dim * (a.hc_mult + 1), n_cols * a.engram_head_dim, Fmt.FP8, group),
        Param(f"{pre}.q_weight", (a.hc_mult, a.dim), Fmt.BF16, group, Init(0.1, 1.0)),
        Param(f"{pre}.k_weight", (a.hc_mult, a.dim), Fmt.BF16, group, Init(0.1, 1.0)),
    ]


def _expert0(a: ModelArgs, pre: str, group: str) -> list[Param]:
    """Routed expert 0 of backbone layer or MTP stage `pre`: w1, w2, w3 (every expert has their shapes)."""
    return [
        _linear(f"{pre}.ffn.experts.0.w1", a.moe_inter_dim, a.dim, Fmt.FP4, group),
        _linear(f"{pre}.ffn.experts.0.w2", a.dim, a.moe_inter_dim, Fmt.FP4, group),
        _linear(f"{pre}.ffn.experts.0.w3", a.moe_inter_dim, a.dim, Fmt.FP4, group),
    ]


def _mtp(a: ModelArgs, stage: int, routed_experts: bool = True) -> list[Param]:
    layer, pre, group = a.n_layers + stage, f"mtp.{stage}", f"mtp.{stage}"
    out = _attention(a, pre, layer, group) + _ffn(a, pre, layer, group, routed_experts) + _block_common(a, pre, group)
    if stage == 0:
        n_targets = len(a.dspark_target_layer_ids)
        out.append(_linear(f"{pre}.main_proj", a.dim, a.dim * n_targets, Fmt.FP8, group))
        out.append(_norm(f"{pre}.main_norm.weight", a.dim, group))
    if stage == a.n_mtp_layers - 1:
        r = a.dspark_markov_rank
        out.append(_norm(f"{pre}.norm.weight", a.dim, group))
        out.append(Param(f"{pre}.markov_head.embed.weight", (a.vocab_size, r), Fmt.BF16, group, Init(r**-0.5)))
        out.append(Param(f"{pre}.markov_head.head.weight", (a.vocab_size, r), Fmt.BF16, group, Init(r**-0.5)))
        shape = (1, a.dim + r)
        out.append(Param(f"{pre}.confidence_head.proj.weight", shape, Fmt.BF16, group, Init((a.dim + r) ** -0.5)))
    return out


def _vision(a: ModelArgs) -> list[Param]:
    g, d, inter = "vision", a.vision_dim, a.vision_inter_dim
    patch_in = 3 * a.vision_patch_size**2
    out = [
        Param("vision.patch_embed.proj.weight", (d, patch_in), Fmt.BF16, g, Init(patch_in**-0.5)),
        _vector("vision.patch_embed.proj.bias", d, Fmt.BF16, g, std=0.02),
    ]
    for b in range(a.vision_n_layers):
        pre = f"vision.blocks.{b}"
        out += [
            _norm(f"{pre}.norm1.weight", d, g),
            Param(f"{pre}.attn.wqkv.weight", (3 * d, d), Fmt.BF16, g, Init(d**-0.5)),
            _vector(f"{pre}.attn.wqkv.bias", 3 * d, Fmt.BF16, g, std=0.02),
            Param(f"{pre}.attn.wo.weight", (d, d), Fmt.BF16, g, Init(d**-0.5)),
            _vector(f"{pre}.attn.wo.bias", d, Fmt.BF16, g, std=0.02),
            _norm(f"{pre}.norm2.weight", d, g),
            Param(f"{pre}.mlp.w1.weight", (2 * inter, d), Fmt.BF16, g, Init(d**-0.5)),
            Param(f"{pre}.mlp.w2.weight", (d, inter), Fmt.BF16, g, Init(inter**-0.5)),
        ]
    out.append(_norm("vision.norm.weight", d, g))
    merged = a.vision_downsample_ratio**2 * d
    out += [
        Param("aligner.w1.weight", (a.dim, merged), Fmt.BF16, g, Init(merged**-0.5)),
        _vector("aligner.w1.bias", a.dim, Fmt.BF16, g, std=0.02),
        Param("aligner.w2.weight", (a.dim, a.dim), Fmt.BF16, g, Init(a.dim**-0.5)),
        _vector("aligner.w2.bias", a.dim, Fmt.BF16, g, std=0.02),
    ]
    return out


def catalogue(a: ModelArgs, routed_experts: bool = True) -> list[Param]:
    """Every parameter of the checkpoint described by `a`, grouped by shard, groups in published
    order: vision, embed, layers, head, mtp, engram. `routed_experts=False`: all but the routed experts
    (`routed_expert_layout` describes those per layer)."""
    out: list[Param] = []
    if a.vision_enabled:
        out += _vision(a)
    out.append(Param("embed.weight", (a.vocab_size, a.dim), Fmt.BF16, "embed", Init(EMBED_STD)))
    if a.vision_enabled:
        for name in ("image_start", "image_end", "image_newline"):
            out.append(Param(name, (a.dim,), Fmt.BF16, "embed", Init(EMBED_STD)))
    for i in range(a.n_layers):
        group, pre = f"layer.{i}", f"layers.{i}"
        out += _attention(a, pre, i, group) + _ffn(a, pre, i, group, routed_experts) + _block_common(a, pre, group)
    out.append(Param("head.weight", (a.vocab_size, a.dim), Fmt.BF16, "head", Init(a.dim**-0.5)))
    out.append(_norm("norm.weight", a.dim, "head"))
    for k in range(_mtp_stages(a)):
        out += _mtp(a, k, routed_experts)
    for i in a.engram_layer_ids:
        out += _engram(a, i)
    return out


Layout = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)


def published_layout(a: ModelArgs, routed_experts: bool = True) -> Layout:
    """name -> (dtype, shape) of every tensor in the published checkpoint with config `a` (routed experts
    in fp8 where its quantization_config says expert_dtype "fp8"); `routed_experts=False`: all but those.

    mtp.K.embed / head are not listed: the published checkpoint does not carry them (they are tied to
    the backbone and dropped if present).
    """
    fp8_experts = a.expert_dtype == "fp8"
    return {
        p.name + suffix: (dtype, shape)
        for p in catalogue(a, routed_experts)
        for suffix, dtype, shape in _forms(p.fmt, p.shape, True, fp8_experts)
    }


ExpertLayout = tuple[str, int, tuple[tuple[str, str, tuple[int, ...]], ...]]


def routed_expert_layout(a: ModelArgs) -> list[ExpertLayout]:
    """The routed experts of published_layout, per backbone layer and MTP stage, in catalogue order:
    (`layers.3.ffn.experts.`, experts, (rest of the name after the expert id, dtype, shape) of each file
    tensor of an expert); expert e's tensors are named prefix + str(e) + rest. 94k names as ~40 records."""
    fp8_experts = a.expert_dtype == "fp8"
    owners = [(f"layers.{i}", i) for i in range(a.n_layers)]
    owners += [(f"mtp.{k}", a.n_layers + k) for k in range(_mtp_stages(a))]
    out = []
    for pre, layer in owners:
        prefix = f"{pre}.ffn.experts."
        forms = tuple(
            (p.name.removeprefix(prefix + "0") + suffix, dtype, shape)
            for p in _expert0(a, pre, "")
            for suffix, dtype, shape in _forms(p.fmt, p.shape, True, fp8_experts)
        )
        out.append((prefix, a.moe_config(layer)[0], forms))
    return out


def _mtp_stages(a: ModelArgs) -> int:
    return a.n_mtp_layers if a.dspark_block_size else 0  # as upstream: no DSpark, no mtp stages


def group_order(a: ModelArgs) -> list[str]:
    """Shard groups in file order."""
    groups = ["vision"] if a.vision_enabled else []
    groups += ["embed", *(f"layer.{i}" for i in range(a.n_layers)), "head"]
    groups += [f"mtp.{k}" for k in range(_mtp_stages(a))]
    groups += [f"engram.{i}" for i in a.engram_layer_ids]
    return groups
