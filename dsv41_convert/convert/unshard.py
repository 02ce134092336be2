"""The inverse of the converter's splits: rank files `model{r}-mp{N}.safetensors` merged back to tp 1, in memory.

    names = unshard_names(folder)                       # cheap: headers only
    state = unshard_tensors(folder, ["layers.3.attn.wq_b.weight", ...])

Each tensor is rebuilt from the bytes the rank files hold, by its rule's split (rules.py), and nothing
is re-derived from the source, so the result is what a tp-1 run of these files would load:

    NONE         every rank holds it; all copies must be byte-identical (else: which ranks differ)
    DIM0 / DIM1  the rank pieces, equal in shape, concatenated in rank order on dim 0 / dim 1
    EXPERT       exactly one rank holds it: the owner e // (experts / N)
    ROWS_PADDED  ceil(rows / N) rows per rank, concatenated, the padding rows (weight 0, scale 1.0)
                 after the config's row count checked and dropped

Only the bytes of the named tensors are read (pread per tensor, no mmap of a whole file), so a caller
can merge one layer at a time. Any disagreement between the rank files raises ShardConsistencyError
naming the tensor and the ranks: for verify that is a faulty conversion, not an unusable input.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.plan import PAD_BYTE, rank_file_name
from dsv41_convert.convert.rules import Split, expert_index, match_rule
from dsv41_convert.convert.tp import rank_file_tps
from dsv41_convert.convert.transform import DTYPES
from dsv41_convert.errors import ShardConsistencyError, VerifyInputError
from dsv41_convert.store.rank_names import RANK_FILE
from dsv41_convert.store.safetensors_header import Header, TensorInfo, pread_exact, read_header

_ENGRAM = re.compile(r"layers\.(\d+)\.engram\.embed\.(weight|scale)")


def rank_tp(folder: Path, tp: int | None = None) -> int:
    """The tp of the rank files in `folder`; with several sets present, `tp` must pick one. VerifyInputError
    where there are none, or the set is incomplete (verify cannot run the model: an input error, as a
    truncated file is)."""
    found = rank_file_tps(folder)
    if not found:
        raise VerifyInputError(f"{folder}: no rank files (model{{r}}-mp{{N}}.safetensors); is it a shard output?")
    if tp is not None and tp not in found:
        raise VerifyInputError(f"{folder}: no model*-mp{tp}.safetensors files (found tp {found})")
    if tp is None and len(found) != 1:
        raise VerifyInputError(f"{folder}: rank files for tp {found}; pass the tp to pick one")
    tp = tp if tp is not None else found[0]
    missing = [name for r in range(tp) if not (Path(folder) / (name := rank_file_name(r, tp))).is_file()]
    if missing:
        raise VerifyInputError(f"{folder}: tp {tp} needs {tp} rank files; missing {', '.join(missing)}")
    stray = sorted(
        p.name
        for p in Path(folder).iterdir()
        if (m := RANK_FILE.fullmatch(p.name)) and int(m[2]) == tp and int(m[1]) >= tp
    )
    if stray:
        raise VerifyInputError(f"{folder}: {', '.join(stray)}: no such rank in a tp-{tp} conversion; remove it")
    return tp


def rank_headers(folder: Path, tp: int) -> list[Header]:
    """The rank files' headers, rank by rank (`rank_tp` has checked that every file is there)."""
    return [read_header(Path(folder) / rank_file_name(r, tp)) for r in range(tp)]


def unshard_names(folder: Path, tp: int | None = None) -> list[str]:
    """Every tensor name of the merged tp-1 state dict (the union of the rank files' names), sorted."""
    tp = rank_tp(folder, tp)
    return sorted(set().union(*(h.tensors for h in rank_headers(folder, tp))))


def replica_mismatches(folder: Path, tp: int) -> list[str]:
    """Every replicated tensor (split NONE: norms, gates, the aligner ...) whose bytes or header entry differ
    between the rank files of `folder`, as 'NAME: replicated, but ranks [r, ...] differ from rank 0'.
    Reads those tensors only, one at a time (at most two copies in memory: rank 0's and one other's).

    Every rank runs its own copy, so a copy damaged on one rank changes that rank's partial sums only a
    little, often within a tolerance; this compares the bytes themselves."""
    headers = rank_headers(folder, rank_tp(folder, tp))
    found = []
    for name, info in sorted(headers[0].tensors.items()):
        if match_rule(name).split is not Split.NONE:
            continue
        first = _raw(headers[0], info)
        differ = [
            r
            for r in range(1, tp)
            if (other := headers[r].tensors.get(name)) is None
            or (other.dtype, other.shape) != (info.dtype, info.shape)
            or _raw(headers[r], other) != first
        ]
        if differ:
            found.append(f"{name}: replicated, but ranks {differ} differ from rank 0")
    return found


def _raw(header: Header, info: TensorInfo) -> bytearray:
    buf = bytearray(info.nbytes)
    fd = os.open(header.path, os.O_RDONLY)
    try:
        if buf:
            pread_exact(fd, memoryview(buf), info.begin, header.path)
    finally:
        os.close(fd)
    return buf


def _read(fd: int, info: TensorInfo, path: str) -> Tensor:
    """One tensor of a rank file in its file dtype.

    -> info.shape  DTYPES[info.dtype] (F4: float4_e2m1fn_x2 [..., last / 2]; I8 as int8)
    """
    buf = bytearray(info.nbytes)
    if buf:
        pread_exact(fd, memoryview(buf), info.begin, path)
    raw = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    shape = list(info.shape)
    if info.dtype == "F4":
        shape[-1] //= 2
    return raw.view(DTYPES[info.dtype]).reshape(shape)


def _bytes(t: Tensor) -> Tensor:
    """The same memory as uint8 with the same leading dims (1-byte dtypes) or as is (wider dtypes)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    """torch.cat for every dtype (fp8 / fp4 concatenated as their bytes)."""
    return torch.cat([_bytes(p) for p in parts], dim=dim).view(parts[0].dtype)


def unshard_tensors(folder: Path, names: Iterable[str] | None = None, tp: int | None = None) -> dict[str, Tensor]:
    """Merge the rank files of `folder` back to tp-1 tensors (see the module docstring).

    names: tp-1 state-dict names to merge (None: every name, see unshard_names)
    -> name -> tensor in the rank files' dtype (F4 as float4_e2m1fn_x2 [out, in/2])
    Raises ShardConsistencyError naming the tensor and ranks when the rank files disagree.
    """
    folder = Path(folder)
    tp = rank_tp(folder, tp)
    headers = rank_headers(folder, tp)
    args = load_model_args(folder / "config.json")
    wanted = unshard_names(folder, tp) if names is None else list(names)
    fds = [os.open(h.path, os.O_RDONLY) for h in headers]
    try:
        out = {}
        for name in wanted:
            holders = [r for r in range(tp) if name in headers[r].tensors]
            if not holders:
                raise ShardConsistencyError(f"{name}: in none of the {tp} rank files of {folder}")
            parts = {r: _read(fds[r], headers[r].tensors[name], headers[r].path) for r in holders}
            out[name] = _merge(name, parts, tp, args)
    finally:
        for fd in fds:
            os.close(fd)
    return out


def _merge(name: str, parts: dict[int, Tensor], tp: int, args: ModelArgs) -> Tensor:
    split = match_rule(name).split
    ranks = sorted(parts)
    if split is not Split.EXPERT and len(ranks) != tp:
        missing = sorted(set(range(tp)) - set(ranks))
        raise ShardConsistencyError(f"{name}: missing from rank files {missing} (every rank must hold a piece)")
    if split is Split.NONE:
        first = _bytes(parts[0])
        differ = [r for r in ranks[1:] if parts[r].shape != parts[0].shape or not torch.equal(_bytes(parts[r]), first)]
        if differ:
            raise ShardConsistencyError(f"{name}: replicated, but ranks {differ} differ from rank 0")
        return parts[0]
    if split is Split.EXPERT:
        return _expert(name, parts, tp, args)
    shapes = {r: tuple(parts[r].shape) for r in ranks}
    if len(set(shapes.values())) != 1:
        found = ", ".join(f"rank {r}: {list(s)}" for r, s in shapes.items())
        raise ShardConsistencyError(f"{name}: rank pieces differ in shape ({found}); a {split} split has equal pieces")
    whole = _cat([parts[r] for r in ranks], 1 if split is Split.DIM1 else 0)
    if split is Split.ROWS_PADDED:
        whole = _drop_padding(name, whole, tp, args)
    return whole


def _expert(name: str, parts: dict[int, Tensor], tp: int, args: ModelArgs) -> Tensor:
    is_mtp, e = expert_index(name)
    per_rank = (args.dspark_n_routed_experts if is_mtp else args.n_routed_experts) // tp
    owner = e // per_rank
    if list(parts) != [owner]:
        raise ShardConsistencyError(f"{name}: held by ranks {sorted(parts)}, expected rank {owner} alone")
    return parts[owner]


def _drop_padding(name: str, whole: Tensor, tp: int, args: ModelArgs) -> Tensor:
    """The config's rows of an Engram table; the padding after them must be the converter's fill."""
    m = _ENGRAM.fullmatch(name)
    rows = args.engram_num_embeddings[args.engram_layer_ids.index(int(m.group(1)))]
    k = -(-rows // tp)
    if whole.shape[0] != k * tp:
        raise ShardConsistencyError(
            f"{name}: {whole.shape[0] // tp} rows per rank, expected ceil({rows}/{tp}) = {k} (the last rank padded)"
        )
    pad = whole[rows:]
    fill = PAD_BYTE["F8_E8M0" if whole.dtype == torch.float8_e8m0fnu else "F8_E4M3"]
    if pad.numel() and not bool((_bytes(pad) == fill).all()):
        where = f"padding rows {rows}..{k * tp - 1} (ranks {rows // k}..{tp - 1})"
        raise ShardConsistencyError(f"{name}: {where} are not the fill byte {fill}")
    return whole[:rows]
