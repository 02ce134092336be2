"""The inverse of the converter's splits: rank files `model{r}-mp{N}.safetensors` merged back to tp 1, in memory.

    names = unshard_names(folder)                       # cheap: headers only
    state = unshard_tensors(folder, ["layers.3.attn.wq_b.weight", ...])
    with RankFiles(folder) as ranks:                    # many requests: headers read, files opened once
        layer = unshard_tensors(ranks, names_of_one_layer)
        damaged = replica_mismatches(ranks)             # replicated tensors compared byte for byte

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

import functools
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.plan import PAD_BYTE
from dsv41_convert.convert.rules import Split, expert_index, match_rule
from dsv41_convert.errors import ShardConsistencyError, VerifyInputError
from dsv41_convert.quant.file_dtypes import tensor_from_bytes
from dsv41_convert.store.rank_names import rank_file_name, rank_files_in
from dsv41_convert.store.safetensors_header import Header, TensorInfo, pread_exact, read_header

_ENGRAM = re.compile(r"layers\.(\d+)\.engram\.embed\.(weight|scale)")


def rank_tp(folder: Path, tp: int | None = None) -> int:
    """The tp of the rank files in `folder`; with several sets present, `tp` must pick one. VerifyInputError
    where there are none, or the set is incomplete or has a rank too many (verify cannot run the model: an
    input error, as a truncated file is)."""
    sets = rank_files_in(folder)
    found = sorted(sets)
    if not found:
        raise VerifyInputError(f"{folder}: no rank files (model{{r}}-mp{{N}}.safetensors); is it a shard output?")
    if tp is not None and tp not in sets:
        raise VerifyInputError(f"{folder}: no model*-mp{tp}.safetensors files (found tp {found})")
    if tp is None and len(found) != 1:
        raise VerifyInputError(f"{folder}: rank files for tp {found}; pass the tp to pick one")
    tp = tp if tp is not None else found[0]
    missing = [rank_file_name(r, tp) for r in range(tp) if r not in sets[tp]]
    if missing:
        raise VerifyInputError(f"{folder}: tp {tp} needs {tp} rank files; missing {', '.join(missing)}")
    stray = [rank_file_name(r, tp) for r in sorted(sets[tp]) if r >= tp]
    if stray:
        raise VerifyInputError(f"{folder}: {', '.join(stray)}: no such rank in a tp-{tp} conversion; remove it")
    return tp


class RankFiles:
    """The rank files of one tp-N conversion in `folder`: the set checked (`rank_tp`), every header read and
    every file opened once, until close() (or the end of a `with`). Reads are pread on the shared descriptors,
    so several threads may read at once.

        with RankFiles(folder) as ranks:
            ranks.tp, ranks.headers[r].tensors[name], ranks.read(r, name)
    """

    def __init__(self, folder: Path, tp: int | None = None):
        self.folder = Path(folder)
        self.tp = rank_tp(self.folder, tp)
        self.headers: list[Header] = [read_header(self.folder / rank_file_name(r, self.tp)) for r in range(self.tp)]
        self._fds: list[int] = []
        try:
            for h in self.headers:
                self._fds.append(os.open(h.path, os.O_RDONLY))
        except OSError:
            self.close()
            raise

    @functools.cached_property
    def args(self) -> ModelArgs:
        return load_model_args(self.folder / "config.json")

    def names(self) -> list[str]:
        """Every tensor name of the merged tp-1 state dict (the union of the rank files' names), sorted."""
        return sorted(set().union(*(h.tensors for h in self.headers)))

    def fd(self, rank: int) -> int:
        """Rank `rank`'s file, open for reading."""
        return self._fds[rank]

    def raw(self, rank: int, info: TensorInfo) -> bytearray:
        """The bytes of tensor `info` of rank `rank`'s file."""
        buf = bytearray(info.nbytes)
        if buf:
            pread_exact(self.fd(rank), memoryview(buf), info.begin, self.headers[rank].path)
        return buf

    def read(self, rank: int, name: str) -> Tensor:
        """One tensor of rank `rank`'s file in its file dtype.

        -> info.shape  SAFETENSORS_DTYPES[info.dtype] (F4: float4_e2m1fn_x2 [..., last / 2])
        """
        info = self.headers[rank].tensors[name]
        return tensor_from_bytes(self.raw(rank, info), info.dtype, info.shape)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unshard_names(folder: Path, tp: int | None = None) -> list[str]:
    """Every tensor name of the merged tp-1 state dict (the union of the rank files' names), sorted."""
    with RankFiles(folder, tp) as ranks:
        return ranks.names()


def replica_mismatches(ranks: RankFiles) -> list[str]:
    """Every replicated tensor (split NONE: norms, gates, the aligner ...) whose bytes or header entry differ
    between the rank files, as 'NAME: replicated, but ranks [r, ...] differ from rank 0'. Reads those tensors
    only, one at a time (at most two copies in memory: rank 0's and one other's).

    Every rank runs its own copy, so a copy damaged on one rank changes that rank's partial sums only a
    little, often within a tolerance; this compares the bytes themselves."""
    headers = ranks.headers
    found = []
    for name, info in sorted(headers[0].tensors.items()):
        if match_rule(name).split is not Split.NONE:
            continue
        first = ranks.raw(0, info)
        differ = [
            r
            for r in range(1, ranks.tp)
            if (other := headers[r].tensors.get(name)) is None
            or (other.dtype, other.shape) != (info.dtype, info.shape)
            or ranks.raw(r, other) != first
        ]
        if differ:
            found.append(f"{name}: replicated, but ranks {differ} differ from rank 0")
    return found


def _bytes(t: Tensor) -> Tensor:
    """The same memory as uint8 with the same leading dims (1-byte dtypes) or as is (wider dtypes)."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    """torch.cat for every dtype (fp8 / fp4 concatenated as their bytes)."""
    return torch.cat([_bytes(p) for p in parts], dim=dim).view(parts[0].dtype)


def unshard_tensors(
    source: Path | RankFiles, names: Iterable[str] | None = None, tp: int | None = None
) -> dict[str, Tensor]:
    """Merge the rank files of `source` (a folder, or its RankFiles kept open) back to tp-1 tensors (see the
    module docstring).

    names: tp-1 state-dict names to merge (None: every name, see unshard_names)
    -> name -> tensor in the rank files' dtype (F4 as float4_e2m1fn_x2 [out, in/2])
    Raises ShardConsistencyError naming the tensor and ranks when the rank files disagree.
    """
    if not isinstance(source, RankFiles):
        with RankFiles(source, tp) as ranks:
            return unshard_tensors(ranks, names)
    ranks = source
    out = {}
    for name in ranks.names() if names is None else names:
        holders = [r for r in range(ranks.tp) if name in ranks.headers[r].tensors]
        if not holders:
            raise ShardConsistencyError(f"{name}: in none of the {ranks.tp} rank files of {ranks.folder}")
        out[name] = _merge(name, {r: ranks.read(r, name) for r in holders}, ranks.tp, ranks.args)
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
