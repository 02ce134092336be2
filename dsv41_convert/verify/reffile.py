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
    draft_confidence [B, T, K]       float32  (optional) the DSpark confidence head's output beside them
    token_types     [B, S]           int64    (optional) -1 text, 0..3 image span (image prompts)
    hidden.<module> [B, S, ...]      bfloat16 (optional) prefill outputs per module ("embed",
                                              "layers.7.ffn", ...), for localization and teacher forcing;
                                              "vision" (a vision tower): the image spans' rows, 0 elsewhere
    hidden.layers.<i>.pre_mix  [B, S, hc]         float32  (optional) the collapse weights block i hands on
    hidden.layers.<i>.engram   [B, S, hc, dim]    bfloat16 (optional) Engram layers: the stream after Engram
    hidden.layers.<i>.attn.indexer [B, S, k]      int64    (optional) index sources: the chosen compressed rows
    hidden.layers.<i>.attn.candidates [B, S, t]   int8     (optional) the candidate source: 1 inside a kept block
        (k, t = the longest prompt's width; a shorter prompt's extra columns are INDEXER_PAD, -2)
        With these, every block can be run alone on the reference's input (verify.teacher); padding rows are 0.

Metadata (`__metadata__`, strings): format = "dsv41-reference-logits/1", max_seq_len, source_format
("fp8" | "bf16"), device, tp, JSON lists `labels`, `images` (one path or "" per prompt) and `image_sha256`
(the sha256 of each image when the reference ran, or ""; verify refuses a file whose image changed since:
the path alone made a changed image FAIL the conversion), and the JSON
object `provenance` (optional: the model's config, tokenizer digests and what the weights came from,
verify/provenance.py; verify checks CONVERTED against it).
Only input_ids and logits are required; verify compares whatever else is present.

What decides bit equality with a converted run (verify.verdict), all optional, absent = not recorded:
    tp        ranks the reference ran on ("1" when absent)
    device    "cpu" | "cuda"
    threads   torch intra-op threads per rank on the CPU (a CPU matmul's sums depend on it)
    torch     torch.__version__ of the run
    arithmetic what picks the run's kernels (verify/arithmetic.py: the CPU's capability and float instruction
              sets, the variables capping them; on a GPU its model and CUDA version)
    weights   "converted": the values every correct conversion of the source holds (an fp8 source, or a
              bf16 source quantized as `shard` does, `reference-logits --as-converted`);
              "bf16": the unquantized model of a bf16 source (no conversion reproduces it bit for bit).
              Absent: "converted" for source_format fp8, "bf16" for bf16, unknown otherwise.
A file from another implementation states what it knows; each stated field that differs from the
verify run makes bit equality unexpected, so only statistical bounds then judge that comparison.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file
from torch import Tensor

from dsv41_convert.config import ModelArgs
from dsv41_convert.errors import NOT_JSON, OutputError, VerifyInputError
from dsv41_convert.file_kinds import refuse_non_file
from dsv41_convert.model.indexer import effective_block_size, kept_blocks, visible_rows
from dsv41_convert.numbers import ascii_int, counted
from dsv41_convert.store.file_digest import sha256_file
from dsv41_convert.store.machine import MAX_THREADS
from dsv41_convert.store.manifest import temporary_of
from dsv41_convert.store.publish import publish
from dsv41_convert.store.safetensors_header import sort_metadata
from dsv41_convert.verify import provenance
from dsv41_convert.verify.runner import ModelInput, PromptRun, positions_needed

FORMAT = "dsv41-reference-logits/1"
PAD_ID = -1
# name -> (dtype, dims); hidden.<module> tensors are bfloat16 [B, S, ...] except HIDDEN_DTYPES' suffixes
LAYOUT = {
    "input_ids": (torch.int64, 2),
    "logits": (torch.float32, 2),
    "logits_all": (torch.float32, 3),
    "lengths": (torch.int64, 1),
    "decode_ids": (torch.int64, 2),
    "decode_logits": (torch.float32, 3),
    "draft_logits": (torch.float32, 4),
    "draft_confidence": (torch.float32, 3),
    "token_types": (torch.int64, 2),
}
# hidden.<module> by suffix; else bfloat16
HIDDEN_DTYPES = {".pre_mix": torch.float32, ".indexer": torch.int64, ".candidates": torch.int8}
INDEXER_PAD = -2  # columns past a shorter prompt's indexer width (the model writes rows >= 0, or -1: unreachable)
PADDED = (".indexer", ".candidates")  # hidden.<module> suffixes whose width follows the prompt's length
SHAPES = {  # the shape each optional tensor must have, in the sizes the file's own tensors set
    "lengths": ("B",),
    "logits_all": ("B", "S", "V"),
    "token_types": ("B", "S"),
    "decode_ids": ("B", "T+1"),
    "decode_logits": ("B", "T", "V"),
    "draft_logits": ("B", "T", "K", "V"),
    "draft_confidence": ("B", "T", "K"),
}
MAX_PROBLEMS = 40  # lines in one error
MAX_PER_RULE = 5  # examples per rule (prompt, position), then a count


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
    arithmetic: str = ""  # verify.arithmetic of the run; "": not recorded
    weights: str = ""  # "converted" | "bf16" | "": unknown (see the module docstring)
    provenance: dict | None = None  # what it was computed from (verify/provenance.py); None: not recorded

    @property
    def n_decode(self) -> int:
        return max((r.decode_logits.shape[0] for r in self.runs), default=0)


def save(ref: Reference, path: Path, tensors: dict[str, Tensor] | None = None) -> None:
    """Write `ref` in the format above (hidden states included when the runs captured them); `tensors`: its
    file_tensors where the caller built them already."""
    tensors = file_tensors(ref) if tensors is None else tensors
    inputs = ref.inputs
    meta = {
        "format": FORMAT,
        "max_seq_len": str(ref.max_seq_len),
        "source_format": ref.source_format,
        "device": ref.device,
        "tp": str(ref.tp),
        "threads": str(ref.threads),
        "torch": ref.torch_version,
        "arithmetic": ref.arithmetic,
        "weights": ref.weights,
        "labels": json.dumps(ref.labels),
        "images": json.dumps([i.image or "" for i in inputs]),
        # the digest of the bytes the run read (the file may have changed since), else of the file now
        "image_sha256": json.dumps([(i.image_sha256 or sha256_file(Path(i.image))) if i.image else "" for i in inputs]),
    }
    if ref.provenance is not None:
        meta["provenance"] = json.dumps(ref.provenance, sort_keys=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the process's own temporary: OUT.partial was a user's file replaced and renamed away; safetensors opens
    # it by name, so a link or a dead run's file there goes first
    tmp = temporary_of(path)
    tmp.unlink(missing_ok=True)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        sort_metadata(tmp)  # the same run, the same file
        publish(tmp, path)
    except BaseException as exc:  # ENOSPC / EIO at the write (safetensors' own error), the fsync or the rename
        tmp.unlink(missing_ok=True)
        if isinstance(exc, (SafetensorError, OSError)):
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise OutputError(f"{path}: cannot write the reference file ({reason}); nothing written") from exc
        raise


def file_tensors(ref: Reference) -> dict[str, Tensor]:
    """The tensors of `ref`'s file (the format above): the prompts padded to the longest, per-prompt runs
    stacked."""
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
        if all(r.draft_confidence is not None for r in runs):
            out["draft_confidence"] = torch.stack([r.draft_confidence for r in runs]).float()
    if any(i.token_types is not None for i in inputs):
        types = torch.full((b, s), -1, dtype=torch.int64)
        for row, inp in enumerate(inputs):
            if inp.token_types is not None:
                types[row, : lengths[row]] = inp.token_types
        out["token_types"] = types
    # a prompt shorter than the compress ratio runs no indexer and records none: every prompt's keys are
    # written (those of the first alone lost the others' or found one missing: an audit), its row all padding
    for key in dict.fromkeys(k for run in runs for k in run.hidden):
        # a module's output may be wider for a longer prompt (the indexer keeps min(index_topk, n // ratio)
        # rows per position): the widest sets the size, the others are padded
        held = [(row, run.hidden[key]) for row, run in enumerate(runs) if key in run.hidden]
        tail = [max(d) for d in zip(*(part.shape[1:] for _, part in held), strict=True)]
        h = torch.full((b, s, *tail), INDEXER_PAD if key.endswith(PADDED) else 0, dtype=hidden_dtype(key))
        for row, part in held:
            h[(row, slice(0, lengths[row]), *(slice(0, d) for d in part.shape[1:]))] = part
        out[f"hidden.{key}"] = h
    return out


def hidden_dtype(module: str) -> torch.dtype:
    """The dtype of hidden.<module> in the file (the module docstring)."""
    return next((d for suffix, d in HIDDEN_DTYPES.items() if module.endswith(suffix)), torch.bfloat16)


def load(path: Path, default_max_seq_len: int, args: ModelArgs | None = None) -> Reference:
    """Read a reference-logits file, after `validate_reference_file` found nothing wrong with it.

    args: the model the file will be compared with (vocabulary, DSpark block); None checks the file alone.
    Raises VerifyInputError listing every problem, each naming the tensor (and prompt, position).
    """
    path = Path(path)
    t, meta = _read(path)
    problems = _problems(t, meta, args, default_max_seq_len)
    if problems:
        shown = problems[:MAX_PROBLEMS]
        more = [f"... and {len(problems) - MAX_PROBLEMS} more"] if len(problems) > MAX_PROBLEMS else []
        raise VerifyInputError(
            f"{path}: {counted(len(problems), 'problem')} in the reference file "
            "(layout: dsv41_convert/verify/reffile.py):" + "".join(f"\n  {p}" for p in [*shown, *more])
        )
    ids, logits = t["input_ids"], t["logits"]
    b, s = ids.shape
    vocab = logits.shape[1]
    lengths = t.get("lengths", torch.full((b,), s, dtype=torch.int64))
    n_dec = t["decode_logits"].shape[1] if "decode_logits" in t else 0
    labels = json.loads(meta["labels"]) if "labels" in meta else [f"prompt-{i}" for i in range(b)]
    images = json.loads(meta["images"]) if "images" in meta else [""] * b
    inputs, runs = [], []
    for row in range(b):
        n = int(lengths[row])
        types = t["token_types"][row, :n] if "token_types" in t and images[row] else None
        inputs.append(ModelInput(ids[row, :n].clone(), types, None, images[row] or None))
        all_rows = t["logits_all"][row, :n] if "logits_all" in t else logits[row][None]
        runs.append(
            PromptRun(
                logits_all=all_rows,
                decode_ids=t["decode_ids"][row] if "decode_ids" in t else torch.empty(0, dtype=torch.int64),
                decode_logits=t["decode_logits"][row] if n_dec else torch.empty(0, vocab),
                draft_logits=t["draft_logits"][row] if "draft_logits" in t else None,
                draft_confidence=t["draft_confidence"][row] if "draft_confidence" in t else None,
                hidden=_row_hidden(t, row, n),
                last=logits[row],
            )
        )
    source_format = meta.get("source_format", "unknown")
    return Reference(
        inputs,
        runs,
        labels,
        int(meta.get("max_seq_len", default_max_seq_len)),
        source_format,
        meta.get("device", "unknown"),
        has_logits_all="logits_all" in t,
        tp=int(meta.get("tp", 1)),  # both checked by _recorded_fields
        threads=int(meta.get("threads", 0)),
        torch_version=meta.get("torch", ""),
        arithmetic=meta.get("arithmetic", ""),
        weights=meta.get("weights") or {"fp8": "converted", "bf16": "bf16"}.get(source_format, ""),
        provenance=json.loads(meta["provenance"]) if "provenance" in meta else None,  # checked by _recorded_fields
    )


def validate_reference_file(path: Path, args: ModelArgs | None = None, default_max_seq_len: int = 128) -> list[str]:
    """Every problem of a reference-logits file, all at once; [] for a file `load` accepts.

    Catches: an unreadable file or foreign format; a tensor missing, unknown, of another dtype, or of a
    shape the file's own tensors contradict (B and S from input_ids, V from logits, T from decode_ids, K
    from draft_logits or the model's DSpark block), each message naming the tensor that sets the size;
    a vocabulary other than the model's; ids outside it; lengths that disagree with input_ids' padding;
    prompts plus decode steps longer than max_seq_len; NaN or Inf in a hidden.<module>; a hidden.<module>
    the model (`args`) lacks, of another width, or an indexer or candidates value it cannot write (a row past
    the KV, padding inside a width, a position without a kept block); NaN or Inf in any logits tensor (tensor,
    prompt, position); token types outside -1..3; labels and images that are not one string per prompt, image
    files that are not there, and image prompts for a model without a vision tower. Cannot catch: logits that
    are finite and well-shaped but wrong.
    """
    path = Path(path)
    try:
        t, meta = _read(path)
    except VerifyInputError as exc:
        return [str(exc)]
    return _problems(t, meta, args, default_max_seq_len)


def _read(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    refuse_non_file(path, VerifyInputError)
    try:
        # its bytes, not its path: safetensors opens a path only as UTF-8 text, and refused a file in a folder
        # whose name is not ("Path ... is not valid UTF-8"), which Linux allows
        data = path.read_bytes()
        t = load_bytes(data)
    except (OSError, SafetensorError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise VerifyInputError(f"{path}: not a readable safetensors file ({reason})") from exc
    except KeyError as exc:  # a dtype safetensors.torch maps to no torch dtype here (F4, F8_E8M0): a traceback
        raise VerifyInputError(
            f"{path}: holds {exc.args[0]} tensors, which no reference-logits file does (a rank file or a checkpoint "
            "shard?); give the file `dsv41-convert reference-logits` wrote"
        ) from exc
    (n,) = struct.unpack("<Q", data[:8])  # a header load_bytes has read: its length and JSON are sound
    return t, json.loads(data[8 : 8 + n]).get("__metadata__") or {}


def _problems(
    t: dict[str, Tensor], meta: dict[str, str], args: ModelArgs | None, default_max_seq_len: int
) -> list[str]:
    """validate_reference_file's findings for a file read into `t` (tensors) and `meta` (its metadata)."""
    out: list[str] = []
    if meta.get("format", FORMAT) != FORMAT:
        out.append(f"metadata format {meta.get('format')!r}, expected {FORMAT!r}")
    for key in sorted(t):
        x = t[key]
        if key.startswith("hidden."):
            if x.dtype != hidden_dtype(key) or x.dim() < 2:
                out.append(f"{key} is {x.dtype} {list(x.shape)}, expected {hidden_dtype(key)} [B, S, ...]")
        elif key not in LAYOUT:
            out.append(f"{key}: not a tensor of this format (known: {', '.join(LAYOUT)}, hidden.<module>)")
        elif x.dtype != LAYOUT[key][0] or (x.dim() != LAYOUT[key][1] and key not in SHAPES):
            out.append(f"{key} is {x.dtype} {list(x.shape)}, expected {LAYOUT[key][0]} {LAYOUT[key][1]}-d")
        # the shapes of SHAPES' tensors, wrong rank included, are checked below against the sizes that set them
    for key in ("input_ids", "logits"):
        if key not in t:
            out.append(f"no `{key}` tensor; written by `dsv41-convert reference-logits`?")
    if out and any(k not in t or t[k].dim() != 2 or t[k].dtype != LAYOUT[k][0] for k in ("input_ids", "logits")):
        return out  # without input_ids and logits the sizes below are unknown
    ids, logits = t["input_ids"], t["logits"]
    b, s = ids.shape
    v = logits.shape[1]
    if not (b and s and v):
        return [*out, f"input_ids {list(ids.shape)} and logits {list(logits.shape)}: no prompt, token or logit"]
    dims = _Dims(b, s, v, ids.shape, logits.shape)
    if logits.shape[0] != b:
        out.append(f"logits has {logits.shape[0]} rows, input_ids {b} (B = {b}, {dims.origin['B']})")
    vocab = v
    if args is not None and v != args.vocab_size:
        out.append(f"logits: vocab {v} (V, its columns), the model has {args.vocab_size} (vocab_size in config.json)")
        vocab = args.vocab_size
    if "decode_ids" in t and t["decode_ids"].dim() == 2:
        dims.set("T", t["decode_ids"].shape[1] - 1, f"decode_ids {list(t['decode_ids'].shape)} = [B, T + 1]")
    elif "decode_logits" in t and t["decode_logits"].dim() == 3:
        dims.set("T", t["decode_logits"].shape[1], f"decode_logits {list(t['decode_logits'].shape)}")
    if args is not None and args.n_mtp_layers:
        dims.set("K", args.dspark_block_size, "dspark_block_size in config.json")
    elif "draft_logits" in t and t["draft_logits"].dim() == 4:
        dims.set("K", t["draft_logits"].shape[2], f"draft_logits {list(t['draft_logits'].shape)}")
    for key, spec in SHAPES.items():
        if key in t:
            out += dims.check(key, t[key], spec)
    for key in sorted(k for k in t if k.startswith("hidden.") and t[k].dim() >= 2):
        if tuple(t[key].shape[:2]) != (b, s):
            want = f"expected [B, S, ...] = [{b}, {s}, ...] ({dims.why('B', 'S')})"
            out.append(f"{key} has shape {list(t[key].shape)}, {want}")
    if args is not None:
        out += _hidden_against_model(t, b, s, args)
    out += _pairing(t, dims, args)
    out += _ids(t, b, s, vocab, dims)
    out += _lengths_fit(t, meta, b, s, dims, default_max_seq_len)
    out += non_finite(t)
    out += _non_finite_hidden(t)
    out += _token_types(t)
    out += _metadata_lists(meta, t, b, args)
    out += _recorded_fields(meta)
    return out


def hidden_shapes(args: ModelArgs, seq_len: int) -> dict[str, tuple[int, ...]]:
    """Every hidden.<module> the model records (Transformer.forward's hidden_states), with the dims after [B, S] of
    a file whose longest prompt is `seq_len` tokens (PADDED widths: that prompt's)."""
    dim, hc = args.dim, args.hc_mult
    out: dict[str, tuple[int, ...]] = {"embed": (dim,), "norm": (dim,)}
    if args.vision_enabled:
        out["vision"] = (dim,)
    for i in range(args.n_layers):
        out |= {f"layers.{i}": (hc, dim), f"layers.{i}.pre_mix": (hc,), f"layers.{i}.attn": (dim,)}
        out[f"layers.{i}.ffn"] = (dim,)
        if i in args.engram_layer_ids:
            out[f"layers.{i}.engram"] = (hc, dim)
        if i in args.index_source_layers:
            rows = seq_len // args.compress_ratios[i]  # the compressed rows of the whole prompt
            out[f"layers.{i}.attn.indexer"] = (min(args.index_topk, rows),)
            if i == args.candidate_source_layer:
                out[f"layers.{i}.attn.candidates"] = (rows,)
    return out


def _hidden_against_model(t: dict[str, Tensor], b: int, s: int, args: ModelArgs) -> list[str]:
    """hidden.<module> tensors of modules the model has, of its widths, and index choices it can make: another
    model's or an edited file ran the teacher into a rank's traceback (a width), a FAIL of the conversion (a row
    of the KV it has not, padding inside a prompt) or a PASS with a choice the model never makes (a candidates
    value 5, a row without a kept block). Shapes [B, S] and dtypes are checked apart."""
    lengths = t.get("lengths")
    if lengths is None or lengths.dtype != torch.int64 or tuple(lengths.shape) != (b,):
        lengths = torch.full((b,), s, dtype=torch.int64)
    lengths = lengths.clamp(0, s)  # outside 1 .. S: reported by _ids
    known = hidden_shapes(args, int(lengths.max()))
    out = []
    for key in sorted(k for k in t if k.startswith("hidden.")):
        x, module = t[key], key.removeprefix("hidden.")
        if module not in known:
            sources = f"index sources {list(args.index_source_layers)}, candidate source {args.candidate_source_layer}"
            out.append(f"{key}: the model has no such module ({args.n_layers} layers; {sources})")
        elif x.dtype != hidden_dtype(module) or tuple(x.shape[:2]) != (b, s):
            continue  # reported by _problems
        elif tuple(x.shape[2:]) != known[module]:
            out.append(f"{key} has shape {list(x.shape)}, expected {[b, s, *known[module]]} (the model's config.json)")
        elif module.endswith(PADDED):
            ratio = args.compress_ratios[int(module.split(".")[1])]
            out += _choices(key, x, lengths, ratio, args.index_topk)
            if module.endswith(".candidates"):
                out += _candidate_blocks(key, x, lengths, ratio, args.candidate_block_size, args.candidate_topk_blocks)
    return out


def _choices(key: str, x: Tensor, lengths: Tensor, ratio: int, topk: int) -> list[str]:
    """An indexer's or the candidate source's record, as the model writes it for each prompt of `lengths` run alone.

    x: [B, S, k] int64 indexer (rows n + j of a prompt of n tokens, j < (p + 1) // ratio at position p, or -1) or
       [B, S, t] int8 candidates (0 / 1, a kept block wherever (p + 1) // ratio >= 1); INDEXER_PAD past a prompt's
       own width (k = min(topk, n // ratio), t = n // ratio); rows past its length are not read
    """
    out = []
    candidates = key.endswith(".candidates")
    for row, n in enumerate(lengths.tolist()):
        h = x[row, :n].long()  # [n, k or t]
        width = n // ratio if candidates else min(topk, n // ratio)
        seen = visible_rows(n, ratio)  # [n, 1]
        cols = torch.arange(h.shape[1])[None, :]
        if candidates:
            ok = (h == 0) | (h == 1)
        else:
            ok = (h == -1) | ((h >= n) & (h < n + seen))
        ok = torch.where(cols < width, ok, h == INDEXER_PAD)
        bad = (~ok).nonzero().tolist()
        for pos, col in bad[:MAX_PER_RULE]:
            got = int(h[pos, col])
            if col >= width:
                want = f"padding {INDEXER_PAD} past the prompt's width {width}"
            elif candidates:
                want = "0 or 1 (1 inside a kept block)"
            elif int(seen[pos]):
                want = f"-1 or a compressed row {n} .. {n + int(seen[pos]) - 1} (the prompt's {n} rows first)"
            else:
                want = "-1 (no compressed row reachable yet)"
            out.append(f"{key}: prompt {row}, position {pos}, column {col}: {got}, expected {want}")
        out += _more(len(bad), f"{key} values of prompt {row} the model cannot write")
        if candidates and width:
            empty = ((seen[:, 0] >= 1) & ~(h[:, :width] == 1).any(-1)).nonzero().flatten().tolist()
            out += [f"{key}: prompt {row}, position {p}: no kept block (the newest block is always kept)"
                    for p in empty[:MAX_PER_RULE]]  # fmt: skip
            out += _more(len(empty), f"{key} positions of prompt {row} without a kept block")
    return out


def _candidate_blocks(key: str, x: Tensor, lengths: Tensor, ratio: int, block_size: int, topk_blocks: int) -> list[str]:
    """The candidate source's record block by block, as model.indexer.select_candidate_blocks keeps them: whole
    blocks, at most `topk_blocks`, each holding a compressed row visible at that position. A file keeping more
    (an edit, another model's) was forced into the teacher, which then FAILed a correct conversion.

    x: [B, S, t] int8 as _choices'; values other than 1 count as not kept (_choices names them)
    """
    out = []
    for row, n in enumerate(lengths.tolist()):
        if n // ratio:
            kept = x[row, :n, : n // ratio] == 1  # [n, width]
            out += _prompt_candidate_blocks(key, row, kept, ratio, block_size, topk_blocks)
    return out


def _prompt_candidate_blocks(
    key: str, row: int, kept: Tensor, ratio: int, block_size: int, topk_blocks: int
) -> list[str]:
    """_candidate_blocks of one prompt run alone. kept: [n, width] bool, True inside a kept block"""
    size = effective_block_size(block_size, kept.shape[1])
    blocks = kept_blocks(kept, size)  # [n, blocks]
    seen = visible_rows(kept.shape[0], ratio)  # [n, 1]
    partial = blocks.repeat_interleave(size, dim=-1)[:, : kept.shape[1]] != kept
    unseen = blocks & (torch.arange(blocks.shape[1])[None, :] * size >= seen)
    counts = blocks.sum(-1)
    rules = (
        (partial.any(-1), lambda p: f"block {int(partial[p].nonzero()[0]) // size} partly kept (the model keeps "
         f"whole blocks of {size} rows)"),
        (unseen.any(-1), lambda p: f"block {int(unseen[p].nonzero()[0])} kept, past the {int(seen[p])} compressed "
         "rows visible there"),
        (counts > topk_blocks, lambda p: f"{int(counts[p])} blocks kept, the model keeps at most {topk_blocks} "
         "(candidate_topk_blocks)"),
    )  # fmt: skip
    out = []
    for wrong, said in rules:
        at = wrong.nonzero().flatten().tolist()
        out += [f"{key}: prompt {row}, position {p}: {said(p)}" for p in at[:MAX_PER_RULE]]
        out += _more(len(at), f"{key} positions of prompt {row} keeping blocks the model cannot")
    return out


def _int_or_none(text: str) -> int | None:
    """The integer the metadata spells in the digits 0-9 (str.isdigit takes "²" too), else None."""
    try:
        return ascii_int(text)
    except ValueError:
        return None


def _recorded_fields(meta: dict[str, str]) -> list[str]:
    """The metadata that decides bit equality (module docstring): tp >= 1, threads >= 0, a known `weights`."""
    out = []
    for key, least, most in (("tp", 1, None), ("threads", 0, MAX_THREADS)):
        n = _int_or_none(meta[key]) if key in meta else None
        if key in meta and (n is None or n < least or (most is not None and n > most)):
            at_most = "" if most is None else f" and <= {most}"
            out.append(f"metadata {key} {meta[key]!r}: expected an integer >= {least}{at_most}")
    if meta.get("device", "cpu") not in ("cpu", "cuda"):  # "gpu" passed, and dropped the replay (an audit)
        out.append(f"metadata device {meta['device']!r}: expected 'cpu' or 'cuda' (reference-logits --device)")
    if meta.get("weights", "") not in ("", "converted", "bf16"):
        out.append(f"metadata weights {meta['weights']!r}: expected 'converted' or 'bf16'")
    if "provenance" in meta:
        try:
            prov = json.loads(meta["provenance"])
        except ValueError:
            return [*out, "metadata provenance is not JSON"]
        out += provenance.problems(prov)
        ran = prov.get("weights") if isinstance(prov, dict) else None
        tp = meta.get("tp", "1")
        if not out and isinstance(ran, dict) and ran.get("tp") != _int_or_none(tp):
            out.append(  # reference-logits records both from one run: an edit, which blamed CONVERTED (an audit)
                f"metadata tp {tp}, but the weights it ran are recorded for tp {ran.get('tp')} "
                "(provenance.weights.tp): an edited or damaged file; recompute it"
            )
    return out


class _Dims:
    """The sizes B, S, V, T, K of a file, each with the tensor that sets it (for the messages)."""

    def __init__(self, b: int, s: int, v: int, ids_shape, logits_shape) -> None:
        self.size = {"B": b, "S": s, "V": v}
        self.origin = {
            "B": f"input_ids {list(ids_shape)} = [B, S]",
            "S": f"input_ids {list(ids_shape)} = [B, S]",
            "V": f"logits {list(logits_shape)} = [B, V]",
        }

    def set(self, dim: str, size: int, origin: str) -> None:
        self.size[dim], self.origin[dim] = size, origin

    def why(self, *dims: str) -> str:
        return "; ".join(f"{d} = {self.size[d]} from {self.origin[d]}" for d in dims)

    def check(self, key: str, x: Tensor, spec: tuple[str, ...]) -> list[str]:
        """x's shape against spec (letters, or "T+1"), naming the tensor that set each size."""
        letters = [d.removesuffix("+1") for d in spec]
        unknown = sorted({d for d in letters if d not in self.size})
        if unknown:  # the tensor that would set it is malformed itself (reported apart)
            return [f"{key} has shape {list(x.shape)}, expected [{', '.join(spec)}]; no well-formed tensor sets "
                    f"{', '.join(unknown)}"]  # fmt: skip
        want = [self.size[d] + (1 if p.endswith("+1") else 0) for d, p in zip(letters, spec, strict=True)]
        if list(x.shape) == want:
            return []
        used = sorted(set(letters), key=letters.index)
        return [f"{key} has shape {list(x.shape)}, expected {want} = [{', '.join(spec)}] ({self.why(*used)})"]


def _pairing(t: dict[str, Tensor], dims: _Dims, args: ModelArgs | None) -> list[str]:
    out = []
    if "decode_logits" in t and "decode_ids" not in t:
        out.append("decode_logits without decode_ids (the tokens the steps fed)")
    if "decode_ids" in t and "decode_logits" not in t and dims.size.get("T", 0) > 0:
        out.append(f"decode_ids holds T = {dims.size['T']} steps ({dims.origin['T']}), but there is no decode_logits")
    if "draft_logits" in t and "decode_logits" not in t:
        out.append("draft_logits without decode_logits (drafts follow the decode steps)")
    if "draft_logits" in t and args is not None and not args.n_mtp_layers:
        out.append("draft_logits, but the model has no DSpark stages (num_nextn_predict_layers 0)")
    return out


def _ids(t: dict[str, Tensor], b: int, s: int, vocab: int, dims: _Dims) -> list[str]:
    """Prompt ids inside the vocabulary, padding (-1) only after each prompt's length; decode ids too."""
    out = []
    ids = t["input_ids"]
    lengths = t.get("lengths")
    if lengths is not None and (lengths.dtype != torch.int64 or tuple(lengths.shape) != (b,)):
        lengths = None  # reported above
    if lengths is not None:
        for row in (((lengths < 1) | (lengths > s)).nonzero().flatten().tolist())[:MAX_PER_RULE]:
            out.append(f"lengths[{row}] = {int(lengths[row])}, expected 1 .. S = {s} ({dims.why('S')})")
        lengths = lengths.clamp(0, s)
    n = lengths if lengths is not None else torch.full((b,), s, dtype=torch.int64)
    inside = torch.arange(s)[None, :] < n[:, None]  # [B, S]
    bad = inside & ((ids < 0) | (ids >= vocab))
    for row, pos in bad.nonzero().tolist()[:MAX_PER_RULE]:
        got = int(ids[row, pos])
        what = f"padding ({PAD_ID}) inside the prompt" if got == PAD_ID else f"outside the vocabulary 0 .. {vocab - 1}"
        length = f"length {int(n[row])} from " + ("lengths" if lengths is not None else "S: no lengths tensor")
        out.append(f"input_ids: prompt {row}, position {pos}: id {got}, {what} ({length})")
    out += _more(int(bad.sum()), "input_ids ids outside 0 .. vocab - 1")
    pad = ~inside & (ids != PAD_ID)
    for row, pos in pad.nonzero().tolist()[:MAX_PER_RULE]:
        got = int(ids[row, pos])
        out.append(f"input_ids: prompt {row}, position {pos}: id {got} after its length {int(n[row])} (lengths), "
                   f"expected padding {PAD_ID}")  # fmt: skip
    out += _more(int(pad.sum()), "input_ids ids after a prompt's length")
    dec = t.get("decode_ids")
    if dec is not None and dec.dtype == torch.int64 and dec.dim() == 2:
        bad = (dec < 0) | (dec >= vocab)
        for row, step in bad.nonzero().tolist()[:MAX_PER_RULE]:
            got = int(dec[row, step])
            out.append(f"decode_ids: prompt {row}, step {step}: id {got} outside the vocabulary 0 .. {vocab - 1}")
        out += _more(int(bad.sum()), "decode_ids ids outside the vocabulary")
    return out


def _lengths_fit(t, meta, b: int, s: int, dims: _Dims, default_max_seq_len: int) -> list[str]:
    """Each prompt plus its decode steps inside the runtime max_seq_len both sides are built with."""
    try:
        max_seq_len = int(meta.get("max_seq_len", default_max_seq_len))
    except ValueError:
        return [f"metadata max_seq_len {meta['max_seq_len']!r} is not an integer"]
    if max_seq_len < 1:
        return [f"metadata max_seq_len {max_seq_len} must be at least 1"]
    lengths = t.get("lengths")
    n = lengths if lengths is not None and tuple(lengths.shape) == (b,) else torch.full((b,), s, dtype=torch.int64)
    steps = dims.size.get("T", 0)
    out = []
    for row in range(b):
        drafts = dims.size.get("K", 0) if steps else 0  # the positions the drafts take after the last step
        need = positions_needed(int(n[row]), steps, drafts)
        if need > max_seq_len:
            out.append(
                f"prompt {row}: {int(n[row])} tokens + {steps} decode steps"
                f"{f' + {drafts} draft positions' if drafts else ''} need max_seq_len >= {need}, "
                f"the file says {max_seq_len}"
            )
    return out[:MAX_PER_RULE] + _more(len(out), "prompts too long for max_seq_len")


def _row_hidden(t: dict[str, Tensor], row: int, n: int) -> dict[str, Tensor]:
    """Prompt `row`'s hidden states (its `n` positions), without an indexer it did not run: a row all
    INDEXER_PAD is a prompt shorter than the compress ratio, which recorded none (file_tensors)."""
    out = {k[7:]: _unpadded(k, v[row, :n]) for k, v in t.items() if k.startswith("hidden.")}
    return {k: v for k, v in out.items() if not (k.endswith(PADDED) and v.dim() >= 2 and v.shape[-1] == 0)}


def _unpadded(key: str, h: Tensor) -> Tensor:
    """One prompt's hidden.<module> rows without the columns save() padded (PADDED: INDEXER_PAD)."""
    if not key.endswith(PADDED) or h.dim() < 2:
        return h
    width = int((h != INDEXER_PAD).any(0).sum()) if h.numel() else h.shape[-1]
    return h[..., :width]


def non_finite(t: dict[str, Tensor]) -> list[str]:
    """NaN or Inf in a reference file's logits, decode, draft and confidence tensors (file_tensors, or a loaded
    file), by prompt and position: verify refuses such a file (validate_reference_file), and reference-logits
    does not write it."""
    out = []
    for key in ("logits", "logits_all", "decode_logits", "draft_logits", "draft_confidence"):
        if key in t and t[key].is_floating_point() and t[key].dim() == LAYOUT[key][1]:
            out += _non_finite(key, t[key])
    return out


def _non_finite_hidden(t: dict[str, Tensor]) -> list[str]:
    """NaN or Inf in a hidden.<module> of floats (bfloat16 outputs, float32 pre_mix: [B, S, ...]), by prompt and
    position: the teacher forced them into the next module and FAILed the conversion ("teacher layers.0.ffn: nan
    bf16 ulps"), where the file is what is wrong."""
    out = []
    for key in sorted(k for k in t if k.startswith("hidden.") and t[k].is_floating_point() and t[k].dim() >= 2):
        bad = ~torch.isfinite(t[key])
        rows = bad.flatten(2).any(-1).nonzero().tolist() if bad.dim() > 2 else bad.nonzero().tolist()
        out += [f"{key}: prompt {r}, position {p}: NaN or Inf" for r, p in rows[:MAX_PER_RULE]]
        out += _more(len(rows), f"{key} positions with NaN or Inf")
    return out


def _non_finite(key: str, x: Tensor) -> list[str]:
    """NaN or Inf in a logits tensor, by prompt and position (or decode step, draft token)."""
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return []
    rows = bad.any(-1).nonzero().tolist()  # indices without the vocab dim
    names = {"logits": ("prompt",), "logits_all": ("prompt", "position"), "decode_logits": ("prompt", "decode step"),
             "draft_logits": ("prompt", "decode step", "draft token"),
             "draft_confidence": ("prompt", "decode step")}[key]  # fmt: skip
    out = []
    for idx in rows[:MAX_PER_RULE]:
        where = ", ".join(f"{n} {i}" for n, i in zip(names, idx, strict=True))
        values = x[tuple(idx)]
        kinds = sorted(
            {"NaN" if bool(values.isnan().any()) else "", "Inf" if bool(values.isinf().any()) else ""} - {""}
        )
        out.append(
            f"{key}: {where}: {'/'.join(kinds)} ({int((~torch.isfinite(values)).sum())} of {values.numel()} logits)"
        )
    return out + _more(len(rows), f"{key} rows with non-finite logits")


def _token_types(t: dict[str, Tensor]) -> list[str]:
    types = t.get("token_types")
    if types is None or types.dtype != torch.int64 or types.dim() != 2:
        return []
    bad = (types < -1) | (types > 3)
    out = [f"token_types: prompt {r}, position {p}: {int(types[r, p])}, expected -1 (text) or 0 .. 3 (image span)"
           for r, p in bad.nonzero().tolist()[:MAX_PER_RULE]]  # fmt: skip
    return out + _more(int(bad.sum()), "token_types outside -1 .. 3")


def _metadata_lists(meta: dict[str, str], t: dict[str, Tensor], b: int, args: ModelArgs | None) -> list[str]:
    """Labels, images and image digests: one string per prompt, each image there, unchanged, with its token
    types, and a vision tower in the model (`args`; None: not checked) to run it."""
    out = []
    lists = {}
    for key in ("labels", "images", "image_sha256"):
        if key not in meta:
            continue
        try:
            value = json.loads(meta[key])
        except NOT_JSON:
            out.append(f"metadata {key} is not JSON")
            continue
        if not isinstance(value, list) or len(value) != b or not all(isinstance(v, str) for v in value):
            out.append(f"metadata {key} must be a list of {b} strings (B = {b}, rows of input_ids)")
            continue
        lists[key] = value
    digests = lists.get("image_sha256", [""] * b)
    for row, image in enumerate(lists.get("images", [])):
        if image and not Path(image).is_file():
            out.append(f"metadata images[{row}] = {image!r}: no such file (prompt {row} is an image prompt)")
        elif image and digests[row] and sha256_file(Path(image)) != digests[row]:
            out.append(
                f"metadata images[{row}] = {image!r}: not the image this file was computed with (sha256 "
                f"{digests[row][:12]}...): restore it, or compute the reference again"
            )
        if image and args is not None and not args.vision_enabled:  # its ranks ended in a ZeroDivisionError
            out.append(
                f"metadata images[{row}] = {image!r}: an image prompt, but the model has no vision tower "
                "(vision_config in config.json)"
            )
        if image and "token_types" not in t:
            out.append(f"metadata images[{row}] = {image!r}, but there is no token_types tensor for its image span")
    if "token_types" in t and ("images" in lists or "images" not in meta):
        images, types = lists.get("images", [""] * b), t["token_types"]
        for r in range(min(b, types.shape[0])):  # the prompt ran as text, and a correct conversion FAILed (an audit)
            if not images[r] and bool((types[r] >= 0).any()):
                out.append(f"token_types: prompt {r} holds an image span, but metadata images names no image for it")
    return out


def _more(count: int, what: str) -> list[str]:
    return [f"... {count - MAX_PER_RULE} more {what}"] if count > MAX_PER_RULE else []
