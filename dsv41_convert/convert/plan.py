"""The conversion plan: from headers and the index only, the exact layout of every output rank file.

`build_plan(src, tp)` reads config.json, the index and each shard's header (never tensor data), checks
that the model can run at tp (tp.py) and the headers (validate.py), and lists for every rank the output
tensors in file order, each with its byte offsets, the rule that made it, the action that computes it
and the source byte ranges it reads.
A ConversionPlan is plain data: `to_dict()` / `from_dict()` round-trip it through JSON.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv41_convert.config import load_json, load_model_args
from dsv41_convert.convert.plan_json import run_json, tensor_json
from dsv41_convert.convert.rules import Op, Split, expert_prefix, has_scale, scale_name
from dsv41_convert.convert.tp import check_tp
from dsv41_convert.convert.validate import (
    Source,
    gather_sources,
    require_engram_tokenizer,
    require_json_tokenizer_files,
    require_regular_files,
    validate_sources,
)
from dsv41_convert.errors import PlanError
from dsv41_convert.numbers import e8m0_text
from dsv41_convert.store.rank_names import rank_file_name
from dsv41_convert.store.safetensors_header import layout_blocks
from dsv41_convert.store.source_stamps import source_stamps

INDEX = "model.safetensors.index.json"
E4M3, E8M0, F4, BF16 = "F8_E4M3", "F8_E8M0", "F4", "BF16"
ROW_ALIGN = 128  # chunks of a blocked action start on a multiple of every block height (32, 128)


def pad_byte(dtype: str) -> int:
    """The byte an Engram table's padding rows of safetensors `dtype` hold: 127 in the e8m0 scale (2**0),
    0 in the e4m3 weight (0.0)."""
    return 127 if dtype == E8M0 else 0


def fill_text(dtype: str) -> str:
    """pad_byte as a report says it: "127 (scale 2**0)" for an e8m0 scale, "0" for a weight."""
    fill = pad_byte(dtype)
    return f"{fill} (scale {e8m0_text(fill)})" if dtype == E8M0 else str(fill)


# Read and OutTensor are slotted, not frozen: a tp-8 plan of the real checkpoint holds 107k of each,
# and frozen dataclasses cost twice as much to build. Nothing mutates them after build_plan.
@dataclass(slots=True)
class Read:
    """A region of one source tensor: rows [r0, r1) and, for a dim-1 split, columns [c0, c1)."""

    file: str  # relative to the source folder
    name: str  # name in that file's header
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the tensor's first byte
    r0: int
    r1: int
    c0: int = 0
    c1: int = -1  # -1: every column
    ratio: int = 1  # rows of the group's weight per row of this tensor (32 for a 32x32 scale)

    def label(self, src: Path) -> str:
        """How a message names the source tensor: its file in `src`, then its name."""
        return f"{src / self.file}: {self.name}"


# the actions that quantize a bf16 source's weight (a group: the weight, then its scale); a bf16 source run
# unquantized leaves them out (verify.source.plan_state's skip_quant: the weight stays bf16, no scale)
QUANTIZING = ("quant_fp8", "quant_fp4", "quant_fp4_fp8")


@dataclass(slots=True)
class OutTensor:
    """One tensor of one rank file. Tensors of one `group` come from one computation (weight, scale)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    rule: str
    # copy | as_fp4 | cast | dequant_bf16 | fp4_to_fp8 | quant_fp8 | quant_fp4 | quant_fp4_fp8 | quant_rows_fp8
    action: str
    reads: tuple[Read, ...]
    group: str = ""  # name of the group's part-0 tensor; "" for single-output actions
    part: int = 0  # which output of the action this tensor is
    pad_rows: int = 0  # rows appended after the data (Engram tail)
    block: tuple[int, int] = (32, 32)  # dequant_bf16: the scale's block
    begin: int = 0  # absolute offsets in the output file
    end: int = 0


@dataclass(slots=True)
class ExpertRun:
    """Routed-expert tensors of one layer that one rank file holds as whole copies of their source tensors,
    back to back, all of one dtype, rule and action: a published checkpoint's packed fp4 weights (as_fp4) or
    their scales (copy) at --expert-dtype fp4. 94k of the real checkpoint's 107k outputs at tp 8 are in 688
    runs, which plan lays out, sums and writes as JSON without an OutTensor each; `tensors()` makes them.
    """

    prefix: str  # rules.expert_prefix of its members: no other tensor of the file's dtype starts with it
    dtype: str
    rule: str
    action: str  # copy | as_fp4
    members: list[tuple[str, Source]] = field(default_factory=list)  # (output name, source), in name order
    begin: int = 0  # absolute offsets in the output file: the first member's first byte, the last one's end
    end: int = 0

    def out_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output shape of a member of source `shape`: as_fp4 keeps the bytes, F4 counts two per byte."""
        return _logical(shape) if self.action == "as_fp4" else shape

    def out_shapes(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """out_shape of every source shape among the members (a run has two or three)."""
        return {shape: self.out_shape(shape) for shape in {s.shape for _, s in self.members}}

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def tensors(self) -> list[OutTensor]:
        """The members as the OutTensors `_outputs` makes of them, with their offsets."""
        out = []
        pos = self.begin
        for name, s in self.members:
            read = Read(s.file, s.name, s.dtype, s.shape, s.offset, 0, s.shape[0])
            t = OutTensor(name, self.dtype, self.out_shape(s.shape), self.rule, self.action, (read,))
            t.begin, t.end = pos, pos + s.nbytes  # as_fp4 and copy: the source's bytes
            pos = t.end
            out.append(t)
        return out


@dataclass(frozen=True)
class RankFile:
    rank: int
    file: str  # model{r}-mp{N}.safetensors
    header: bytes = field(repr=False)
    parts: tuple[OutTensor | ExpertRun, ...]  # in file order

    @functools.cached_property
    def tensors(self) -> tuple[OutTensor, ...]:
        """Every tensor of the file, in file order (runs made into their OutTensors)."""
        return tuple(t for p in self.parts for t in (p.tensors() if type(p) is ExpertRun else (p,)))

    @property
    def n_tensors(self) -> int:
        return sum(len(p.members) if type(p) is ExpertRun else 1 for p in self.parts)

    @property
    def nbytes(self) -> int:
        return self.parts[-1].end if self.parts else len(self.header)


@dataclass(frozen=True)
class ConversionPlan:
    src: str
    tp: int
    expert_dtype: str  # fp4 | fp8: the routed experts in the output (an export plan: bf16 too)
    source_format: str  # fp8 (published fp8/fp4) | bf16 (unquantized bf16/fp32)
    index_sha256: str
    inference_config: dict[str, Any]  # the config.json written to OUT (an export plan: the HF config)
    files: tuple[RankFile, ...]
    # each source shard's [size, mtime ns] as the plan found it, taken before its headers were read; {} for a plan
    # read back from JSON (from_dict), which does not carry them; not in the digest (a copy's bytes: the same plan)
    stamps: dict[str, list[int]] = field(default_factory=dict, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def digest(self) -> str:
        """sha256 of what the output will be: the same digest means the same bytes."""
        h = hashlib.sha256(json.dumps([self.tp, self.expert_dtype, self.index_sha256]).encode())
        for f in self.files:
            h.update(f.header)
        return h.hexdigest()

    def to_dict(self, with_headers: bool = False) -> dict[str, Any]:
        """The plan as JSON-ready data.

        Default, what a pipeline reads: per rank its file, tensor count and bytes; per tensor its name,
        dtype, shape, rule, action and source reads (file, name in that file, rows, and columns for a
        dim-1 split). `with_headers`: also each rank's raw header (hex) and every field of every tensor,
        all that `from_dict` needs to rebuild the plan (the real checkpoint's is ~120 MB).
        """
        tensor = _tensor_dict if with_headers else _tensor_summary
        files = []
        with collector_paused():  # ~400k new dicts and lists, none in a cycle
            for f in self.files:
                entry: dict[str, Any] = {"rank": f.rank, "file": f.file, "n_tensors": f.n_tensors}
                entry["bytes"] = f.nbytes
                if with_headers:
                    entry["header"] = f.header.hex()
                entry["tensors"] = [tensor(t) for t in f.tensors]
                files.append(entry)
        return self._fields() | {"files": files}

    def _fields(self) -> dict[str, Any]:
        """The plan's own fields in to_dict, in its order, but "files"."""
        return {
            "src": self.src,
            "tp": self.tp,
            "expert_dtype": self.expert_dtype,
            "source_format": self.source_format,
            "index_sha256": self.index_sha256,
            "digest": self.digest(),
            "inference_config": self.inference_config,
            "total_bytes": self.total_bytes,
        }

    def to_json(self, extra: dict[str, Any] | None = None) -> str:
        """`json.dumps(self.to_dict() | extra, separators=(",", ":"))`: the same text, written here directly (for
        the real checkpoint's 107k tensors, building 400k dicts and lists cost more than the text)."""
        return "".join(self.json_pieces(extra))

    def json_pieces(self, extra: dict[str, Any] | None = None) -> Iterator[str]:
        """`to_json`'s text in pieces (a rank's tensors at most, ~4 MB of the real plan's 30 MB), so a writer
        never holds the whole document, nor copies of it."""
        top = json.dumps(self._fields(), separators=(",", ":"), default=str)
        yield top[:-1] + ',"files":['
        for i, f in enumerate(self.files):
            entry = {"rank": f.rank, "file": f.file, "n_tensors": f.n_tensors, "bytes": f.nbytes}
            yield ("," if i else "") + json.dumps(entry, separators=(",", ":"))[:-1] + ',"tensors":['
            yield ",".join(run_json(p) if type(p) is ExpertRun else tensor_json(p) for p in f.parts)
            yield "]}"
        tail = json.dumps(extra, separators=(",", ":"))[1:-1] if extra else ""
        yield "]" + ("," + tail if tail else "") + "}"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConversionPlan:
        """The plan `to_dict(with_headers=True)` described."""
        if any("header" not in f for f in d["files"]):
            raise PlanError("this plan JSON has no rank headers; write it with `plan --json --with-headers`")
        files = tuple(
            RankFile(f["rank"], f["file"], bytes.fromhex(f["header"]), tuple(_tensor_from(t) for t in f["tensors"]))
            for f in d["files"]
        )
        return cls(
            d["src"], d["tp"], d["expert_dtype"], d["source_format"], d["index_sha256"], d["inference_config"], files
        )


_OUT_FIELDS = tuple(OutTensor.__dataclass_fields__)
_READ_FIELDS = tuple(Read.__dataclass_fields__)


def _tensor_dict(t: OutTensor) -> dict[str, Any]:
    d = {k: getattr(t, k) for k in _OUT_FIELDS}
    d["reads"] = [{k: getattr(r, k) for k in _READ_FIELDS} for r in t.reads]
    return d


def _tensor_summary(t: OutTensor) -> dict[str, Any]:
    return {
        "name": t.name,
        "dtype": t.dtype,
        "shape": t.shape,
        "rule": t.rule,
        "action": t.action,
        "reads": [
            {"file": r.file, "name": r.name, "rows": (r.r0, r.r1)}
            if r.c1 < 0
            else {"file": r.file, "name": r.name, "rows": (r.r0, r.r1), "cols": (r.c0, r.c1)}
            for r in t.reads
        ],
    }


def _tensor_from(d: dict[str, Any]) -> OutTensor:
    reads = tuple(Read(**{**r, "shape": tuple(r["shape"])}) for r in d["reads"])
    return OutTensor(**{**d, "reads": reads, "shape": tuple(d["shape"]), "block": tuple(d["block"])})


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: a plan of the real checkpoint builds ~400k objects, none in a
    cycle, and the collector's repeated passes over them cost a third of the plan's time."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            # everything allocated meanwhile sits in the youngest generation, and the first allocation after
            # enable() would trace all of it (~0.2 s for the real plan); moving it to the oldest generation
            # (freeze, then unfreeze) leaves it to the rare full collections
            gc.freeze()
            gc.unfreeze()
            gc.enable()


def build_plan(src: Path, tp: int, expert_dtype: str = "fp4") -> ConversionPlan:
    """Read config, index and headers of `src`, validate them, and lay out every rank file.

    Raises PlanError / HeaderError / ConfigError naming the file and tensor at fault.
    """
    with collector_paused():
        return _build_plan(src, tp, expert_dtype)


def _build_plan(src: Path, tp: int, expert_dtype: str) -> ConversionPlan:
    if expert_dtype not in ("fp4", "fp8"):
        raise PlanError(f"--expert-dtype {expert_dtype!r}: expected fp4 or fp8")
    src = Path(src)
    require_regular_files(src)
    require_json_tokenizer_files(src)
    stamps = source_stamps(src)  # before the headers: a shard replaced while they are read is seen (execute)
    args = load_model_args(src / "config.json")
    check_tp(args, tp, str(src / "config.json"))
    index_sha, weight_map = read_index(src)
    sources = gather_sources(src, weight_map)
    n_experts = validate_sources(sources, args, tp, src / "config.json", expert_dtype)
    require_engram_tokenizer(src, args)
    if args.expert_dtype == "fp8" and expert_dtype == "fp4":
        raise PlanError(
            f"{src}: its routed experts are fp8 (config.json quantization_config.expert_dtype 'fp8', an `export "
            "--format fp8` checkpoint); pass --expert-dtype fp8 (copies them), or `export --format fp8-fp4` first"
        )
    quantized = args.dtype == "fp8"
    per_rank: list[list[OutTensor]] = [[] for _ in range(tp)]
    runs: list[dict[tuple[str, str], ExpertRun]] = [{} for _ in range(tp)]  # by (layer prefix, dtype)
    per_expert_rank = (n_experts[0] // tp, n_experts[1] // tp)
    expert = Split.EXPERT
    for name, s in sources.items():  # in name order (gather_sources), so each run's members are too
        if s.rule.split is expert:
            copy = _expert_copy(s, quantized, expert_dtype)
            if copy is not None:
                is_mtp, e = s.expert
                key = (expert_prefix(name), copy[0])
                rank_runs = runs[e // per_expert_rank[is_mtp]]
                run = rank_runs.get(key)
                if run is None:
                    run = rank_runs[key] = ExpertRun(key[0], copy[0], s.rule.pattern, copy[1])
                run.members.append((name, s))
                continue
        for rank, t in _outputs(sources, name, tp, n_experts, quantized, expert_dtype):
            per_rank[rank].append(t)
    files = tuple(
        lay_out(rank, rank_file_name(rank, tp), tensors, list(runs[rank].values()))
        for rank, tensors in enumerate(per_rank)
    )
    out_args = args.to_inference_dict() | {"dtype": "fp8", "expert_dtype": "fp4" if expert_dtype == "fp4" else None}
    return ConversionPlan(str(src.resolve()), tp, expert_dtype, args.dtype, index_sha, out_args, files, stamps)


def read_index(src: Path) -> tuple[str, dict[str, str] | None]:
    """-> (sha256 of SRC's model.safetensors.index.json, its weight_map); ("", None) without an index."""
    index_path = src / INDEX
    if not index_path.exists():
        return "", None
    weight_map = load_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise PlanError(f"{index_path}: no weight_map object; is this a safetensors index?")
    return hashlib.sha256(index_path.read_bytes()).hexdigest(), weight_map


def lay_out(
    rank: int, file: str, tensors: list[OutTensor], runs: list[ExpertRun] | None = None, *, sort: bool = True
) -> RankFile:
    """A file of `tensors` and `runs`: its header (save_file's order, or theirs with sort=False) and each
    one's byte offsets set."""
    runs = runs or []
    blocks = [(t.name, t.dtype, ((t.name, t.shape),)) for t in tensors]
    for r in runs:
        out_shape = r.out_shapes()
        blocks.append((r.prefix, r.dtype, [(name, out_shape[s.shape]) for name, s in r.members]))
    # a run sorts as its prefix (layout_blocks): no other tensor of its dtype may have that prefix
    taken = {(r.prefix, r.dtype) for r in runs}
    assert not any((expert_prefix(t.name), t.dtype) in taken for t in tensors)
    header, spans = layout_blocks(blocks, sort=sort)
    parts = [*tensors, *runs]
    for i, b, e in spans:
        parts[i].begin, parts[i].end = b, e
    return RankFile(rank, file, header, tuple(parts[i] for i, _, _ in spans))


def _read(s: Source, r0: int = 0, r1: int | None = None, c0: int = 0, c1: int = -1, ratio: int = 1) -> Read:
    rows = s.shape[0] if s.shape else 1
    return Read(s.file, s.name, s.dtype, s.shape, s.offset, r0, rows if r1 is None else r1, c0, c1, ratio)


def _expert_copy(s: Source, quantized: bool, xdt: str) -> tuple[str, str] | None:
    """(output dtype, action) where `_outputs` makes one whole copy of routed-expert tensor `s`, or None where
    `_outputs` must make it. The copies, which build_plan gathers into ExpertRuns: a published checkpoint's
    packed fp4 weights and their scales at --expert-dtype fp4, 94k of its 96k tensors."""
    if xdt != "fp4":
        return None
    if s.rule.op is Op.SCALE:
        return E8M0, "copy"
    if s.rule.op is Op.AS_FP4 and quantized and s.dtype != E4M3:
        return F4, "as_fp4"
    return None


def _logical(packed: tuple[int, ...]) -> tuple[int, int]:
    """The logical shape of packed e2m1 [out, in/2] (two values a byte): [out, in]."""
    return (packed[0], packed[1] * 2)


def _outputs(sources: dict[str, Source], name: str, tp: int, n_experts: tuple[int, int], quantized: bool, xdt: str):
    """(rank, OutTensor) for each output made from source tensor `name` (a canonical name)."""
    s = sources[name]
    rule, op = s.rule, s.rule.op
    if op in (Op.DROP, Op.FOLD_INTO_WEIGHT):
        return
    if op is Op.SCALE:
        weight = sources[name.removesuffix(".scale") + ".weight"]
        if weight.rule.op is Op.AS_FP4 and xdt == "fp8" and weight.dtype != E4M3:
            return  # made by the expert's fp4 -> fp8 cast
        for rank, rd, pad in _selections(s, rule.split, tp, n_experts):
            yield rank, _out(name, E8M0, rd, pad, rule, "copy")
        return
    scale = sources.get(scale_name(name)) if quantized and has_scale(op) and _reads_scale(op, xdt) else None
    for rank, rd, pad in _selections(s, rule.split, tp, n_experts):
        local = (rd.r1 - rd.r0, *s.shape[1:]) if rd.c1 < 0 else (rd.r1 - rd.r0, rd.c1 - rd.c0)
        sread = _scale_read(scale, s, rd) if scale is not None else None
        if op is Op.KEEP or (op is Op.FP8 and quantized):
            out_dt = rule.src[0]
            yield rank, _out(name, out_dt, rd, pad, rule, "copy" if s.dtype == out_dt else "cast", shape=local)
        elif op is Op.DEQUANT_BF16:
            if quantized:
                block = (s.shape[0] // scale.shape[0], s.shape[1] // scale.shape[1])
                t = _out(name, BF16, rd, 0, rule, "dequant_bf16", shape=local)
                t.reads, t.block = (rd, sread), block
                yield rank, t
            else:
                yield rank, _out(name, BF16, rd, 0, rule, "copy" if s.dtype == BF16 else "cast", shape=local)
        elif op is Op.AS_FP4 and quantized:
            logical = _logical(s.shape)
            if s.dtype == E4M3:  # fp8 experts (an `export --format fp8` source; fp4 refused in build_plan)
                yield rank, _out(name, E4M3, rd, 0, rule, "copy", shape=local)
            elif xdt == "fp4":
                yield rank, _out(name, F4, rd, 0, rule, "as_fp4", shape=logical)  # same bytes, F4 in the header
            else:
                yield from _group(rank, name, rule, "fp4_to_fp8", (rd, sread), (E4M3, logical), _fp8_scale(logical))
        elif op is Op.AS_FP4:
            if xdt == "fp4":
                yield from _group(rank, name, rule, "quant_fp4", (rd,), (F4, local), (local[0], -(-local[1] // 32)))
            else:
                yield from _group(rank, name, rule, "quant_fp4_fp8", (rd,), (E4M3, local), _fp8_scale(local))
        elif op is Op.FP8:
            yield from _group(rank, name, rule, "quant_fp8", (rd,), (E4M3, local), _fp8_scale(local))
        elif op is Op.ENGRAM_ROWS and quantized:
            yield rank, _out(name, E4M3, rd, pad, rule, "copy", shape=local)
        elif op is Op.ENGRAM_ROWS:
            sshape = (local[0], -(-local[1] // 32))
            yield from _group(rank, name, rule, "quant_rows_fp8", (rd,), (E4M3, local), sshape, pad)
        else:  # pragma: no cover - every Op is handled above
            raise AssertionError(op)


def _reads_scale(op: Op, xdt: str) -> bool:
    """Whether the action for a weight of family `op` reads its scale (the others copy the scale apart)."""
    return op is Op.DEQUANT_BF16 or (op is Op.AS_FP4 and xdt == "fp8")


def _fp8_scale(shape: tuple[int, ...]) -> tuple[int, int]:
    return (-(-shape[0] // 32), -(-shape[1] // 32))


def _out(name, dtype, rd, pad, rule, action, shape=None) -> OutTensor:
    if shape is None:
        shape = (rd.r1 - rd.r0, *rd.shape[1:]) if rd.c1 < 0 else (rd.r1 - rd.r0, rd.c1 - rd.c0)
    if not rd.shape:
        shape = ()  # a 0-d tensor stays 0-d
    shape = (shape[0] + pad, *shape[1:]) if shape else shape
    return OutTensor(name, dtype, tuple(shape), rule.pattern, action, (rd,), pad_rows=pad)


def _group(rank, name, rule, action, reads, weight, scale_shape, pad=0):
    """The two outputs of a quantizing action: the weight (part 0) and its scale (part 1)."""
    wdt, wshape = weight
    wshape = (wshape[0] + pad, *wshape[1:])
    sshape = (scale_shape[0] + pad, *scale_shape[1:])
    reads = tuple(r for r in reads if r is not None)
    sname = scale_name(name)
    yield rank, OutTensor(name, wdt, wshape, rule.pattern, action, reads, name, 0, pad)
    yield rank, OutTensor(sname, E8M0, sshape, rule.pattern, action, reads, name, 1, pad)


def _scale_read(scale: Source, weight: Source, rd: Read) -> Read:
    """The scale rows/columns that cover weight region `rd` (blocks never straddle a split: validated)."""
    bo = max(1, -(-weight.shape[0] // scale.shape[0]))
    bi = -(-weight.shape[1] // scale.shape[1])
    c0, c1 = (rd.c0 // bi, -(-rd.c1 // bi)) if rd.c1 >= 0 else (0, -1)
    return _read(scale, rd.r0 // bo, -(-rd.r1 // bo), c0, c1, ratio=bo)


def _selections(s: Source, split: Split, tp: int, n_experts: tuple[int, int]):
    """(rank, Read, pad rows) for every rank that gets a piece of source tensor `s`."""
    rows = s.shape[0] if s.shape else 1
    if split is Split.NONE:
        whole = _read(s)  # one Read shared by every rank's copy
        for r in range(tp):
            yield r, whole, 0
    elif split is Split.DIM0:
        k = rows // tp
        for r in range(tp):
            yield r, _read(s, r * k, (r + 1) * k), 0
    elif split is Split.DIM1:
        k = s.shape[1] // tp
        for r in range(tp):
            yield r, _read(s, 0, rows, r * k, (r + 1) * k), 0
    elif split is Split.EXPERT:
        is_mtp, e = s.expert
        per_rank = n_experts[is_mtp] // tp
        yield e // per_rank, _read(s), 0
    elif split is Split.ROWS_PADDED:
        k = -(-rows // tp)
        for r in range(tp):
            r0, r1 = min(r * k, rows), min((r + 1) * k, rows)
            yield r, _read(s, r0, r1), k - (r1 - r0)


def file_summary(f: RankFile) -> dict[str, Any]:
    """One output file: its name, tensor count, bytes and tensor counts per "rule [action]", in `plan --json`'s
    keys (file, n_tensors, bytes; `tensors` is its list of them there): the dry runs said `tensors` for the
    count, and shard's `ranks` for plan's `files`, one plan in two schemas (a carried item)."""
    rules: dict[str, int] = {}
    for p in f.parts:
        key, n = f"{p.rule} [{p.action}]", len(p.members) if type(p) is ExpertRun else 1
        rules[key] = rules.get(key, 0) + n
    return {"file": f.file, "n_tensors": f.n_tensors, "bytes": f.nbytes, "rules": rules}


def summarize(plan: ConversionPlan, ranks: set[int] | None = None) -> dict[str, Any]:
    """Per rank (of `ranks`, else all): file, tensor count, bytes, and tensor counts per rule (the `plan`
    command's table, `shard --dry-run --json`), and the bytes of those ranks; `files` as in `to_dict`."""
    files = [f for f in plan.files if ranks is None or f.rank in ranks]
    return {
        "src": plan.src,
        "tp": plan.tp,
        "expert_dtype": plan.expert_dtype,
        "source_format": plan.source_format,
        "total_bytes": sum(f.nbytes for f in files),
        "files": [{"rank": f.rank, **file_summary(f)} for f in files],
    }
