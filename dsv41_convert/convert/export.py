"""`export`: a Hugging Face-format checkpoint in another weight format, on the shard engine.

`build_export_plan(src, fmt)` reads config.json, the index and the headers only, validates them as
`plan` does (validate.py), and lays out one output file per source file, in the source's grouping:
source file k of n (sorted by name) becomes `model-0000k-of-0000n.safetensors`, holding the same
tensor names (scales dropped or added beside their weights, export_rules.py says which); a source file
whose every tensor is dropped gives no shard, and k and n count the files that give one. The result is
an ordinary ConversionPlan (tp 1, one "rank" per output file), so `execute` writes it: streaming,
bounded memory, `*.partial` files, journals, --resume, workers, done records, manifest.json.

Beside the shards: the tokenizer files (first), then, once every shard is done, config.json (the
source's, with quantization_config for the format) and model.safetensors.index.json
(metadata.total_size = the sum of tensor bytes): a folder without them is not a finished export.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial
from pathlib import Path
from typing import Any

from dsv41_convert.config import HF_QUANTIZATION_CONFIG, ModelArgs, load_json
from dsv41_convert.convert.execute import SIDECARS, Sidecars, copy_tokenizer_files, execute
from dsv41_convert.convert.export_rules import EXPERT_DTYPE, SCALE_OPS, check_format, export_action, keeps_scale
from dsv41_convert.convert.plan import INDEX, ConversionPlan, OutTensor, Read, file_summary, lay_out, read_index
from dsv41_convert.convert.rules import Op, scale_name, weight_name
from dsv41_convert.convert.validate import (
    Source,
    gather_sources,
    require_engram_tokenizer,
    require_json_tokenizer_files,
    require_regular_files,
    validate_sources,
)
from dsv41_convert.errors import PlanError
from dsv41_convert.progress import Progress
from dsv41_convert.store.manifest import FRAGMENT_GLOB, MANIFEST, atomic_write
from dsv41_convert.store.safetensors_header import nbytes, sort_key
from dsv41_convert.store.source_stamps import source_stamps

CONFIG = "config.json"
RECORDS = (CONFIG, INDEX)  # the files that say an export is finished, written last (Sidecars.records)
E4M3, E8M0, BF16, I8 = "F8_E4M3", "F8_E8M0", "BF16", "I8"


@dataclass(frozen=True)
class ExportPlan:
    """An export: the engine's plan of the shards, and the two JSON files written once they are done."""

    format: str  # bf16 | fp8 | fp8-fp4
    plan: ConversionPlan  # tp 1, one entry of `files` per output shard; inference_config = `config`
    config: dict[str, Any]  # config.json of OUT
    index: dict[str, Any]  # model.safetensors.index.json of OUT


def shard_name(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def build_export_plan(src: Path, fmt: str) -> ExportPlan:
    """Read config, index and headers of `src`, validate them, and lay out every output shard.

    Raises PlanError / HeaderError / ConfigError naming the file and tensor at fault.
    """
    check_format(fmt)
    src = Path(src)
    require_regular_files(src)
    require_json_tokenizer_files(src)
    stamps = source_stamps(src)  # before the headers (ConversionPlan.stamps)
    hf = load_json(src / CONFIG)
    if "text_config" not in hf:
        raise PlanError(
            f"{src / CONFIG}: not a Hugging Face config (no text_config); export reads HF checkpoints, "
            "not the rank files of `shard`"
        )
    args = ModelArgs.from_hf_dict(hf, str(src / CONFIG))
    index_sha, weight_map = read_index(src)
    sources = gather_sources(src, weight_map)
    quantizes = fmt != "bf16" and args.dtype != "fp8"
    validate_sources(sources, args, 1, src / CONFIG, "fp8" if fmt == "fp8" else "fp4", quantizes)
    require_engram_tokenizer(src, args)
    files = sorted({s.file for s in sources.values()})
    by_file: dict[str, list[str]] = {f: [] for f in files}
    for canon in sorted(sources):
        by_file[sources[canon].file].append(canon)
    outputs = []
    for f in files:
        saved = in_save_file_order([sources[c] for c in by_file[f]])
        canons = by_file[f] if saved else sorted(by_file[f], key=lambda c: sources[c].offset)
        tensors = [t for c in canons for t in _outputs(sources, c, fmt)]
        if tensors:  # a file of only dropped tensors (bf16: scales) gives no shard, not an empty one
            outputs.append((tensors, saved))
    shards = [lay_out(k, shard_name(k, len(outputs)), t, sort=saved) for k, (t, saved) in enumerate(outputs)]
    weight_map_out = {t.name: f.file for f in shards for t in f.tensors}
    total = sum(nbytes(t.dtype, t.shape) for f in shards for t in f.tensors)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map_out.items()))}
    config = output_config(hf, fmt)
    plan = ConversionPlan(
        str(src.resolve()), 1, EXPERT_DTYPE[fmt], args.dtype, index_sha, config, tuple(shards), stamps
    )
    return ExportPlan(fmt, plan, config, index)


def in_save_file_order(tensors: list[Source]) -> bool:
    """Whether a source file's tensors lie in save_file's order (dtype, then name), as the published shards
    but the Engram tables do. Such a file's shard is laid out in that order again (a tensor that changes
    dtype moves, as save_file would put it); any other file's order is kept, a new scale right after its
    weight, so an Engram shard keeps the table first (published -> bf16 -> fp8-fp4 gives back its bytes)."""
    by_offset = sorted(tensors, key=lambda s: s.offset)
    return by_offset == sorted(tensors, key=lambda s: sort_key(s.name, s.dtype))


def output_config(hf: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The source's config.json with quantization_config for `fmt`: none for bf16, else the source's (the
    published one for a bf16 source) with expert_dtype "fp8" or "fp4"; keys stay in the source's order
    (a new quantization_config goes before text_config, where the published config has it)."""
    quant = None
    if fmt != "bf16":
        quant = dict(hf.get("quantization_config") or HF_QUANTIZATION_CONFIG, expert_dtype=EXPERT_DTYPE[fmt])
    out: dict[str, Any] = {}
    for key, value in hf.items():
        if key == "text_config" and quant is not None and "quantization_config" not in hf:
            out["quantization_config"] = quant
        if key == "quantization_config":
            if quant is not None:
                out[key] = quant
            continue
        out[key] = _as_bf16_dtype(value) if isinstance(value, dict) else value
    return _as_bf16_dtype(out)


def _as_bf16_dtype(config: dict[str, Any]) -> dict[str, Any]:
    """`config` whose dtype keys (transformers' `dtype` / `torch_dtype`) say bfloat16, the float dtype every
    format writes (an F32 fine-tune's config said float32 over BF16 weights: a review)."""
    return {k: "bfloat16" if k in ("dtype", "torch_dtype") and isinstance(v, str) else v for k, v in config.items()}


def _read(s: Source, ratio: int = 1) -> Read:
    rows = s.shape[0] if s.shape else 1
    return Read(s.file, s.name, s.dtype, s.shape, s.offset, 0, rows, ratio=ratio)


def _outputs(sources: dict[str, Source], canon: str, fmt: str) -> list[OutTensor]:
    """The output tensors made from source tensor `canon` (a canonical name), in its file's shard."""
    s = sources[canon]
    rule, pattern = s.rule, s.rule.pattern
    if rule.op in SCALE_OPS:
        w = sources.get(weight_name(canon))
        if w is None:  # pragma: no cover - validate_sources lists every scale's weight
            raise PlanError(f"{s.file}: tensor {s.name} is a scale without its weight")
        action = export_action(w.rule.op, w.dtype, fmt, f"{w.file}: tensor {w.name}")
        if not keeps_scale(action, w.dtype):
            return []
        return [OutTensor(s.name, s.dtype, s.shape, pattern, "copy", (_read(s),))]
    action = export_action(rule.op, s.dtype, fmt, f"{s.file}: tensor {s.name}")
    if action == "copy":
        return [OutTensor(s.name, s.dtype, s.shape, pattern, action, (_read(s),))]
    if action in ("as_published", "as_bf16"):
        dtype = rule.src[0] if action == "as_published" else BF16
        return [OutTensor(s.name, dtype, s.shape, pattern, "copy" if s.dtype == dtype else "cast", (_read(s),))]
    out, inp = s.shape
    block = (1, 32) if rule.op is Op.ENGRAM_ROWS else (32, 32)
    grid = (-(-out // 32), -(-inp // 32))
    scale = sources.get(scale_name(canon))  # the stored scale of a quantized weight
    if action == "dequant_bf16":
        reads = (_read(s), _read(scale, ratio=block[0]))
        return [OutTensor(s.name, BF16, s.shape, pattern, action, reads, block=block)]
    if action == "dequant_fp4":
        return [OutTensor(s.name, BF16, (out, 2 * inp), pattern, action, (_read(s), _read(scale)))]
    if action == "fp4_to_fp8":
        logical = (out, 2 * inp)
        grid8 = (-(-out // 32), -(-logical[1] // 32))
        return _group(s, scale.name, action, (_read(s), _read(scale)), (E4M3, logical), grid8)
    if action == "requant_fp4":
        reads = (_read(s), _read(scale, ratio=32))
        return _group(s, scale.name, action, reads, (I8, (out, inp // 2)), (out, -(-inp // 32)), block)
    new_scale = scale_name(s.name)
    if action == "quant_fp8":
        return _group(s, new_scale, action, (_read(s),), (E4M3, s.shape), grid)
    if action == "quant_rows_fp8":
        return _group(s, new_scale, action, (_read(s),), (E4M3, s.shape), (out, -(-inp // 32)))
    if action == "quant_fp4":  # I8 in the header, as published (the bytes are e2m1 pairs)
        return _group(s, new_scale, action, (_read(s),), (I8, (out, inp // 2)), (out, -(-inp // 32)))
    raise AssertionError(action)  # pragma: no cover - export_rules.EXPORT_ACTIONS lists no other


def _group(s: Source, sname: str, action: str, reads, weight, scale_shape, block=(32, 32)) -> list[OutTensor]:
    """The two outputs of a computing action: the weight (part 0) and its scale (part 1)."""
    (dtype, shape), pattern = weight, s.rule.pattern
    return [
        OutTensor(s.name, dtype, tuple(shape), pattern, action, reads, s.name, 0, block=block),
        OutTensor(sname, E8M0, tuple(scale_shape), pattern, action, reads, s.name, 1, block=block),
    ]


def _before(src: Path, out: Path) -> list[str]:
    """The tokenizer files; a config.json or index of an earlier run goes until this one is done."""
    for name in (CONFIG, INDEX):
        (out / name).unlink(missing_ok=True)
    return copy_tokenizer_files(src, out)


def not_carried(src: Path) -> list[str]:
    """SRC's top-level files and folders that an export does not write (it writes the weights, config.json,
    the index and the tokenizer files): generation_config.json, a chat template, a model card, the published
    repository's encoding/ (its chat encoding) and inference/ folders, named "NAME/" (they went unnamed: an
    audit); hidden ones left out, and the records of a run of ours (an earlier export's manifest.json, a
    share's fragment): copied into OUT, SRC's manifest made `check OUT` fail."""
    written = {CONFIG, INDEX, MANIFEST, *SIDECARS}
    entries = [p for p in Path(src).iterdir() if not p.name.startswith(".")]
    folders = [f"{p.name}/" for p in entries if p.is_dir()]
    files = [
        p.name
        for p in entries
        if p.is_file() and p.suffix != ".safetensors" and p.name not in written and not fnmatch(p.name, FRAGMENT_GLOB)
    ]
    return sorted(files + folders)


def _after(ep: ExportPlan, out: Path) -> list[str]:
    """config.json and the index, once every shard is done."""
    atomic_write(out / CONFIG, (json.dumps(ep.config, indent=2, ensure_ascii=False) + "\n").encode())
    atomic_write(out / INDEX, json.dumps(ep.index, indent=2).encode())  # no newline at the end, as published
    return [CONFIG, INDEX]


def export(
    ep: ExportPlan,
    out: Path,
    *,
    workers: int = 1,
    resume: bool = False,
    overwrite: bool = False,
    device: str = "cpu",
    progress: Progress = lambda label, done, total: None,
    **engine_kw: Any,
) -> dict[str, Any]:
    """Write the export into `out` (see `execute` for workers, resume, overwrite, device, `engine_kw`).

    -> execute's summary, plus format
    """
    sidecars = Sidecars(_before, partial(_after, ep), {"format": ep.format}, records=RECORDS)
    summary = execute(
        ep.plan, out, workers=workers, resume=resume, overwrite=overwrite, device=device, progress=progress,
        sidecars=sidecars, **engine_kw,
    )  # fmt: skip
    return {"format": ep.format, **summary}


def summarize_export(ep: ExportPlan, mine: set[str] | None = None) -> dict[str, Any]:
    """Per output shard (of `mine`, the files this process writes: a torchrun share's; else all): file,
    tensors, bytes, tensors per rule and action (the --dry-run table), and the bytes of those shards."""
    plan = ep.plan
    files = [f for f in plan.files if mine is None or f.file in mine]
    return {
        "src": plan.src,
        "format": ep.format,
        "source_format": plan.source_format,
        "total_bytes": sum(f.nbytes for f in files),
        "files": [file_summary(f) for f in files],
    }
