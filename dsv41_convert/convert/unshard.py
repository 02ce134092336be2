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
import hashlib
import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import Tensor

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.plan import fill_text, pad_byte
from dsv41_convert.convert.rules import Split, expert_index, match_rule, rule_of, split_dim
from dsv41_convert.errors import ShardConsistencyError, VerifyInputError, first_few
from dsv41_convert.file_kinds import refuse_non_file
from dsv41_convert.numbers import counted
from dsv41_convert.progress import Progress, Tally
from dsv41_convert.quant.file_dtypes import tensor_from_bytes
from dsv41_convert.store.file_digest import sha256_of_blocks
from dsv41_convert.store.rank_names import rank_file_name, rank_files_in
from dsv41_convert.store.safetensors_header import (
    DTYPE_BITS,
    Header,
    TensorInfo,
    pread_blocks,
    pread_exact,
    read_header,
)

_ENGRAM = re.compile(r"layers\.(\d+)\.engram\.embed\.(weight|scale)")
MISSING_NAMED = 32  # rank files named as missing at most; past it, counted


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
        raise VerifyInputError(f"{folder}: rank files for tp {found}; pass --tp to pick one")
    tp = tp if tp is not None else found[0]
    # the ranks below tp not held, the first MISSING_NAMED of them: a file named model0-mp1000000000000000000
    # listed every rank up to 10**18 as missing, and verify ran until killed (a helper's hunt)
    n_missing = tp - sum(r < tp for r in sets[tp])
    absent = (r for r in itertools.count() if r not in sets[tp])
    missing = [rank_file_name(r, tp) for r in itertools.islice(absent, min(n_missing, MISSING_NAMED))]
    for name in missing:  # a folder at the name was said "missing", where check said what it is (an audit)
        refuse_non_file(folder / name, VerifyInputError)
    if missing:
        more = f", ... ({n_missing:,} in all)" if n_missing > len(missing) else ""
        raise VerifyInputError(f"{folder}: tp {tp} needs {tp} rank files; missing {', '.join(missing)}{more}")
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

    def where(self, rank: int, name: str) -> str:
        """Rank `rank`'s file and tensor `name`, for a read's error: a file cut short after it was opened was
        named without the tensor being read."""
        return f"{self.headers[rank].path}: tensor {name}"

    def raw(self, rank: int, info: TensorInfo) -> bytearray:
        """The bytes of tensor `info` of rank `rank`'s file."""
        buf = bytearray(info.nbytes)
        if buf:
            pread_exact(self.fd(rank), memoryview(buf), info.begin, self.where(rank, info.name))
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


REPLICAS = "replicas"  # replica_mismatches' progress label


def replica_mismatches(ranks: RankFiles, progress: Progress | None = None) -> list[str]:
    """Every replicated tensor (split NONE: norms, gates, the aligner ...) whose bytes or header entry differ
    between the rank files, as "NAME: replicated, but rank r's copy differs from the other N ranks'" (or the
    groups of ranks holding each copy). Reads those tensors only, MERGE_BLOCK bytes of two copies at a time;
    progress(REPLICAS, done, total) in bytes of the first copies times tp (29 GB of the real model at tp 8).

    Every rank runs its own copy, so a copy damaged on one rank changes that rank's partial sums only a
    little, often within a tolerance; this compares the bytes themselves. Also every Engram table's padding
    rows (the last ranks'), which no prompt reads and only the tp-1 replay's merge checked: not the
    converter's fill, they are a rank set no conversion writes."""
    # every rank's names: a replica missing from rank 0 alone was in no list, and only the model's load said so
    rules = {name: rule_of(name) for name in ranks.names()}
    names = [name for name, rule in rules.items() if rule is not None]  # the model's load names the others
    replicated = {name for name in names if rules[name].split is Split.NONE}
    tally = Tally(progress, REPLICAS, ranks.tp * sum(_first_copy(ranks, name).nbytes for name in replicated))
    found = []
    for name in names:
        split = rules[name].split
        try:
            if split is Split.NONE:
                copies = {r: h.tensors.get(name) for r, h in enumerate(ranks.headers)}
                for view in _replica_blocks(ranks, name, copies, MERGE_BLOCK):
                    tally.add(ranks.tp * len(view))
            elif split is Split.ROWS_PADDED:
                merge = merge_of(ranks, name)
                _check_padding(ranks, merge)
        except ShardConsistencyError as exc:
            found.append(str(exc))
    return found


def shares_agree(folder: Path, tp: int, progress: Progress | None = None) -> list[str]:
    """For `manifest` (store.manifest_merge.merge) of rank files gathered from several shares: replica_mismatches
    of the tp-`tp` rank files in `folder`, said as one problem, the sign of shares of two sources (their plan
    digest covers the index and headers, so two checkpoints of one layout share it; their replicas differ)."""
    with RankFiles(folder, tp) as ranks:
        differ = replica_mismatches(ranks, progress)
    if not differ:
        return []
    others = [m.split(": ", 1)[0] for m in differ[1:]]
    return [
        f"{counted(len(differ), 'replicated tensor', ('differs', 'differ'))} between the rank files ({differ[0]}"
        + (f"; also {first_few(others)}" if others else "")
        + "): shares converted from different sources? convert every share from one source"
    ]


MERGE_BLOCK = 64 << 20  # bytes of merged rows a merge reads at a time, beyond the result it builds


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
        merge = merge_of(ranks, name)
        buf = bytearray(merge.nbytes)
        at = 0
        for block in merged_blocks(ranks, merge):
            buf[at : at + len(block)] = block
            at += len(block)
        out[name] = tensor_from_bytes(buf, merge.dtype, merge.shape)
    return out


def merged_sha256(ranks: RankFiles, name: str, between: Callable[[], None] | None = None) -> str:
    """sha256 of tensor `name` merged to tp 1 (the bytes unshard_tensors gives), read MERGE_BLOCK at a time:
    the merged tensor is never whole in memory (an Engram table of the real model is 98 GB). between():
    called before each block (store.threads' keep_going)."""
    return sha256_of_blocks(merged_blocks(ranks, merge_of(ranks, name)), between)


def piece_sha256(ranks: RankFiles, rank: int, info: TensorInfo, between: Callable[[], None] | None = None) -> str:
    """sha256 of tensor `info` as rank `rank`'s file holds it, read MERGE_BLOCK at a time."""
    return sha256_of_blocks(_piece_blocks(ranks, rank, info, MERGE_BLOCK, info.nbytes), between)


def cut_sha256(ranks: RankFiles, name: str, tp: int, between: Callable[[], None] | None = None) -> list[str | None]:
    """sha256 of the piece of tensor `name` that each rank file of a tp-`tp` conversion would hold, cut from
    these rank files' merge (the inverse of the merge, by the same rule: equal row or column pieces, an
    Engram table's ceil(rows / tp) rows per rank with the last padded by the converter's fill, an expert on
    its owner, a replica on every rank), one merged block at a time. -> per rank, None where it holds none.
    So rank files of any tp compare with digests recorded at another (verify's weights check)."""
    merge = merge_of(ranks, name)
    if merge.split in (Split.NONE, Split.EXPERT):  # whole on every rank, or on its owner alone
        whole = sha256_of_blocks(merged_blocks(ranks, merge), between)
        owner = _owner(name, tp, ranks.args) if merge.split is Split.EXPERT else None
        return [whole if owner in (None, r) else None for r in range(tp)]
    hashes = [hashlib.sha256() for _ in range(tp)]
    row = merge.nbytes // max(merge.rows, 1)
    if merge.split is Split.DIM1:
        piece = row // tp
        for view in merged_blocks(ranks, merge):
            if between is not None:
                between()
            rows = np.frombuffer(view, dtype=np.uint8).reshape(-1, row)
            for r, h in enumerate(hashes):
                h.update(np.ascontiguousarray(rows[:, r * piece : (r + 1) * piece]))
        return [h.hexdigest() for h in hashes]
    k = -(-merge.rows // tp)  # DIM0: rows / tp exactly (merge_of's pieces are equal)
    at = 0  # merged rows hashed so far
    for view in merged_blocks(ranks, merge):
        if between is not None:
            between()
        n = len(view) // row
        for r in range(at // k, (at + n - 1) // k + 1) if n else ():
            lo, hi = max(r * k, at), min((r + 1) * k, at + n)
            hashes[r].update(view[(lo - at) * row : (hi - at) * row])
        at += n
    if merge.split is Split.ROWS_PADDED:  # the last ranks' padding rows, as shard writes them
        for r in range(merge.rows // k, tp):
            pad = (r + 1) * k - max(merge.rows, r * k)
            hashes[r].update(bytes([pad_byte(merge.dtype)]) * (pad * row))
    return [h.hexdigest() for h in hashes]


@dataclass(frozen=True)
class Merge:
    """How one tp-1 tensor is rebuilt from the rank files, as their headers say (checked by merge_of)."""

    name: str
    split: Split
    holders: tuple[int, ...]  # the ranks holding a piece, in rank order
    dtype: str  # the header's dtype name
    shape: tuple[int, ...]  # the merged tensor's (header, logical) shape
    rows: int  # merged rows kept: past them, a ROWS_PADDED table's padding

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BITS[self.dtype] // 8


def merge_of(ranks: RankFiles, name: str) -> Merge:
    """The Merge of `name`, every disagreement the headers show raised (ShardConsistencyError): a piece
    missing, an expert on another rank than its owner, pieces of a split that differ in shape or dtype, an
    Engram table's rows per rank not ceil(rows / N). The bytes of replicas and padding are checked as
    merged_blocks reads them."""
    holders = tuple(r for r in range(ranks.tp) if name in ranks.headers[r].tensors)
    if not holders:
        raise ShardConsistencyError(f"{name}: in none of the {ranks.tp} rank files of {ranks.folder}")
    split = match_rule(name).split
    if split is not Split.EXPERT and len(holders) != ranks.tp:
        missing = sorted(set(range(ranks.tp)) - set(holders))
        raise ShardConsistencyError(f"{name}: missing from rank files {missing} (every rank must hold a piece)")
    info = ranks.headers[holders[0]].tensors[name]
    shape = info.shape
    if split is Split.EXPERT:
        _check_owner(name, holders, ranks.tp, ranks.args)
    elif split is not Split.NONE:  # replicas that differ in shape are named with those that differ in bytes
        pieces = {r: ranks.headers[r].tensors[name] for r in holders}
        if len({p.shape for p in pieces.values()}) != 1:
            found = ", ".join(f"rank {r}: {list(p.shape)}" for r, p in pieces.items())
            raise ShardConsistencyError(
                f"{name}: rank pieces differ in shape ({found}); a {split} split has equal pieces"
            )
        if len({p.dtype for p in pieces.values()}) != 1:
            found = ", ".join(f"rank {r}: {p.dtype}" for r, p in pieces.items())
            raise ShardConsistencyError(f"{name}: rank pieces differ in dtype ({found})")
        if len(shape) <= split_dim(split):  # the dim read below was a bare IndexError (a traceback)
            raise ShardConsistencyError(
                f"{name}: {list(shape)} on every rank; a {split} split cuts dim {split_dim(split)}"
            )
        if split is Split.DIM1:
            shape = (shape[0], shape[1] * ranks.tp, *shape[2:])
        else:
            shape = (shape[0] * ranks.tp, *shape[1:])
    rows = shape[0] if shape else 1
    if split is Split.ROWS_PADDED:
        rows = _table_rows(name, info.shape[0], ranks.tp, ranks.args)
        shape = (rows, *shape[1:])
    return Merge(name, split, holders, info.dtype, tuple(shape), rows)


def merged_blocks(ranks: RankFiles, merge: Merge, block: int | None = None) -> Iterator[memoryview]:
    """The bytes of `merge`'s tp-1 tensor in order, about `block` bytes (whole rows) at a time. Each view is
    valid until the next one is asked for. Raises ShardConsistencyError where replicas differ in bytes or
    an Engram table's padding is not the converter's fill. block None: MERGE_BLOCK."""
    block = block or MERGE_BLOCK
    infos = {r: ranks.headers[r].tensors[merge.name] for r in merge.holders}
    if merge.split is Split.DIM1:
        yield from _interleaved(ranks, merge, infos, block)
        return
    if merge.split is Split.ROWS_PADDED:
        _check_padding(ranks, merge)
    if merge.split is Split.NONE:
        yield from _replica_blocks(ranks, merge.name, infos, block)
        return
    left = merge.nbytes  # a ROWS_PADDED table stops before its padding
    for r in merge.holders:
        for view in _piece_blocks(ranks, r, infos[r], block, min(left, infos[r].nbytes)):
            left -= len(view)
            yield view


def _row_bytes(info: TensorInfo) -> int:
    return info.nbytes // info.shape[0] if info.shape and info.shape[0] else max(info.nbytes, 1)


def _piece_blocks(ranks: RankFiles, rank: int, info: TensorInfo, block: int, length: int) -> Iterator[memoryview]:
    """The first `length` bytes of tensor `info` of rank `rank`'s file, whole rows of about `block` bytes at
    a time (pread_blocks)."""
    return pread_blocks(ranks.fd(rank), info.begin, length, _row_bytes(info), block, ranks.where(rank, info.name))


def _first_copy(ranks: RankFiles, name: str) -> TensorInfo:
    """The header entry of `name` in the first rank file that holds it."""
    return next(h.tensors[name] for h in ranks.headers if name in h.tensors)


def _replica_blocks(
    ranks: RankFiles, name: str, copies: dict[int, TensorInfo | None], block: int
) -> Iterator[memoryview]:
    """The first rank's copy of replicated tensor `name` (rank 0's, unless it has none); every other rank's
    copy (None: it has none) compared with it block by block, a rank that differs named once all blocks are
    read."""
    r0 = min(r for r, i in copies.items() if i is not None)
    first = copies[r0]
    differ = {r for r, i in copies.items() if i is None or (i.dtype, i.shape) != (first.dtype, first.shape)}
    at, other = 0, bytearray(0)
    for view in _piece_blocks(ranks, r0, first, block, first.nbytes):
        if len(other) != len(view):  # a bytearray of the view's length compares by memcmp (a memoryview: bytewise)
            other = bytearray(len(view))
        for r, info in copies.items():
            if r != r0 and r not in differ:  # one differing block names a rank; the rest of its copy is not read
                pread_exact(ranks.fd(r), memoryview(other), info.begin + at, ranks.where(r, name))
                if other != view:
                    differ.add(r)
        at += len(view)
        yield view
    if differ:
        raise ShardConsistencyError(_replica_disagreement(ranks, name, copies))


def _replica_disagreement(ranks: RankFiles, name: str, copies: dict[int, TensorInfo | None]) -> str:
    """Which ranks hold which copy of replicated tensor `name` (read again, whole: only on a failure), saying
    which rank is the odd one where one copy is the others' majority. Comparing with rank 0 alone blamed
    every other rank for a copy damaged on rank 0."""
    missing = sorted(r for r, info in copies.items() if info is None)
    if missing:  # no copy there to compare: "ranks 0 and 1 hold different copies" where rank 1 held none
        return f"{name}: replicated, but missing from rank files {missing} (every rank must hold a copy)"
    groups: dict[tuple, list[int]] = {}
    for r, info in copies.items():
        key = (info.dtype, tuple(info.shape), piece_sha256(ranks, r, info))
        groups.setdefault(key, []).append(r)
    held = sorted(groups.values(), key=len, reverse=True)
    if len(held) == 2 and len(held[1]) == 1 and len(held[0]) > 1:
        return f"{name}: replicated, but rank {held[1][0]}'s copy differs from the other {len(held[0])} ranks'"
    if len(copies) == 2:
        return f"{name}: replicated, but ranks 0 and 1 hold different copies (two copies cannot say which is wrong)"
    return f"{name}: replicated, but the ranks hold {len(held)} different copies: " + " / ".join(
        f"ranks {g}" for g in sorted(held)
    )


def _interleaved(ranks: RankFiles, merge: Merge, infos: dict[int, TensorInfo], block: int) -> Iterator[memoryview]:
    """A DIM1 split's merged rows: each rank's piece of row i, in rank order, then row i + 1."""
    piece = _row_bytes(infos[0])
    rows_per_block = max(1, block // (piece * ranks.tp))
    out = np.empty((min(rows_per_block, merge.rows), piece * ranks.tp), dtype=np.uint8)
    part = np.empty((out.shape[0], piece), dtype=np.uint8)
    for r0 in range(0, merge.rows, rows_per_block):
        n = min(rows_per_block, merge.rows - r0)
        for r in merge.holders:
            at = infos[r].begin + r0 * piece
            pread_exact(ranks.fd(r), memoryview(part[:n]).cast("B"), at, ranks.where(r, merge.name))
            out[:n, r * piece : (r + 1) * piece] = part[:n]
        yield memoryview(out[:n]).cast("B")


def _owner(name: str, tp: int, args: ModelArgs) -> int:
    """The rank of a tp-`tp` conversion that holds routed expert tensor `name`."""
    is_mtp, e = expert_index(name)
    return e // ((args.dspark_n_routed_experts if is_mtp else args.n_routed_experts) // tp)


def _check_owner(name: str, holders: tuple[int, ...], tp: int, args: ModelArgs) -> None:
    owner = _owner(name, tp, args)
    if holders != (owner,):
        raise ShardConsistencyError(f"{name}: held by ranks {list(holders)}, expected rank {owner} alone")


def _table_rows(name: str, per_rank: int, tp: int, args: ModelArgs) -> int:
    """The config's rows of Engram table `name`; each rank must hold ceil(rows / tp) of them (the last padded).
    ShardConsistencyError where the config gives its layer no Engram (it was a bare ValueError: a traceback)."""
    layer = int(_ENGRAM.fullmatch(name).group(1))
    if layer not in args.engram_layer_ids:
        raise ShardConsistencyError(
            f"{name}: layer {layer} has no Engram table (engram_layer_ids {list(args.engram_layer_ids)})"
        )
    rows = args.engram_num_embeddings[args.engram_layer_ids.index(layer)]
    k = -(-rows // tp)
    if per_rank != k:
        raise ShardConsistencyError(
            f"{name}: {per_rank} rows per rank, expected ceil({rows}/{tp}) = {k} (the last rank padded)"
        )
    return rows


def _check_padding(ranks: RankFiles, merge: Merge) -> None:
    """The padding rows after an Engram table's config rows (on the last ranks) must be the converter's fill."""
    infos = {r: ranks.headers[r].tensors[merge.name] for r in merge.holders}
    k = infos[0].shape[0]
    row = _row_bytes(infos[0])
    fill = pad_byte(merge.dtype)
    for r in range(merge.rows // k, ranks.tp):
        first = max(merge.rows - r * k, 0)  # this rank's first padding row
        pad = bytearray((k - first) * row)
        pread_exact(ranks.fd(r), memoryview(pad), infos[r].begin + first * row, ranks.where(r, merge.name))
        if pad != bytes([fill]) * len(pad):
            where = f"padding rows {merge.rows}..{k * ranks.tp - 1} (ranks {merge.rows // k}..{ranks.tp - 1})"
            raise ShardConsistencyError(f"{merge.name}: {where} are not the fill byte {fill_text(merge.dtype)}")
