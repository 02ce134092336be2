"""safetensors headers without safe_open: parse one, read tensor bytes with pread, build one from a plan.

`safe_open` maps the whole file, which fails for a 100 GB Engram shard on a machine with less memory
(SPEC §6), so headers are read here (8-byte little-endian length, then JSON) and data by byte range.

The header we write is byte-identical to what `safetensors.torch.save_file(tensors)` writes for the same
tensors: entries sorted by dtype (descending in safetensors' dtype order) then name, compact JSON with
keys dtype, shape, data_offsets, no `__metadata__`, padded with spaces to a multiple of 8. Asked to keep
the given order (`sort=False`), it writes the same JSON with the entries and data in that order.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsv41_convert.errors import NOT_JSON, HeaderError
from dsv41_convert.store.rank_names import RANK_FILE
from dsv41_convert.strict_json import first_repeated

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers too
U64_MAX = 2**64 - 1  # safetensors reads each dimension as an unsigned 64-bit int and refuses a larger one

# safetensors' Dtype enum, in declaration order; save_file sorts tensors by this, descending
DTYPE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
# bits per element
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip
_RANK = {d: i for i, d in enumerate(DTYPE_ORDER)}
_NEG_RANK = {d: -i for i, d in enumerate(DTYPE_ORDER)}  # sort_key's first part, looked up
JSON_PLAIN = re.compile(r"[ !#-\[\]-~]*")  # printable ASCII but `"` and `\`: JSON-quoted as is


def nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    """Bytes of a tensor; sub-byte dtypes (F4) must fill whole bytes, as safetensors requires."""
    bits = DTYPE_BITS[dtype] * math.prod(shape)
    if bits % 8:
        raise HeaderError(f"{dtype} {list(shape)} is not a whole number of bytes")
    return bits // 8


# slotted, not frozen: the real checkpoint has 96k entries, and a frozen dataclass costs twice as much to build
@dataclass(slots=True)
class TensorInfo:
    """One header entry. `begin`/`end` are absolute file offsets (data start already added)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A parsed, checked safetensors header. Tensors are in file order (by offset)."""

    path: str
    file_size: int
    data_start: int
    tensors: dict[str, TensorInfo]


class _Repeats(dict):
    """A JSON object of a header that gives a key twice (json keeps the last one, and safetensors too, where a
    reader keeping the first reads other bytes or another dtype: an audit): `repeated` says which."""

    repeated = ""


def _without_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: a dict, or a _Repeats naming the first key given twice in it, or in an object
    inside it (as "'dtype' of tensor 't'"); read_header refuses a header whose top object is a _Repeats."""
    data = dict(pairs)
    if len(data) != len(pairs) and (key := first_repeated(pairs)) is not None:
        return _repeats(data, _top_key(key))
    for key, value in pairs:
        if isinstance(value, _Repeats):
            return _repeats(data, f"{value.repeated.removeprefix('tensor ')} of {_top_key(key)}")
    return data


def _top_key(key: str) -> str:
    """A top-level key of a header, for a message."""
    return "__metadata__" if key == "__metadata__" else f"tensor {key!r}"


def _repeats(data: dict[str, Any], repeated: str) -> _Repeats:
    flagged = _Repeats(data)
    flagged.repeated = repeated
    return flagged


def read_header(path: Path | str) -> Header:
    """Parse and check the header of one .safetensors file; reads only the header bytes.

    Checks: the length prefix fits the file and the 100 MB limit, the JSON is an object of entries (and
    `__metadata__`, an object of strings) with a known dtype, a shape of non-negative ints and offsets
    matching dtype x shape; the entries tile the data region from 0 to the end of the file with no gap or
    overlap (a truncated file fails here).
    """
    path = str(path)
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise HeaderError(f"{path}: file is {size} bytes, too short for a safetensors header; truncated?")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise HeaderError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; corrupt file?")
            if 8 + n > size:
                raise HeaderError(f"{path}: header length {n} runs past the end of the {size}-byte file; truncated?")
            raw = f.read(n)
    except OSError as exc:
        raise HeaderError(f"{path}: cannot read ({exc.strerror})") from exc
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_without_repeats)
    except NOT_JSON as exc:
        raise HeaderError(f"{path}: header is not valid JSON ({exc}); corrupt file?") from exc
    if isinstance(data, _Repeats):
        raise HeaderError(f"{path}: header gives {data.repeated} twice, with values that may differ; corrupt file?")
    if not isinstance(data, dict):
        raise HeaderError(f"{path}: header is a JSON {type(data).__name__}, expected an object")
    meta = data.pop("__metadata__", None)
    meta = {} if meta is None else meta  # null: none, as safetensors reads it (false, 0, "" are refused)
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise HeaderError(  # safetensors itself refuses such a file, so every loader of the output would
            f"{path}: __metadata__ must be an object of strings, found {json.dumps(meta)[:80]}; corrupt file?"
        )
    start = 8 + n
    entries = _entries(path, data, start)
    entries.sort(key=_FILE_ORDER)
    pos = start
    for t in entries:
        if t.begin != pos:
            if t.begin < pos:
                what = "overlaps the previous tensor"
            elif t.begin >= size:
                what = f"is past the end of the {size}-byte file (a gap of {t.begin - pos} bytes before it); truncated?"
            else:
                what = f"leaves a gap of {t.begin - pos} bytes"
            raise HeaderError(f"{path}: tensor {t.name} starts at data offset {t.begin - start}, which {what}")
        pos = t.end
    if pos != size:
        if pos > size:
            last = entries[-1].name
            short = f"tensor {last} ends at byte {pos} but the file has {size} bytes"
            raise HeaderError(f"{path}: {short}; {_remedy(path)}")
        raise HeaderError(f"{path}: {size - pos} bytes after the last tensor; the header does not cover the file")
    return Header(path, size, start, {t.name: t for t in entries})


def _remedy(path: str) -> str:
    """What to do about a truncated file: a rank file is converted again, anything else fetched again."""
    if RANK_FILE.fullmatch(os.path.basename(path)):
        return "truncated rank file? `shard ... --resume` writes again every file that does not match its manifest"
    return "truncated shard? download it again"


_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_FILE_ORDER = operator.attrgetter("begin", "end")


def _entries(path: str, data: dict, start: int) -> list[TensorInfo]:
    """Every entry of a header, checked. The loop accepts only entries that are plainly right (the real
    checkpoint has 96k; one inlined pass costs half of a call per check); anything else goes to `_entry`,
    which accepts it as well or raises the error that names it."""
    out = []
    append = out.append
    for name, spec in data.items():
        if type(spec) is dict and spec.keys() == _ENTRY_KEYS:
            dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
            bits = DTYPE_BITS.get(dtype) if type(dtype) is str else None
            if bits is not None and type(shape) is list and type(offs) is list and len(offs) == 2:
                for v in shape:
                    if type(v) is not int or v < 0:
                        break
                else:
                    begin, end = offs
                    for v in shape:
                        bits *= v
                    if type(begin) is int and type(end) is int and 0 <= begin <= end and (end - begin) * 8 == bits:
                        if bits or max(shape, default=0) <= U64_MAX:  # a zero-size tensor's other dims: _entry
                            append(TensorInfo(name, dtype, tuple(shape), start + begin, start + end))
                            continue
        append(_entry(path, name, spec, start))
    return out


def _naturals(values: object) -> bool:
    """A list of non-negative ints (bools excluded)."""
    if type(values) is not list:
        return False
    for v in values:  # a plain loop: all() over a generator costs twice as much on 2-element lists
        if type(v) is not int or v < 0:
            return False
    return True


def _entry(path: str, name: str, spec: object, start: int) -> TensorInfo:
    if type(spec) is not dict or spec.keys() != _ENTRY_KEYS:
        raise HeaderError(f"{path}: tensor {name}: entry {spec!r} is not {{dtype, shape, data_offsets}}")
    dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise HeaderError(f"{path}: tensor {name}: unknown dtype {dtype!r}")
    if not _naturals(shape):
        raise HeaderError(f"{path}: tensor {name}: shape {shape!r} is not a list of non-negative ints")
    if max(shape, default=0) > U64_MAX:  # only a zero-size tensor gets here with one: its bytes bound the rest
        raise HeaderError(
            f"{path}: tensor {name}: shape has a dimension past 2**64 - 1, which safetensors cannot read; corrupt file?"
        )
    if not (_naturals(offs) and len(offs) == 2):
        raise HeaderError(f"{path}: tensor {name}: data_offsets {offs!r} is not [begin, end]")
    try:
        size = nbytes(dtype, shape)
    except HeaderError as exc:
        raise HeaderError(f"{path}: tensor {name}: {exc}") from None
    if offs[1] < offs[0] or offs[1] - offs[0] != size:
        raise HeaderError(
            f"{path}: tensor {name}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, {dtype} {shape} needs {size}"
        )
    return TensorInfo(name, dtype, tuple(shape), start + offs[0], start + offs[1])


def pread_exact(fd: int, buf: memoryview, offset: int, path: str = "?") -> None:
    """Fill `buf` from `fd` at `offset`; a short read means the file shrank under us."""
    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got == 0:
            raise HeaderError(f"{path}: unexpected end of file at byte {offset + done}; truncated while reading?")
        done += got


def pread_blocks(fd: int, begin: int, length: int, row: int, block: int, path: str = "?") -> Iterator[memoryview]:
    """`length` bytes of `fd` from `begin`, whole `row`-byte rows of about `block` bytes at a time, read into one
    buffer reused from view to view (each view is valid until the next is asked for)."""
    row = max(row, 1)
    step = max(1, block // row) * row
    buf = memoryview(bytearray(min(step, length)))
    for at in range(0, length, step):
        view = buf[: min(step, length - at)]
        pread_exact(fd, view, begin + at, path)
        yield view


def sort_metadata(path: Path | str) -> None:
    """Sort the `__metadata__` keys of the safetensors file at `path` in place, then fsync it (a file without
    metadata is left as it is).

    safetensors writes the metadata map in an order that changes from process to process (a hash map), so
    the same tensors and metadata saved twice differ in bytes; sorted, they are the same file. The header
    is rewritten in its own bytes (the same entries in another order take the same room), the data is
    not touched.
    """
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None)
        if meta is None:
            return
        header = {"__metadata__": dict(sorted(meta.items())), **header}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) > n:
            raise HeaderError(f"{path}: the sorted header needs {len(text)} bytes, the file has {n}")
        f.seek(8)
        f.write(text + b" " * (n - len(text)))
        f.flush()
        os.fsync(f.fileno())


def sort_key(name: str, dtype: str) -> tuple[int, str]:
    """save_file's order: dtype descending, then name bytewise (UTF-8 keeps code point order, so the str)."""
    return (-_RANK[dtype], name)


def build_header(
    entries: list[tuple[str, str, tuple[int, ...]]], *, sort: bool = True
) -> tuple[bytes, list[tuple[str, int, int]]]:
    """Header bytes (length prefix included) and the layout for tensors (name, dtype, shape).

    sort: save_file's order (dtype, then name); False keeps the entries' order (the published Engram shards).
    -> (header, [(name, begin, end)] in file order, absolute file offsets)
    """
    header, spans = layout_header(entries, sort=sort)
    return header, [(entries[i][0], b, e) for i, b, e in spans]


def layout_header(
    entries: list[tuple[str, str, tuple[int, ...]]], *, sort: bool = True
) -> tuple[bytes, list[tuple[int, int, int]]]:
    """As build_header, with each span naming its entry by position: -> (header, [(i, begin, end)])."""
    return layout_blocks([(name, dtype, ((name, shape),)) for name, dtype, shape in entries], sort=sort)


# A block: (sort name, dtype, members (name, shape) in name order), stored back to back.
Block = tuple[str, str, Sequence[tuple[str, tuple[int, ...]]]]


def layout_blocks(blocks: Sequence[Block], *, sort: bool = True) -> tuple[bytes, list[tuple[int, int, int]]]:
    """Header bytes (length prefix included) for tensors given in blocks, and each block's span.

    save_file's order sorts a block as its sort name: right for a one-tensor block (its own name) and for
    several tensors of one dtype whose names all start with the sort name, when no tensor of another block of
    that dtype has such a name (then nothing sorts between them). A plan's routed experts of one layer on one
    rank are such a block: their ~200 entries are written without a sort key each. sort=False: the blocks'
    own order.
    -> (header, [(i, begin, end)] in file order, absolute file offsets of block i's first and last byte + 1)
    """
    order: Sequence[int] = range(len(blocks))
    if sort:
        keys = [(_NEG_RANK[dtype], name) for name, dtype, _ in blocks]  # sort_key, without a call per entry
        order = sorted(order, key=keys.__getitem__)
    # one check for every name: JSON_PLAIN matches a concatenation iff it matches each part
    plain = JSON_PLAIN.fullmatch("".join(name for b in blocks for name, _ in b[2])) is not None
    parts = []
    spans = []
    pos = 0
    sized: dict[str, dict[tuple[int, ...], tuple[int, str]]] = {}  # a rank file has a few dozen (dtype, shape)
    for i in order:
        _, dtype, members = blocks[i]
        sized_as = sized.setdefault(dtype, {})
        begin = pos
        for name, shape in members:
            known = sized_as.get(shape)
            if known is None:
                known = sized_as[shape] = (nbytes(dtype, shape), ",".join(map(str, shape)))
            size, dims = known
            # compact JSON written by hand: 100k entries through json.dumps cost seconds
            quoted = f'"{name}"' if plain or JSON_PLAIN.fullmatch(name) else json.dumps(name, ensure_ascii=False)
            parts.append(f'{quoted}:{{"dtype":"{dtype}","shape":[{dims}],"data_offsets":[{pos},{pos + size}]}}')
            pos += size
        spans.append((i, begin, pos))
    text = ("{" + ",".join(parts) + "}").encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, [(i, start + b, start + e) for i, b, e in spans]
