"""The reference-logits file: what `reference-logits SRC OUT` writes and `verify --reference-logits` reads.

A safetensors file. B prompts, S = longest prompt, T decode steps, K draft tokens, V vocab:

    input_ids       [B, S]           int64    prompt ids, right-padded with -1 where a prompt is shorter
    logits          [B, V]           float32  logits at each prompt's last position
    logits_all      [B, S, V]        float32  (optional) every prompt position; padding rows are 0
    lengths         [B]              int64    (optional) prompt lengths; absent means every prompt is S long
    decode_ids      [B, T + 1]       int64    (optional) greedy tokens: [:, 0] after the prefill, [:, t + 1]
                                              after decode step t. Step t feeds decode_ids[:, t]
    decode_logits   [B, T, V]        float32  (optional) logits after each decode step
    draft_logits    [B, T, K, V]     float32  (optional) DSpark draft logits after each decode step
    token_types     [B, S]           int64    (optional) -1 text, 0..3 image span (image prompts)
    hidden.<module> [B, S, ...]      bfloat16 (optional) prefill outputs per module ("embed",
                                              "layers.7.ffn", ...), for localization

Metadata (`__metadata__`, strings): format = "dsv41-reference-logits/1", max_seq_len, source_format
("fp8" | "bf16"), device, tp, and JSON lists `labels` and `images` (one path or "" per prompt).
Only input_ids and logits are required; verify compares whatever else is present.

What decides bit equality with a converted run (verify.verdict), all optional, absent = not recorded:
    tp        ranks the reference ran on ("1" when absent)
    device    "cpu" | "cuda"
    threads   torch intra-op threads per rank on the CPU (a CPU matmul's sums depend on it)
    torch     torch.__version__ of the run
    weights   "converted": the values every correct conversion of the source holds (an fp8 source, or a
              bf16 source quantized as `shard` does, `reference-logits --as-converted`);
              "bf16": the unquantized model of a bf16 source (no conversion reproduces it bit for bit).
              Absent: "converted" for source_format fp8, "bf16" for bf16, unknown otherwise.
A file from another implementation states what it knows; each stated field that differs from the
verify run makes bit equality unexpected, so only statistical bounds then judge that comparison.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.verify.runner import ModelInput, PromptRun

FORMAT = "dsv41-reference-logits/1"
PAD_ID = -1


@dataclass
class Reference:
    """Reference outputs for B prompts, whether computed here or read from a file."""

    inputs: list[ModelInput]
    runs: list[PromptRun]
    labels: list[str]
    max_seq_len: int
    source_format: str  # "fp8" | "bf16" | "unknown"
    device: str
    has_logits_all: bool = True
    tp: int = 1
    threads: int = 0  # torch threads per rank on the CPU; 0: not recorded
    torch_version: str = ""  # "": not recorded
    weights: str = ""  # "converted" | "bf16" | "": unknown (see the module docstring)

    @property
    def n_decode(self) -> int:
        return max((r.decode_logits.shape[0] for r in self.runs), default=0)


def save(ref: Reference, path: Path) -> None:
    """Write `ref` in the format above (hidden states included when the runs captured them)."""
    runs, inputs = ref.runs, ref.inputs
    b, s = len(runs), max(len(i.input_ids) for i in inputs)
    vocab = runs[0].logits_all.shape[-1]
    lengths = torch.tensor([len(i.input_ids) for i in inputs], dtype=torch.int64)
    ids = torch.full((b, s), PAD_ID, dtype=torch.int64)
    logits_all = torch.zeros(b, s, vocab, dtype=torch.float32)
    for row, (inp, run) in enumerate(zip(inputs, runs, strict=True)):
        ids[row, : lengths[row]] = inp.input_ids
        logits_all[row, : lengths[row]] = run.logits_all
    out = {
        "input_ids": ids,
        "logits": torch.stack([r.logits for r in runs]).float(),  # PromptRun.last
        "logits_all": logits_all,
    }
    if bool((lengths != s).any()):
        out["lengths"] = lengths
    if ref.n_decode:
        out["decode_ids"] = torch.stack([r.decode_ids for r in runs])
        out["decode_logits"] = torch.stack([r.decode_logits for r in runs]).float()
        if all(r.draft_logits is not None for r in runs):
            out["draft_logits"] = torch.stack([r.draft_logits for r in runs]).float()
    if any(i.token_types is not None for i in inputs):
        types = torch.full((b, s), -1, dtype=torch.int64)
        for row, inp in enumerate(inputs):
            if inp.token_types is not None:
                types[row, : lengths[row]] = inp.token_types
        out["token_types"] = types
    for key in runs[0].hidden:
        first = runs[0].hidden[key]
        h = torch.zeros(b, s, *first.shape[1:], dtype=torch.bfloat16)
        for row, run in enumerate(runs):
            h[row, : lengths[row]] = run.hidden[key]
        out[f"hidden.{key}"] = h
    meta = {
        "format": FORMAT,
        "max_seq_len": str(ref.max_seq_len),
        "source_format": ref.source_format,
        "device": ref.device,
        "tp": str(ref.tp),
        "threads": str(ref.threads),
        "torch": ref.torch_version,
        "weights": ref.weights,
        "labels": json.dumps(ref.labels),
        "images": json.dumps([i.image or "" for i in inputs]),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp), metadata=meta)
    tmp.replace(path)


def load(path: Path, default_max_seq_len: int) -> Reference:
    """Read a reference-logits file; VerifyInputError names the file and what is wrong with it."""
    path = Path(path)
    try:
        t = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise VerifyInputError(f"{path}: not a readable safetensors file ({exc})") from exc
    if meta.get("format", FORMAT) != FORMAT:
        raise VerifyInputError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    for key, dt, ndim in (("input_ids", torch.int64, 2), ("logits", torch.float32, 2)):
        if key not in t:
            raise VerifyInputError(f"{path}: no `{key}` tensor; written by `dsv41-convert reference-logits`?")
        if t[key].dtype != dt or t[key].dim() != ndim:
            raise VerifyInputError(f"{path}: {key} is {t[key].dtype} {list(t[key].shape)}, expected {dt} {ndim}-d")
    ids, logits = t["input_ids"], t["logits"]
    b, s = ids.shape
    vocab = logits.shape[1]
    if logits.shape[0] != b:
        raise VerifyInputError(f"{path}: logits has {logits.shape[0]} rows, input_ids {b}")
    lengths = t.get("lengths", torch.full((b,), s, dtype=torch.int64))
    _shape(path, t, "lengths", (b,))
    _shape(path, t, "logits_all", (b, s, vocab))
    _shape(path, t, "token_types", (b, s))
    n_dec = t["decode_logits"].shape[1] if "decode_logits" in t else 0
    _shape(path, t, "decode_logits", (b, n_dec, vocab))
    if "decode_logits" in t and "decode_ids" not in t:
        raise VerifyInputError(f"{path}: decode_logits without decode_ids (the tokens the steps fed)")
    _shape(path, t, "decode_ids", (b, n_dec + 1))
    if "draft_logits" in t:
        k = t["draft_logits"].shape[2] if t["draft_logits"].dim() == 4 else -1
        _shape(path, t, "draft_logits", (b, n_dec, k, vocab))
    labels = _json_list(path, meta, "labels", b, [f"prompt-{i}" for i in range(b)])
    images = _json_list(path, meta, "images", b, [""] * b)
    inputs, runs = [], []
    for row in range(b):
        n = int(lengths[row])
        row_ids = ids[row, :n]
        if not 0 < n <= s or bool((row_ids < 0).any()):
            raise VerifyInputError(f"{path}: prompt {row} has length {n} or negative ids inside it")
        types = t["token_types"][row, :n] if "token_types" in t and images[row] else None
        inputs.append(ModelInput(row_ids.clone(), types, None, images[row] or None))
        all_rows = t["logits_all"][row, :n] if "logits_all" in t else logits[row][None]
        runs.append(
            PromptRun(
                logits_all=all_rows,
                decode_ids=t["decode_ids"][row] if "decode_ids" in t else torch.empty(0, dtype=torch.int64),
                decode_logits=t["decode_logits"][row] if n_dec else torch.empty(0, vocab),
                draft_logits=t["draft_logits"][row] if "draft_logits" in t else None,
                hidden={k[7:]: v[row, :n] for k, v in t.items() if k.startswith("hidden.")},
                last=logits[row],
            )
        )
    try:
        max_seq_len = int(meta.get("max_seq_len", default_max_seq_len))
    except ValueError as exc:
        raise VerifyInputError(f"{path}: metadata max_seq_len {meta['max_seq_len']!r} is not an integer") from exc
    source_format = meta.get("source_format", "unknown")
    return Reference(
        inputs,
        runs,
        labels,
        max_seq_len,
        source_format,
        meta.get("device", "unknown"),
        has_logits_all="logits_all" in t,
        tp=_int_meta(path, meta, "tp", 1),
        threads=_int_meta(path, meta, "threads", 0),
        torch_version=meta.get("torch", ""),
        weights=meta.get("weights") or {"fp8": "converted", "bf16": "bf16"}.get(source_format, ""),
    )


def _int_meta(path: Path, meta: dict[str, str], key: str, default: int) -> int:
    try:
        value = int(meta.get(key, default))
    except ValueError as exc:
        raise VerifyInputError(f"{path}: metadata {key} {meta[key]!r} is not an integer") from exc
    if value < 0:
        raise VerifyInputError(f"{path}: metadata {key} {value} is negative")
    return value


def _shape(path: Path, t: dict[str, Tensor], key: str, want: tuple[int, ...]) -> None:
    if key in t and tuple(t[key].shape) != want:
        raise VerifyInputError(f"{path}: {key} has shape {list(t[key].shape)}, expected {list(want)}")


def _json_list(path: Path, meta: dict[str, str], key: str, n: int, default: list[str]) -> list[str]:
    if key not in meta:
        return default
    try:
        value = json.loads(meta[key])
    except json.JSONDecodeError as exc:
        raise VerifyInputError(f"{path}: metadata {key} is not JSON") from exc
    if not isinstance(value, list) or len(value) != n or not all(isinstance(v, str) for v in value):
        raise VerifyInputError(f"{path}: metadata {key} must be a list of {n} strings")
    return value
