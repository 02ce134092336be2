"""Memory figures a user can plan with (`plan --tp N`): what one rank holds to run the converted model
in verify, and what the layer-streamed reference (`reference-logits --stream-layers`, tp 1) needs.

Estimates from shapes alone (the plan's tensors, the model's dtypes and caches built on the meta device),
for verify's default prompts (3 x 40 tokens, 3 decode steps, batch 1):

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

import dataclasses
import re
from typing import Any

import torch

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.plan import ConversionPlan
from dsv41_convert.convert.rules import RULES, Split
from dsv41_convert.store.safetensors_header import nbytes

DEFAULT_PROMPTS, DEFAULT_TOKENS, DEFAULT_DECODE, DEFAULT_SEQ = 3, 40, 3, 128
_EXPERT = re.compile(r"\.experts\.\d+\.")
_UNIT = re.compile(r"(layers\.\d+|mtp\.\d+)\.")


def _model_view(args: ModelArgs) -> tuple[dict[str, torch.dtype], int]:
    """Model dtype per state-dict name (experts as experts.0) and cache bytes, from a meta-device model
    with one routed expert per active slot (dtypes and caches do not depend on the expert count)."""
    from dsv41_convert.model.load import expected_tensors
    from dsv41_convert.model.transformer import Transformer

    small = dataclasses.replace(
        args,
        n_routed_experts=args.n_activated_experts,
        dspark_n_routed_experts=args.dspark_n_activated_experts,
    ).with_runtime(max_batch_size=1, max_seq_len=DEFAULT_SEQ, temperature=0.0)
    token_map = None  # one compressed id per token id, as a tokenizer's map (only its size matters here)
    if args.engram_layer_ids:
        folded = args.engram_compressed_vocab_size
        token_map = list(range(folded)) + [0] * (args.vocab_size - folded)
    with torch.device("meta"):
        model = Transformer(small, token_map)
    dtypes = {name: p.dtype for name, (p, _) in expected_tensors(model).items()}
    caches = sum(b.numel() * b.element_size() for _, b in model.named_buffers() if not _.endswith("freqs_cis"))
    return dtypes, caches


def _unit(name: str) -> str:
    m = _UNIT.match(name)
    if m:
        return m.group(1)
    if name.startswith(("vision.", "aligner.")):
        return "vision"
    return "embed" if name.startswith(("embed.", "image_")) else "head"


def _in_model(name: str, dtype: str, shape: tuple[int, ...], dtypes: dict[str, torch.dtype]) -> int:
    """Bytes of one file tensor in the model: bf16 on disk and fp32 in the model count twice."""
    size = nbytes(dtype, shape)
    return 2 * size if dtype == "BF16" and dtypes.get(_EXPERT.sub(".experts.0.", name)) == torch.float32 else size


def _dequant_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """fp32 bytes of a quantized weight dequantized whole by the CPU reference GEMMs (0 for the rest)."""
    if dtype == "F8_E4M3":
        return 4 * nbytes(dtype, shape)
    return 8 * nbytes(dtype, shape) if dtype in ("F4", "I8") else 0


def tp1_tensors(plan: ConversionPlan) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor the plan's ranks hold, merged back to tp 1: what a tp-1 plan of
    the same source lays out (dim0/dim1 parts added up, Engram padding rows taken off, experts and
    replicated tensors once), without planning the source again."""
    split_of = {rule.pattern: rule.split for rule in RULES}  # OutTensor.rule is its rule's pattern
    merged: dict[str, tuple[str, list[int]]] = {}
    for f in plan.files:
        for t in f.tensors:
            if t.name not in merged:
                merged[t.name] = (t.dtype, [*t.shape[:1], *t.shape[1:]])
                if t.pad_rows:
                    merged[t.name][1][0] -= t.pad_rows
                continue
            split, shape = split_of[t.rule], merged[t.name][1]
            if split in (Split.DIM0, Split.ROWS_PADDED):
                shape[0] += t.shape[0] - t.pad_rows
            elif split is Split.DIM1:
                shape[1] += t.shape[1]
    return [(name, dtype, tuple(shape)) for name, (dtype, shape) in merged.items()]


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
    dtypes, caches = _model_view(args)
    logits = tokens * args.vocab_size * 4 * 2  # logits_all + the last row, float32
    hidden = prompts * tokens * args.dim * 2 * (args.n_layers * (args.hc_mult + 2) + 2)  # kept for the report
    ranks = []
    for f in plan.files:
        weights = sum(_in_model(t.name, t.dtype, t.shape, dtypes) for t in f.tensors)
        # Engram tables are dequantized row by row on lookup, never whole
        temp = max(_dequant_bytes(t.dtype, t.shape) for t in f.tensors if ".engram.embed." not in t.name)
        working = logits + hidden + temp
        ranks.append({"rank": f.rank, "weights": weights, "caches": caches, "working": working,
                      "total": weights + caches + working})  # fmt: skip

    # the streamed path reads the source at tp 1: the tp-1 plan's tensors, grouped by unit
    dense: dict[str, int] = {}
    read: dict[str, int] = {}  # the dense part as the provider hands it over (file dtypes)
    experts: dict[str, int] = {}
    reach = prompts * tokens  # the prefill pass reaches the most experts and Engram rows
    temp = 0
    for name, dtype, shape in tp1_tensors(plan):
        unit = _unit(name)
        size = _in_model(name, dtype, shape, dtypes)
        if ".engram.embed." in name:
            rows = min(shape[0], reach * args.engram_n_heads * (args.engram_max_ngram_size - 1))
            dense[unit] = dense.get(unit, 0) + size // shape[0] * rows
            read[unit] = read.get(unit, 0) + size // shape[0] * rows
        elif _EXPERT.search(name):
            experts[unit] = experts.get(unit, 0) + size
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
