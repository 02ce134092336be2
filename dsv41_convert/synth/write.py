"""Write a synthetic checkpoint: config.json, tokenizer files, shards, index (last).

Shards follow the published grouping, one group per file except the backbone layers, which are
spread over `layer_shards` files (default: one per layer, as published):

    vision + aligner | embed + image_* | layers (without Engram) x K | head + norm | mtp.k each | layers.i.engram each

Each shard is built alone (values drawn, already in the file's dtypes, then saved), so memory holds one shard at a
time; the whole checkpoint is written into a hidden folder beside OUT and renamed to OUT at the end (synth/staged.py).
Headers are the published ones (Shard.sorted_header: save_file's order, dtype then name, no metadata; an
Engram shard in the module's order), so the bytes depend only on the arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.catalogue import FileTensor, Param, catalogue, file_tensors, group_order
from dsv41_convert.convert.transform import to_bytes
from dsv41_convert.engram_tokens import compressed_token_map
from dsv41_convert.errors import PlanError
from dsv41_convert.progress import Progress as ProgressFn
from dsv41_convert.quant.file_dtypes import TORCH_TO_SAFETENSORS
from dsv41_convert.store.publish import publish
from dsv41_convert.store.safetensors_header import build_header, nbytes
from dsv41_convert.synth.presets import Preset, hf_config
from dsv41_convert.synth.staged import INDEX, refuse_out, staged
from dsv41_convert.synth.tokenizer import build_tokenizer, special_token_ids, tokenizer_config
from dsv41_convert.synth.weights import param_tensors

_SMALL = 1 << 28  # bytes; below this, one torch thread (small ops on 2+ threads mostly wait on each other)


@dataclass(frozen=True)
class Shard:
    file: str
    params: tuple[Param, ...]
    tensors: tuple[FileTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(nbytes(t.dtype, t.shape) for t in self.tensors)

    @property
    def sorted_header(self) -> bool:
        """save_file's order (dtype, then name), as the published shards 1-46 have it; an Engram table's shard
        keeps the module's order (embed first), which gives the published sizes of shards 47 and 48 (their
        headers are 32 and 40 bytes longer than save_file's order makes them; any order without metadata that
        puts the table first gives those sizes, the rest of the published order is not known)."""
        return not (self.params and self.params[0].group.startswith("engram."))

    def header(self) -> tuple[bytes, list[tuple[str, int, int]]]:
        """build_header of this shard's tensors in its order: -> (header bytes, [(name, begin, end)])"""
        return build_header([(t.name, t.dtype, t.shape) for t in self.tensors], sort=self.sorted_header)


def plan_shards(args: ModelArgs, quantized: bool, layer_shards: int | None = None) -> list[Shard]:
    """The shard files of a checkpoint and what each holds, in file order."""
    k = args.n_layers if layer_shards is None else layer_shards
    if not 1 <= k <= args.n_layers:
        raise PlanError(f"--shards {k}: the backbone has {args.n_layers} layers, so 1..{args.n_layers} layer shards")
    by_group: dict[str, list[Param]] = {}
    for p in catalogue(args):
        by_group.setdefault(p.group, []).append(p)
    # contiguous, as even as possible: the first (n_layers % k) files take one layer more
    per, extra = divmod(args.n_layers, k)
    layer_file = []
    for f in range(k):
        layer_file += [f] * (per + (f < extra))
    files: list[list[Param]] = []
    layer_base = None
    for group in group_order(args):
        if group.startswith("layer."):
            f = layer_file[int(group.split(".")[1])]
            if layer_base is None:
                layer_base = len(files)
            if layer_base + f == len(files):
                files.append([])
            files[layer_base + f] += by_group[group]
        else:
            files.append(list(by_group.get(group, [])))
    n = len(files)
    return [
        Shard(
            f"model-{i + 1:05d}-of-{n:05d}.safetensors",
            tuple(params),
            tuple(t for p in params for t in file_tensors(p, quantized)),
        )
        for i, params in enumerate(files)
    ]


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_shard(out: Path, shard: Shard, seed: int, quantized: bool, progress: ProgressFn | None = None) -> int:
    """Build one shard's tensors and save them; returns the file size in bytes."""
    total, done = shard.nbytes, 0
    if progress:
        progress(shard.file, 0, total)
    tensors: dict[str, torch.Tensor] = {}
    built = 0
    for p in shard.params:
        drawn = param_tensors(p, seed, quantized)
        tensors.update(drawn)
        built += sum(t.nbytes for t in drawn.values())
        if progress:
            progress(shard.file, built * 9 // 10, total)  # the last tenth is the save
    planned = {t.name: t for t in shard.tensors}
    # the catalogue and the encoder must agree exactly; a difference is a bug here, not bad input
    assert set(tensors) == set(planned), sorted(set(tensors) ^ set(planned))
    for name, t in tensors.items():
        want = planned[name]
        assert (TORCH_TO_SAFETENSORS[t.dtype], tuple(t.shape)) == (want.dtype, want.shape), (name, t.dtype, t.shape)
        done += t.nbytes
    tmp = out / (shard.file + ".partial")
    header, spans = shard.header()
    with open(tmp, "wb") as f:
        f.write(header)
        for name, _, _ in spans:
            f.write(to_bytes(tensors[name]))
    publish(tmp, out / shard.file, durable=False)  # random weights, made again in seconds
    if progress:
        progress(shard.file, done, total)
    return (out / shard.file).stat().st_size


def preset_files(preset: Preset, *, quantized: bool = True, vision: bool = True) -> tuple[dict[str, Any], Tokenizer]:
    """config.json of a preset and its tokenizer, which puts every special token at the id config.json names
    and whose Engram token-map size is the config's engram_compressed_vocab_size."""
    config = hf_config(preset, compressed_vocab_size=0, quantized=quantized, vision=vision)  # size set below
    tok = build_tokenizer(preset.vocab_size, specials=special_token_ids(config))
    _, config["text_config"]["engram_compressed_vocab_size"] = compressed_token_map(tok)
    return config, tok


def _planned(
    preset: Preset, quantized: bool, vision: bool, layer_shards: int | None
) -> tuple[dict[str, Any], Tokenizer, list[Shard]]:
    """-> (config.json, tokenizer, shards in file order) of a checkpoint write_checkpoint writes; PlanError for
    a --shards the preset's layers cannot take."""
    config, tok = preset_files(preset, quantized=quantized, vision=vision)
    args = ModelArgs.from_hf_dict(config, f"preset {preset.name}")
    return config, tok, plan_shards(args, quantized, layer_shards)


def check_checkpoint(
    out: Path, preset: Preset, *, quantized: bool = True, vision: bool = True, layer_shards: int | None = None,
    overwrite: bool = False,
) -> None:  # fmt: skip
    """What write_checkpoint with these arguments refuses before its first byte (--shards, then `out` as found:
    staged.refuse_out), nothing made, locked or written; for the CLI, before its progress display."""
    _planned(preset, quantized, vision, layer_shards)
    refuse_out(Path(out), overwrite)


def write_checkpoint(
    out: Path,
    preset: Preset,
    *,
    seed: int = 0,
    quantized: bool = True,
    vision: bool = True,
    layer_shards: int | None = None,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Write a complete HF-format checkpoint with random weights into `out`.

    quantized: True writes the published fp8/fp4 layout, False the same model as plain BF16
               (no .scale tensors, no quantization_config).
    progress:  progress(file, bytes_done, bytes_total), once at the start and end of each shard.
    Returns a summary: files with sizes, tensor count, total_size, the config.
    """
    out = Path(out)
    config, tok, shards = _planned(preset, quantized, vision, layer_shards)
    compressed = config["text_config"]["engram_compressed_vocab_size"]
    total_bytes = sum(s.nbytes for s in shards)
    files = []
    with staged(out, overwrite) as stage:
        write_text(stage / "config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        write_text(stage / "tokenizer.json", tok.to_str(pretty=True))
        model_max = config["text_config"]["max_position_embeddings"]
        tok_config = tokenizer_config(model_max)
        write_text(stage / "tokenizer_config.json", json.dumps(tok_config, indent=2, ensure_ascii=False))
        with _torch_threads(1 if total_bytes < _SMALL else None):
            for shard in shards:
                size = write_shard(stage, shard, seed, quantized, progress)
                files.append({"file": shard.file, "bytes": size, "tensors": len(shard.tensors)})
        weight_map = {t.name: s.file for s in shards for t in s.tensors}
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_text(stage / INDEX, json.dumps(index, indent=2))  # no newline at the end, as published
    return {
        "out": str(out),
        "preset": preset.name,
        "seed": seed,
        "source_dtype": "fp8" if quantized else "bf16",
        "vision": vision,
        "n_tensors": len(weight_map),
        "total_size": total_bytes,
        "engram_compressed_vocab_size": compressed,
        "files": files,
    }
