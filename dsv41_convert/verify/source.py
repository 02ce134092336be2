"""The source checkpoint transformed in memory at tp 1, no files written: verify's reference weights.

The converter (plan.py + transform.py) has no in-memory entry point, so this is a thin one: it builds
the engine's own tp-1 plan and runs each planned action through `transform.apply` on tensors read
from the source shards. Two flavours:

- `expected_shards(src, expert_dtype)`: exactly what `shard --tp 1` would write (quantized where the
  converter quantizes). Localization diffs the converted ranks against this.
- `reference_state(src)`: what the reference model runs. For a published (fp8/fp4) source it is the
  same as above. For an unquantized (bf16) source the quantizing actions are skipped and the weights
  stay bf16 (the model is then built with dtype "bf16"); only the Engram tables are still quantized
  to per-row fp8, because the model has no bf16 Engram path.

Everything is held in RAM: fine for verify's small models, not for a 500 GB checkpoint. `plan_state(plan,
rank)` computes one rank's file of a tp-N plan: what `reference-logits --tp N` runs on each rank.
`SourceWeights` gives the tp-1 reference weights one request at a time (Engram tables row by row) for the
layer-streamed model (model/streamed.py, `reference-logits --stream-layers`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from dsv41_convert.config import load_model_args
from dsv41_convert.convert.plan import QUANTIZING, ConversionPlan, OutTensor, Read, build_plan, pad_byte
from dsv41_convert.convert.stream import block_name, scale_label
from dsv41_convert.convert.transform import DTYPES, apply, quantizer_for
from dsv41_convert.errors import PlanError
from dsv41_convert.progress import Progress, counting
from dsv41_convert.quant.byte_checks import flat_index, require_finite_copy
from dsv41_convert.store.safetensors_header import DTYPE_BITS, pread_blocks, pread_exact

BYTE_COPIES = ("copy", "as_fp4")  # the output holds the source bytes (as_fp4: I8 pairs relabelled F4)


def _read(src: Path, rd: Read, fds: dict[str, int], alloc: Callable[[int], Tensor] | None = None) -> Tensor:
    """Rows [r0, r1) and columns [c0, c1) of one source tensor, in its file dtype.

    alloc: n -> a [n] uint8 CPU tensor the bytes are read into (None: a bytearray)
    -> [r1 - r0, *shape[1:]] (or [r1 - r0, c1 - c0])  DTYPES[rd.dtype]; a 0-d tensor comes back 0-d
    """
    if rd.file not in fds:
        fds[rd.file] = os.open(src / rd.file, os.O_RDONLY)
    fd = fds[rd.file]
    shape = rd.shape if rd.shape else (1,)
    row_elems = 1
    for d in shape[1:]:
        row_elems *= d
    row_bytes = DTYPE_BITS[rd.dtype] * row_elems // 8
    n = (rd.r1 - rd.r0) * row_bytes
    if alloc is not None:
        raw = alloc(n)
        buf = memoryview(raw.numpy())
    else:
        buf = bytearray(n)
        raw = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    if n:
        # the file and the tensor: a file cut short after it was opened named no tensor
        pread_exact(fd, memoryview(buf), rd.offset + rd.r0 * row_bytes, f"{src / rd.file}: tensor {rd.name}")
    dtype = DTYPES[rd.dtype]
    t = raw.view(dtype).reshape(rd.r1 - rd.r0, *shape[1:])
    if rd.c1 >= 0:
        t = t[:, rd.c0 : rd.c1].contiguous()
    return t.reshape(()) if not rd.shape else t


def _as_output(t: Tensor, out: OutTensor) -> Tensor:
    """A copied tensor in its output dtype: I8 expert bytes become e2m1 pairs, bytes unchanged."""
    if out.dtype == "F4":
        return t.view(torch.uint8).view(torch.float4_e2m1fn_x2)
    want = DTYPES[out.dtype]
    return t if t.dtype == want else t.view(want)


def _compute(
    t: OutTensor, reads: list[Read], inputs: list[Tensor], skip_quant: bool, q, src: Path
) -> dict[str, Tensor]:
    """The output(s) of one planned tensor from its source regions `reads` (read into `inputs`) in `src`:
    {name: tensor}, the scale too for a group. A FormatError names the source file and tensor, as shard's; a
    NaN or an infinity in a tensor taken unchanged too (the reference ran on it: verify FAILed the correct
    rank files, reference-logits recorded it; an audit)."""
    if t.action in BYTE_COPIES:
        _require_finite(src, reads[0], inputs[0])
        return {t.name: _as_output(inputs[0], t)}
    if skip_quant and t.action in QUANTIZING:
        _require_finite(src, reads[0], inputs[0])
        return {t.name: inputs[0].to(torch.bfloat16)}
    main = t.reads[0]  # the rank's region, said (and its indexes counted) as shard says it
    where = block_name(main.label(src), main, 0, main.r1 - main.r0, scale_label(t, src))
    results = apply(t.action, inputs, q, where, t.dtype, t.block)
    if t.group:
        return {t.name: results[0], t.name.removesuffix(".weight") + ".scale": results[1]}
    return {t.name: results[0]}


def _require_finite(src: Path, rd: Read, x: Tensor) -> None:
    """The copy check of shard (quant/byte_checks.require_finite_copy) on `x`, region `rd` of its source."""

    def index(i: int) -> list[int]:
        at = flat_index(x.shape, i)
        if at:
            at[0] += rd.r0
            if rd.c1 >= 0:
                at[1] += rd.c0
        return at

    require_finite_copy(
        x.reshape(-1).view(torch.uint8).numpy(), rd.dtype, f"{src / rd.file}: {rd.name}", rd.shape, index
    )


def plan_state(
    plan: ConversionPlan, rank: int = 0, skip_quant: bool = False, progress: Progress | None = None
) -> dict[str, Tensor]:
    """Rank `rank`'s file of `plan`, computed in memory: only that rank's slices of the source are read.

    skip_quant: leave the quantizing actions out (the weights stay bf16: the unquantized model)
    -> name -> tensor in the rank file's dtype (F4 as float4_e2m1fn_x2 [out, in/2])
    """
    src = Path(plan.src)
    rank_file = plan.files[rank]
    q = quantizer_for("cpu")
    out: dict[str, Tensor] = {}
    fds: dict[str, int] = {}
    tensors = rank_file.tensors
    label = counting(f"source, rank {rank}'s slices" if plan.tp > 1 else "source", "tensors")
    try:
        for i, t in enumerate(tensors):
            if progress is not None:
                progress(label, i, len(tensors))
            if t.name in out or (t.group and t.part != 0):
                continue  # a group's scale is made with its weight
            out.update(_compute(t, t.reads, [_read(src, rd, fds) for rd in t.reads], skip_quant, q, src))
    finally:
        for fd in fds.values():
            os.close(fd)
    for t in tensors:
        if t.pad_rows:  # the last rank's Engram rows, filled as shard writes them
            out[t.name] = _padded(out[t.name], t.pad_rows, pad_byte(t.dtype))
    if progress is not None:
        progress(label, len(tensors), len(tensors))
    return out


def _padded(t: Tensor, rows: int, fill: int) -> Tensor:
    """`t` with `rows` rows of byte `fill` appended. t: [n, ...] 1-byte dtype -> [n + rows, ...]"""
    tail = torch.full((rows, *t.shape[1:]), fill, dtype=torch.uint8)
    return torch.cat([t.view(torch.uint8), tail]).view(t.dtype)


class SourceWeights:
    """The reference weights of `reference_state`, tensor by tensor on request (model.streamed's
    WeightProvider): only the requested tensors' bytes are read, through the same plan and transform.
    Holds one open descriptor per source shard until close(); safe to call from several threads.

    expert_dtype: the routed experts as `shard SRC --tp 1 --expert-dtype X` writes them, and every weight
                  quantized as the converter quantizes it (a bf16 source too), instead of the reference's
                  weights: what weight_digests records of another expert dtype
    """

    def __init__(self, src: Path, expert_dtype: str | None = None):
        self.src = Path(src)
        self.plan = build_plan(self.src, 1, expert_dtype or source_experts(self.src))
        self.source_format = self.plan.source_format
        self.skip_quant = self.source_format == "bf16" and expert_dtype is None
        self.by_name = {t.name: t for t in self.plan.files[0].tensors}
        self.q = quantizer_for("cpu")
        # where whole-tensor reads land: None, a bytearray each; stream_feed.CudaFeed sets pinned memory,
        # so that a copied tensor (experts, fp8 weights) goes to the GPU without another host copy
        self.alloc: Callable[[int], Tensor] | None = None
        # every shard opened now: the streamed model calls this from several reader threads at once
        # (stream_feed.CudaFeed), and pread on a shared descriptor is safe where adding one to the dict is not
        files = sorted({rd.file for t in self.plan.files[0].tensors for rd in t.reads})
        self.fds: dict[str, int] = {}
        try:
            for f in files:
                self.fds[f] = os.open(self.src / f, os.O_RDONLY)
        except OSError:
            self.close()
            raise

    def _planned(self, name: str) -> OutTensor:
        t = self.by_name.get(name)
        if t is None:
            raise PlanError(f"{self.src}: the model wants {name}, which the source does not provide")
        return self.by_name[t.group] if t.group and t.part != 0 else t

    def __call__(self, names) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name in names:
            if name not in out:
                t = self._planned(name)
                out.update(self._compute(t, t.reads, [_read(self.src, rd, self.fds, self.alloc) for rd in t.reads]))
        return {n: out[n] for n in names}

    def rows(self, names, rows: Tensor) -> dict[str, Tensor]:
        """Rows `rows` ([n] int64, sorted, unique) of row-split tensors, read run by run (never the whole table).
        Only row-local transforms qualify (copies and per-row quantization: the Engram tables)."""
        runs = _runs(rows.tolist())
        out: dict[str, Tensor] = {}
        for name in names:
            if name in out:
                continue
            t = self._planned(name)
            if t.action not in (*BYTE_COPIES, "quant_rows_fp8"):
                raise PlanError(f"{name}: action {t.action} is not row-local; read it whole")
            parts: dict[str, list[Tensor]] = {}
            for r0, r1 in runs:
                reads = [replace(rd, r0=r0, r1=r1) for rd in t.reads]
                for n, x in self._compute(t, reads, [_read(self.src, rd, self.fds) for rd in reads]).items():
                    parts.setdefault(n, []).append(x)
            out.update({n: torch.cat(xs) for n, xs in parts.items()})
        return {n: out[n] for n in names}

    def _compute(self, t: OutTensor, reads: list[Read], inputs: list[Tensor]) -> dict[str, Tensor]:
        return _compute(t, reads, inputs, self.skip_quant, self.q, self.src)

    def copied_blocks(self, t: OutTensor, block: int) -> Iterator[memoryview]:
        """The bytes of output `t`, a whole source tensor copied unchanged (BYTE_COPIES), read straight from
        the source about `block` bytes (whole rows) at a time into one buffer reused from view to view; a NaN or
        an infinity among them is a FormatError (the weights record of `reference-logits --stream-layers` read
        every byte, and recorded a NaN in rows no prompt reached: an audit)."""
        if not whole_row_copy(t):
            raise PlanError(f"{t.name}: action {t.action} is not a copy of whole rows")
        (rd,) = t.reads
        row = DTYPE_BITS[rd.dtype] * math.prod(rd.shape[1:]) // 8
        begin, length = rd.offset + rd.r0 * row, (rd.r1 - rd.r0) * row
        path, first = str(self.src / rd.file), rd.r0 * math.prod(rd.shape[1:])  # the view's first element
        for view in pread_blocks(self.fds[rd.file], begin, length, row, block, path):
            index = functools.partial(lambda at, i: flat_index(rd.shape, at + i), first)
            require_finite_copy(view, rd.dtype, f"{path}: {rd.name}", rd.shape, index)
            first += len(view) * 8 // DTYPE_BITS[rd.dtype]
            yield view

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def whole_row_copy(t: OutTensor) -> bool:
    """Output `t` is a run of whole rows of one source tensor, unchanged (SourceWeights.copied_blocks)."""
    if t.action not in BYTE_COPIES or len(t.reads) != 1:
        return False
    rd = t.reads[0]
    return rd.c1 < 0 or (rd.c0 == 0 and len(rd.shape) > 1 and rd.c1 == rd.shape[1])


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted unique row ids as [r0, r1) runs of consecutive rows."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


def expected_shards(src: Path, expert_dtype: str = "fp4", progress: Progress | None = None) -> dict[str, Tensor]:
    """The tensors `shard SRC OUT --tp 1 --expert-dtype X` writes, computed in memory.

    -> name -> tensor in the rank file's dtype (F4 as float4_e2m1fn_x2 [out, in/2])
    """
    return plan_state(build_plan(Path(src), 1, expert_dtype), progress=progress)


def reference_plan(src: Path) -> ConversionPlan:
    """The plan of the reference model's weights: tp 1, routed experts as the source stores them (fp4, or fp8 in an
    `export --format fp8` checkpoint)."""
    return build_plan(Path(src), 1, source_experts(src))


def reference_state(
    src: Path, progress: Progress | None = None, plan: ConversionPlan | None = None
) -> tuple[str, dict[str, Tensor]]:
    """The weights of the reference model: -> (source format "fp8" | "bf16", name -> tensor).
    plan: reference_plan(src), where the caller has it already."""
    plan = reference_plan(src) if plan is None else plan
    return plan.source_format, plan_state(plan, skip_quant=plan.source_format == "bf16", progress=progress)


def source_experts(src: Path) -> str:
    """The expert dtype the source stores: "fp8" for an `export --format fp8` checkpoint, else "fp4"."""
    return "fp8" if load_model_args(Path(src) / "config.json").expert_dtype == "fp8" else "fp4"
