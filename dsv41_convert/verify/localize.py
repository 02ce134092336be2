"""Where a failing conversion goes wrong: first the module, then (with the source at hand) the tensor.

1. `first_divergence`: walk the prefill outputs of every module in forward order ("vision" where the
   model has a vision tower, "embed", "layers.0.attn", "layers.0.ffn", "layers.0", ..., "norm") and name
   the first whose relative L2
   error against the reference exceeds the mode's tolerance (0 in exact mode: the first bit that
   differs). Everything before it agrees, so the fault is in that module or its inputs' weights.
2. `diff_tensors`: read every converted rank file, reassemble each tensor to its tp-1 form by its
   rule's split (concatenate dim 0 / dim 1, take the owning rank of an expert, drop Engram padding
   rows, and check that replicated tensors are equal on every rank), and compare it with the tensor
   the converter would write at tp 1 from the source (verify.source.expected_shards). Values are
   compared as numbers (fp4 and fp8 decoded, so +0 and -0 agree), e8m0 scales as bytes (said as the
   scales they mean: 2**0 vs 2**1).
   Tensors belonging to the diverging module are listed first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41_convert.convert.plan import fill_text, pad_byte
from dsv41_convert.convert.rules import Split, match_rule, split_dim
from dsv41_convert.convert.unshard import RankFiles
from dsv41_convert.numbers import e8m0_text
from dsv41_convert.quant.file_dtypes import TORCH_TO_SAFETENSORS
from dsv41_convert.verify.metrics import relative_error

_LAYER_KEY = re.compile(r"layers\.(\d+)(?:\.(engram|attn|ffn))?$")


def module_order(key: str) -> tuple[int, int]:
    """Forward order of a hidden-state key."""
    if key == "vision":  # the image spans' rows, before the token embeddings join them in "embed"
        return (-2, 0)
    if key == "embed":
        return (-1, 0)
    m = _LAYER_KEY.match(key)
    if m:
        return (int(m.group(1)), {"engram": 0, "attn": 1, "ffn": 2, None: 3}[m.group(2)])
    if key == "head":  # the logits, computed from the final norm's output
        return (1 << 30, 1)
    return (1 << 30, 0)  # "norm"


_TEACHER_PART = re.compile(r"(layers\.\d+)\.(attn\.indexer|attn\.candidates|pre_mix)$")


def module_of_output(key: str) -> str:
    """The module whose output a teacher-check key measures: "logits" -> "head" (the head runs on the
    reference's final norm), "layers.1.attn.indexer" and "layers.1.attn.candidates" -> "layers.1.attn" (its
    top-k and candidate blocks are part of the attention),
    "layers.1.pre_mix" -> "layers.1.ffn" (the collapse weights the block hands on come from its FFN side's hc
    mixing, `layers.1.hc_ffn_*`, which `module_of` names so); any other key is a module's own name."""
    if key == "logits":
        return "head"
    m = _TEACHER_PART.match(key)
    if m:
        return f"{m.group(1)}.{'ffn' if m.group(2) == 'pre_mix' else 'attn'}"
    return key


def first_divergence(
    ref_hidden: list[dict[str, Tensor]], conv_hidden: list[dict[str, Tensor]], rtol: float
) -> tuple[str | None, list[tuple[str, float]]]:
    """-> (first module whose worst relative error over prompts exceeds rtol, or None;
    [(module, worst relative error)] in forward order)"""
    common = set().union(*ref_hidden) & set().union(*conv_hidden)
    # the module outputs (Engram's too: the stream after it); pre_mix and the indexer's choice are teacher inputs
    keys = sorted((k for k in common if k in ("vision", "embed", "norm") or _LAYER_KEY.match(k)), key=module_order)
    errors = []
    first = None
    for key in keys:
        pairs = [(r[key], c[key]) for r, c in zip(ref_hidden, conv_hidden, strict=True) if key in r and key in c]
        worst = max((relative_error(a, b) for a, b in pairs), default=0.0)
        errors.append((key, worst))
        if first is None and worst > rtol:
            first = key
    return first, errors


def scope(module: str, n_layers: int) -> tuple[str, ...]:
    """Name prefixes of the weights that produce `module`'s output (its own, its norm and mixes)."""
    if module == "vision":
        return ("vision.", "aligner.", "image_")
    if module == "embed":
        return ("embed.",)
    if module == "norm":
        return ("norm.", f"layers.{n_layers - 1}.hc_")
    if module == "head":
        return ("head.",)
    if module == "mtp":
        return ("mtp.",)
    m = _LAYER_KEY.match(module)
    if not m:
        return ()
    i, part = int(m.group(1)), m.group(2)
    if part == "engram":
        return (f"layers.{i}.engram.",)
    if part == "attn":
        return (f"layers.{i}.attn.", f"layers.{i}.attn_norm.", f"layers.{i}.hc_attn", f"layers.{i - 1}.hc_ffn")
    if part == "ffn":
        return (f"layers.{i}.ffn.", f"layers.{i}.ffn_norm.", f"layers.{i}.hc_")
    return (f"layers.{i}.",)


def module_of(name: str, n_layers: int) -> str | None:
    """The first module, in forward order, whose `scope` holds the weight `name` (layers.1.attn.wkv.scale ->
    layers.1.attn, layers.3.ffn_norm.weight -> layers.3.ffn, norm.weight -> norm, as the hidden states name its
    output); None for a weight of no module's scope."""
    parts = ("engram", "attn", "ffn")
    modules = [
        "vision",
        "embed",
        *(f"layers.{i}.{part}" for i in range(n_layers) for part in parts),
        "norm",
        "head",
        "mtp",
    ]
    return next((m for m in modules if name.startswith(scope(m, n_layers))), None)


@dataclass(frozen=True)
class TensorDiff:
    name: str
    ranks: tuple[int, ...]  # rank files holding the differing part
    what: str  # "12 of 16384 values differ, max |diff| 3.5" / "shape [..] vs [..]" / "missing"
    in_scope: bool = False

    def to_json(self) -> dict:
        return {"name": self.name, "ranks": list(self.ranks), "what": self.what, "in_module": self.in_scope}


@dataclass
class Localization:
    module: str | None = None
    module_errors: list[tuple[str, float]] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict:
        return {
            "module": self.module,
            "module_errors": [{"module": k, "rel_err": v} for k, v in self.module_errors],
            "tensors": [t.to_json() for t in self.tensors],
            "note": self.note,
        }


def read_rank_files(ranks: RankFiles) -> list[dict[str, Tensor]]:
    """Every tensor of every rank file, in the file dtype (F4 as float4_e2m1fn_x2 [.., last / 2])."""
    return [{name: ranks.read(r, name) for name in h.tensors} for r, h in enumerate(ranks.headers)]


def _values(t: Tensor) -> Tensor:
    """Comparable float64 values: fp4 pairs decoded, e8m0 as its raw byte."""
    if t.dtype == torch.float4_e2m1fn_x2:
        from dsv41_convert.quant.fp4 import decode_e2m1, unpack_nibbles

        return decode_e2m1(unpack_nibbles(t)).double()
    if t.dtype == torch.float8_e8m0fnu:
        return t.view(torch.uint8).double()
    return t.double()


def _compare(name: str, got: Tensor, want: Tensor) -> str | None:
    """None when equal, else a short description."""
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} vs expected {want.dtype}"
    if got.shape != want.shape:
        return f"shape {list(got.shape)} vs expected {list(want.shape)}"
    a, b = _values(got), _values(want)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(same.all()):
        return None
    bad = ~same
    first = [int(i) for i in bad.nonzero()[0]]
    diff = (a - b).abs()[bad]
    if got.dtype == torch.float8_e8m0fnu:  # the bytes are exponents: say the scales they mean
        g, w = int(a[tuple(first)]), int(b[tuple(first)])
        finite = bad & (a != 255) & (b != 255)  # NaN (byte 255) is no exponent
        step = f", largest exponent step {int((a - b).abs()[finite].max())}" if bool(finite.any()) else ""
        return (
            f"{int(bad.sum())} of {a.numel()} scales differ (first at {first}: {e8m0_text(g)} vs expected "
            f"{e8m0_text(w)}, bytes {g} vs {w}){step}"
        )
    return f"{int(bad.sum())} of {a.numel()} values differ (first at {first}), max |diff| {diff.max().item():.4g}"


def diff_tensors(
    ranks: list[dict[str, Tensor]], expected: dict[str, Tensor], module_scope: tuple[str, ...]
) -> list[TensorDiff]:
    """Reassemble each tensor over the ranks and compare with `expected` (the tp-1 output)."""
    tp = len(ranks)
    diffs = []
    names = sorted(set(expected) | set().union(*ranks))
    for name in names:
        in_scope = name.startswith(module_scope) if module_scope else False
        holders = tuple(r for r in range(tp) if name in ranks[r])
        if name not in expected:
            diffs.append(TensorDiff(name, holders, "not expected in the output", in_scope))
            continue
        want = expected[name]
        if not holders:
            diffs.append(TensorDiff(name, (), "missing from every rank file", in_scope))
            continue
        split = match_rule(name).split
        parts = [ranks[r][name] for r in holders]
        problem, culprits = None, holders
        if split is Split.NONE:  # every copy compared: one changed on all ranks names them all
            found = {r: _compare(name, p, want) for r, p in zip(holders, parts, strict=True)}
            bad = tuple(r for r, said in found.items() if said)
            if bad:
                problem, culprits = found[bad[0]], bad
            if not problem and len(holders) != tp:
                problem = f"replicated tensor missing on ranks {sorted(set(range(tp)) - set(holders))}"
        elif split is Split.EXPERT:
            problem = _compare(name, parts[0], want) if len(holders) == 1 else f"held by ranks {list(holders)}"
        elif any(p.dim() <= split_dim(split) for p in parts):  # reading that dim was an IndexError (a traceback)
            culprits = tuple(r for r, p in zip(holders, parts, strict=True) if p.dim() <= split_dim(split))
            found = ", ".join(f"rank {r}: {list(ranks[r][name].shape)}" for r in culprits)
            problem = f"a {split} split cuts dim {split_dim(split)}; found {found}"
        elif split is Split.ROWS_PADDED and any(p.shape[0] != -(-want.shape[0] // tp) for p in parts):
            k = -(-want.shape[0] // tp)
            culprits = tuple(r for r, p in zip(holders, parts, strict=True) if p.shape[0] != k)
            found = ", ".join(f"rank {r}: {ranks[r][name].shape[0]}" for r in culprits)
            problem = f"rows per rank must be ceil({want.shape[0]}/{tp}) = {k}, the last rank padded; found {found}"
        else:
            try:
                dim = split_dim(split)
                whole = torch.cat([p.view(torch.uint8) if p.dtype.itemsize == 1 else p for p in parts], dim=dim)
                whole = whole.view(parts[0].dtype) if parts[0].dtype.itemsize == 1 else whole
                if split is Split.ROWS_PADDED:
                    problem, culprits = _padding(whole, want.shape[0], holders, parts[0].shape[0])
                    whole = whole[: want.shape[0]]
                problem = _compare(name, whole, want) or problem
            except RuntimeError as exc:
                problem = f"rank pieces do not concatenate ({exc})"
            if problem and " differ (first at " in problem:  # values or scales (_compare), not a shape
                culprits = _ranks_of(parts, holders, want, split)
        if problem:
            diffs.append(TensorDiff(name, culprits, problem, in_scope))
    diffs.sort(key=lambda d: not d.in_scope)
    return diffs


def _padding(whole: Tensor, rows: int, holders: tuple[int, ...], per_rank: int) -> tuple[str | None, tuple[int, ...]]:
    """An Engram table's padding rows (past its `rows` config rows, on the last ranks) against the converter's
    fill: (the problem, the ranks holding padding) where they differ, else (None, holders)."""
    pad = whole[rows:].contiguous().view(torch.uint8)
    fill = pad_byte(TORCH_TO_SAFETENSORS[whole.dtype])
    if not pad.numel() or bool((pad == fill).all()):
        return None, holders
    last = tuple(r for r in holders if (r + 1) * per_rank > rows)
    fill_said = fill_text(TORCH_TO_SAFETENSORS[whole.dtype])
    return f"padding rows {rows}..{whole.shape[0] - 1} are not the fill byte {fill_said}", last


def _ranks_of(parts: list[Tensor], holders: tuple[int, ...], want: Tensor, split: Split) -> tuple[int, ...]:
    """The ranks whose slice of a split tensor differs from the matching slice of `want`."""
    dim = split_dim(split)
    out, pos = [], 0
    for r, p in zip(holders, parts, strict=True):
        n = p.shape[dim]
        piece = want.narrow(dim, pos, min(n, want.shape[dim] - pos)) if pos < want.shape[dim] else None
        got = p.narrow(dim, 0, piece.shape[dim]) if piece is not None else None
        if piece is None or _compare("", got, piece):
            out.append(r)
        pos += n
    return tuple(out)
