"""Memory figures a user can plan with (`plan --tp N`): what one rank holds to run the converted model
in verify, and what the layer-streamed reference (`reference-logits --stream-layers`, tp 1) needs.

Estimates from shapes alone (the plan's tensors; the model's float32 weights and caches from the config,
so `plan` needs no torch), for verify's default prompts (3 x 40 tokens, 3 decode steps, batch 1):

    verify, per rank   weights    the rank file's tensors in the model's dtypes (bf16 on disk, fp32 in the
                                  model for the head, markov and confidence heads, ratio-2 compressors)
                       caches     KV / compressor / indexer / Engram-hash buffers at max_seq_len 128
                       working    logits of every prompt position + the per-module hidden states kept for
                                  the report + the largest fp8/fp4 weight dequantized to fp32 (CPU kernels)
    streamed, tp 1     unit       the largest unit: its dense weights, the routed experts the prompts can
                                  reach (top-k x positions, at most all), Engram rows (positions x columns)
                       peak       unit + its dense part again in file dtypes (the provider's buffer, while
                                  it is copied into the module) + caches + working, as above

They leave out the Python/torch baseline of the process (~0.4 GiB on CPU) and allocator slack.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.plan import QUANTIZING, ConversionPlan, ExpertRun, OutTensor, RankFile
from dsv41_convert.convert.rules import RULES, Split
from dsv41_convert.store.safetensors_header import nbytes

DEFAULT_PROMPTS, DEFAULT_TOKENS, DEFAULT_DECODE, DEFAULT_SEQ = 3, 40, 3, 128


# BF16 on disk, float32 in the model (the loader widens them exactly): the heads that emit float32 logits
# or scores, the vision tower's norms, and the pooling projections of ratio > 1 compressors (checked
# against the model's own parameters in tests/unit/test_memory_figures.py)
_WIDENED = re.compile(
    r"(head|mtp\.\d+\.markov_head\.head|mtp\.\d+\.confidence_head\.proj|vision\.(blocks\.\d+\.)?norm\d*)\.weight"
)
_COMPRESSOR_WEIGHT = re.compile(r"layers\.(\d+)\.attn\.compressor\.(wkv|wgate)\.weight")
BF16, F32, I64 = 2, 4, 8  # bytes per element


def widened(name: str, args: ModelArgs) -> bool:
    """Whether state-dict tensor `name` is a float32 weight in the model (a bf16 file tensor doubles)."""
    if _WIDENED.fullmatch(name):
        return True
    m = _COMPRESSOR_WEIGHT.fullmatch(name)
    return m is not None and args.compress_ratios[int(m.group(1))] > 1


def cache_bytes(args: ModelArgs, batch: int = 1, seq: int = DEFAULT_SEQ) -> int:
    """Bytes of the model's runtime buffers at (batch, seq), the RoPE tables left out: every attention's
    window KV; per kv-source layer its compressed KV, compressor state (ratio > 1) and indexer key cache
    (when it is an index source too); the Engram hash tables and n-gram history. From the config alone,
    so `plan` needs no torch; equal to the buffers of a model built at that runtime (tested)."""
    total = (args.n_layers + args.n_mtp_layers) * batch * args.window_size * args.head_dim * BF16
    for layer in args.kv_source_layers:
        if layer >= args.n_layers:
            continue
        ratio = args.compress_ratios[layer]
        total += batch * (seq // ratio) * args.head_dim * BF16
        if ratio > 1:
            total += 2 * batch * ratio * args.head_dim * F32  # kv_state, score_state
        if layer in args.index_source_layers:
            total += batch * (seq // ratio) * args.index_head_dim * BF16
    if args.engram_layer_ids:
        groups, looks, heads = len(args.engram_layer_ids), args.engram_max_ngram_size, args.engram_n_heads
        # token map, multipliers [G, N], primes [G, N-1, H], row offsets [G, (N-1)*H], history [batch, seq]
        total += (args.vocab_size + groups * looks + 2 * groups * (looks - 1) * heads + batch * seq) * I64
    return total


def _unit(name: str) -> str:
    """The streamed unit a tensor belongs to: `layers.3.ffn.experts.7.w1.weight` -> `layers.3`, `mtp.0....` ->
    `mtp.0`, else vision, embed or head."""
    if name.startswith(("layers.", "mtp.")):
        return name[: name.index(".", name.index(".") + 1)]
    if name.startswith(("vision.", "aligner.")):
        return "vision"
    return "embed" if name.startswith(("embed.", "image_")) else "head"


def _in_model(name: str, dtype: str, size: int, args: ModelArgs) -> int:
    """Bytes in the model of a file tensor of `size` bytes: bf16 on disk and fp32 in the model count twice."""
    return 2 * size if dtype == "BF16" and widened(name, args) else size


def model_bytes(tensors: Iterable[tuple[str, str, int]], args: ModelArgs) -> int:
    """Bytes in the model of file tensors (name, safetensors dtype, bytes in the file): a rank file's header read
    by verify, the same rule as the plan's per-rank weights."""
    return sum(_in_model(name, dtype, size, args) for name, dtype, size in tensors)


def rank_weights(plan: ConversionPlan, args: ModelArgs) -> list[int]:
    """The weights each rank's model holds, in rank order: `memory_figures`' per-rank "weights"."""
    return [_rank_figures(f, args)[0] for f in plan.files]


def reference_weights(plan: ConversionPlan, args: ModelArgs, unquantized: bool = False) -> list[tuple[int, int]]:
    """What each rank of a reference computed from `plan`'s source holds, in rank order: (state, model), the bytes
    of its rank file computed in memory (verify.source.plan_state) and of the model it is copied into (the same
    tensors in the model's dtypes: `rank_weights`). Both are whole at once when the copy ends; `verify --reference
    SRC` keeps the state after it.

    unquantized: a bf16 source run as it is (plan_state's skip_quant): the weight of a quantizing action stays the
                 source's bf16 [out, in] (2 bytes an element, the file's fp8 1, its fp4 half) and has no scale"""
    out = []
    for f in plan.files:
        state, model = 0, 0
        for p in f.parts:
            if type(p) is ExpertRun:  # copies of the source's bytes, quantized or not
                state += sum(s.nbytes for _, s in p.members)
                model += sum(_in_model(name, p.dtype, s.nbytes, args) for name, s in p.members)
            elif unquantized and p.action in QUANTIZING:
                size = 0 if p.part else math.prod(p.shape) * BF16
                state, model = state + size, model + _in_model(p.name, "BF16", size, args)
            else:
                state, model = state + p.end - p.begin, model + _in_model(p.name, p.dtype, p.end - p.begin, args)
        out.append((state, model))
    return out


def _dequant_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """fp32 bytes of a quantized weight dequantized whole by the CPU reference GEMMs (0 for the rest)."""
    if dtype == "F8_E4M3":
        return 4 * nbytes(dtype, shape)
    return 8 * nbytes(dtype, shape) if dtype in ("F4", "I8") else 0


_SPLIT_OF = {rule.pattern: rule.split for rule in RULES}  # OutTensor.rule is its rule's pattern


def _merged(tensors: Iterable[OutTensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of `tensors` (of every rank, in rank order) merged back to tp 1."""
    merged: dict[str, tuple[str, list[int]]] = {}
    for t in tensors:
        if t.name not in merged:
            merged[t.name] = (t.dtype, [*t.shape[:1], *t.shape[1:]])
            if t.pad_rows:
                merged[t.name][1][0] -= t.pad_rows
            continue
        split, shape = _SPLIT_OF[t.rule], merged[t.name][1]
        if split in (Split.DIM0, Split.ROWS_PADDED):
            shape[0] += t.shape[0] - t.pad_rows
        elif split is Split.DIM1:
            shape[1] += t.shape[1]
    return [(name, dtype, tuple(shape)) for name, (dtype, shape) in merged.items()]


def tp1_tensors(plan: ConversionPlan) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor the plan's ranks hold, merged back to tp 1: what a tp-1 plan of
    the same source lays out (dim0/dim1 parts added up, Engram padding rows taken off, experts and
    replicated tensors once), without planning the source again."""
    return _merged(t for f in plan.files for t in f.tensors)


def _rank_figures(f: RankFile, args: ModelArgs) -> tuple[int, int]:
    """(weights in the model, largest whole-weight dequantization) of one rank file; its routed experts
    (most of its tensors, in ExpertRuns) share a few shapes."""
    weights, shapes = 0, set()
    for p in f.parts:
        if type(p) is ExpertRun:
            weights += sum(_in_model(name, p.dtype, s.nbytes, args) for name, s in p.members)
            shapes.update((p.dtype, p.out_shape(shape)) for shape in {s.shape for _, s in p.members})
            continue
        weights += _in_model(p.name, p.dtype, p.end - p.begin, args)
        if ".engram.embed." not in p.name:  # Engram tables are dequantized row by row on lookup, never whole
            shapes.add((p.dtype, p.shape))
    return weights, max(_dequant_bytes(dtype, shape) for dtype, shape in shapes)


def memory_figures(
    plan: ConversionPlan,
    args: ModelArgs,
    prompts: int = DEFAULT_PROMPTS,
    tokens: int = DEFAULT_TOKENS,
    decode_steps: int = DEFAULT_DECODE,
) -> dict[str, Any]:
    """plan: the plan at the tp verify runs (streaming reads its tensors merged back to tp 1); prompts of
    `tokens` tokens each (verify's defaults unless given).

    -> {"verify": per rank bytes (weights, caches, working, total), "streamed": the largest unit and peak}"""
    caches = cache_bytes(args)
    logits = tokens * args.vocab_size * 4 * 2  # logits_all + the last row, float32
    hidden = prompts * tokens * args.dim * 2 * (args.n_layers * (args.hc_mult + 2) + 2)  # kept for the report
    ranks = []
    for f in plan.files:
        weights, temp = _rank_figures(f, args)
        working = logits + hidden + temp
        ranks.append({"rank": f.rank, "weights": weights, "caches": caches, "working": working,
                      "total": weights + caches + working})  # fmt: skip

    # the streamed path reads the source at tp 1: the tp-1 plan's tensors, grouped by unit; each routed
    # expert tensor is on one rank, whole
    dense: dict[str, int] = {}
    read: dict[str, int] = {}  # the dense part as the provider hands it over (file dtypes)
    experts: dict[str, int] = {}
    others: list[OutTensor] = []
    for f in plan.files:
        for p in f.parts:
            if type(p) is ExpertRun or _SPLIT_OF[p.rule] is Split.EXPERT:
                unit = _unit(p.prefix if type(p) is ExpertRun else p.name)
                experts[unit] = experts.get(unit, 0) + p.end - p.begin
            else:
                others.append(p)
    reach = prompts * tokens  # the prefill pass reaches the most experts and Engram rows
    temp = 0
    for name, dtype, shape in _merged(others):
        unit = _unit(name)
        size = _in_model(name, dtype, nbytes(dtype, shape), args)
        if ".engram.embed." in name:
            rows = min(shape[0], reach * args.engram_n_heads * (args.engram_max_ngram_size - 1))
            dense[unit] = dense.get(unit, 0) + size // shape[0] * rows
            read[unit] = read.get(unit, 0) + size // shape[0] * rows
        else:
            dense[unit] = dense.get(unit, 0) + size
            read[unit] = read.get(unit, 0) + nbytes(dtype, shape)
            temp = max(temp, _dequant_bytes(dtype, shape))
    units = {}
    for unit, size in dense.items():
        routed = 0
        if unit in experts:
            n_routed, n_active = args.moe_config(args.n_layers + int(unit[4:]) if unit.startswith("mtp.") else 0)
            routed = experts[unit] * min(n_routed, n_active * reach) // n_routed
        # dense weights are held twice while they load (the provider's buffer, then the module); experts
        # arrive one at a time
        units[unit] = (size + routed, size + read[unit] + routed)
    name, (unit_bytes, unit_peak) = max(units.items(), key=lambda kv: kv[1][1])
    working = logits + hidden + temp
    return {
        "prompts": {"count": prompts, "tokens": tokens, "decode_steps": decode_steps},
        "verify": ranks,
        "streamed": {
            "largest_unit": name,
            "unit": unit_bytes,
            "caches": caches,
            "working": working,
            "peak": unit_peak + caches + working,
        },
    }
