"""The resume journal of one partial rank file: how much of OUT/<file>.partial is on disk and intact.

OUT/.dsv41-convert/<file>.journal holds JSON lines. The first names the file, its size, the plan digest
and the chunk size; each later line is a checkpoint:

  {"end": R, "sha256": sha256 of bytes [0, R),
   "tensor": i, "chunk": j, "skip": s,                      # where the writer goes on: tensor i, data chunk j,
                                                            # s bytes into that tensor
   "asides": [{"tensor": q, "begin": b, "end": e, "sha256": sha256 of bytes [b, e)}],
   "check": the first 16 hex digits of the sha256 of the line's other fields (sorted-key JSON)}

Bytes [0, R) are written in order. `asides` are later parts of two-output actions written ahead at their
final offsets (write.py); each covers [b, e) of tensor q. A line lists only the asides that grew since the
line before; the state at a checkpoint is the latest entry for each q at or after its tensor i.

Ordering: the writer thread hands a checkpoint over only after writing every byte before R; this thread
then runs fdatasync on the partial file (which also covers every range written ahead before that point)
and only then appends the line and fsyncs the journal. After a crash or power loss the journal can lag
the data, never lead it; a torn last line is ignored.

The prefix digest is a copy of the writer's whole-file hash state, so checkpoints cost no second pass
over the bytes. `load` re-reads [0, R) of the partial file, comparing the digest at every checkpoint
(reading is far cheaper than recomputing), re-reads each aside, and returns where to go on with the
hash state of [0, R). Any
mismatch, or a journal that does not describe this file, means a clean restart of the file (None), never
a file stitched from unverified bytes. A journal from another plan (other options or source) is an
OutputError, as a done record from another plan is.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv41_convert import interrupts
from dsv41_convert.errors import NOT_JSON, OutputError
from dsv41_convert.store.manifest import fsync_path
from dsv41_convert.store.own_files import open_own

FORMAT = "dsv41-convert journal v2"  # v2: each checkpoint carries `check` (v1 journals restart their file)
READ_BYTES = 16 << 20


@dataclass
class Aside:
    """A later group part written ahead at its final offset: bytes [begin, end) of tensor `tensor`."""

    tensor: int
    begin: int
    end: int
    sha: Any = field(default_factory=hashlib.sha256)  # sha256 of [begin, end)

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "begin": self.begin, "end": self.end, "sha256": self.sha.copy().hexdigest()}


@dataclass
class ResumePoint:
    """Where a verified partial file goes on: bytes [0, end) are kept, `sha` is their sha256 state."""

    end: int
    tensor: int
    chunk: int
    skip: int
    sha: Any
    asides: list[Aside]


def journal_path(out: Path, file: str, done_dir: str = ".dsv41-convert") -> Path:
    return out / done_dir / f"{file}.journal"


def header(file: str, size: int, plan_digest: str, chunk_bytes: int) -> dict[str, Any]:
    return {"format": FORMAT, "file": file, "size": size, "plan_digest": plan_digest, "chunk_bytes": chunk_bytes}


class JournalWriter:
    """Appends checkpoints from a thread, each after an fdatasync of the data file (see the module doc)."""

    def __init__(self, path: Path, first: list[dict[str, Any]], data_fd: int):
        """Start the journal afresh with `first` (the header, and on resume one checkpoint for the kept prefix)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.data_fd = path, data_fd
        tmp = path.with_name(path.name + ".tmp")
        # a torn line of the old journal must not end up mid-file
        with open(open_own(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
            f.write("".join(_encode(r) for r in first).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.error: BaseException | None = None
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"journal {path.name}", daemon=True)
        self._thread.start()

    def put(self, record: dict[str, Any]) -> None:
        self._q.put(record)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._q.get()]
            while True:  # one fdatasync covers every checkpoint handed over so far
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            lines = [r for r in batch if r is not None]
            if not lines or self.error is not None:
                continue
            try:
                os.fdatasync(self.data_fd)
                os.write(self.fd, "".join(_encode(r) for r in lines).encode())
                os.fsync(self.fd)
            except OSError as exc:  # raised by close(); the data file's own writes report a full disk
                self.error = exc

    def close(self, raise_error: bool = True) -> None:
        """Write every pending checkpoint and close; raises the thread's error if it had one."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if raise_error and self.error is not None:
            raise self.error


def check_plan(path: Path, partial: Path, plan_digest: str) -> None:
    """OutputError if a partial file with a journal was started by another plan (read before any write)."""
    if not partial.exists():
        return
    try:
        with open(path, "rb") as f:
            found = json.loads(f.readline())
    except (OSError, *NOT_JSON):
        return  # no usable journal: the file starts again
    if isinstance(found, dict) and found.get("plan_digest") not in (None, plan_digest):
        raise _other_plan(partial, found.get("plan_digest"), plan_digest)


def _other_plan(partial: Path, found: Any, now: str) -> OutputError:
    return OutputError(
        f"{partial}: started by a run with other options or another source (plan digest "
        f"{str(found)[:12]}, now {now[:12]}); use --overwrite to replace it"
    )


def load(path: Path, partial: Path, head: dict[str, Any]) -> tuple[ResumePoint | None, str]:
    """Verify the partial file against its journal. -> (where to go on, or None to restart; why)"""
    try:
        lines = path.read_bytes().rstrip(b"\n").split(b"\n")
    except FileNotFoundError:
        return None, "no journal"
    if not partial.exists():
        return None, "no partial file"
    try:
        found = json.loads(lines[0])
    except NOT_JSON:
        return None, "unreadable journal header"
    if not isinstance(found, dict):
        return None, "unreadable journal header"
    if found.get("plan_digest") != head["plan_digest"] and found.get("file") == head["file"]:
        raise _other_plan(partial, found.get("plan_digest"), head["plan_digest"])
    if found != head:
        return None, f"journal describes another file or chunk size ({found}, now {head})"
    marks = []
    for i, raw in enumerate(lines[1:], start=1):
        if not raw:
            continue
        try:
            marks.append(_checkpoint(json.loads(raw)))
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:  # a torn last line: the crash came while appending it
                break
            return None, f"journal line {i + 1} is corrupt"
    if not marks:
        return None, "no checkpoint yet"
    return _verify(partial, marks, head["size"])


def _check_of(rec: dict[str, Any]) -> str:
    """The digest a checkpoint line carries of its other fields (`check`)."""
    body = json.dumps({k: v for k, v in rec.items() if k != "check"}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _encode(rec: dict[str, Any]) -> str:
    """One journal line: the header as it is, a checkpoint with its `check`, so that a line changed since it
    was written (a flipped digit of `chunk`, which picks the next compute chunk and which neither the partial
    file's digests nor write._fits cover: an audit resumed from an edited one) is a corrupt line, not a place
    to go on from."""
    return json.dumps(rec if "end" not in rec else rec | {"check": _check_of(rec)}) + "\n"


def _checkpoint(rec: Any) -> dict[str, Any]:
    if rec.get("check") != _check_of(rec):
        raise ValueError("its check does not match its fields")
    keys = ("end", "tensor", "chunk", "skip")
    if not all(isinstance(rec[k], int) and rec[k] >= 0 for k in keys) or not isinstance(rec["sha256"], str):
        raise ValueError(rec)
    for a in rec["asides"]:
        if not (isinstance(a["tensor"], int) and 0 <= a["begin"] <= a["end"] and isinstance(a["sha256"], str)):
            raise ValueError(a)
    return rec


def _verify(partial: Path, marks: list[dict[str, Any]], size: int) -> tuple[ResumePoint | None, str]:
    last = marks[-1]
    latest = {}
    for m in marks:
        latest.update({a["tensor"]: a for a in m["asides"]})
    pending = [a for q, a in sorted(latest.items()) if q >= last["tensor"]]
    have = partial.stat().st_size
    if have < last["end"] or any(a["end"] > min(have, size) for a in pending):
        return None, "partial file shorter than its journal"
    whole = hashlib.sha256()
    with open(partial, "rb", buffering=0) as f:
        pos = 0
        for m in marks:
            if m["end"] < pos:
                return None, f"journal goes backwards at byte {m['end']}"
            _hash_range(f, pos, m["end"], whole)
            if whole.copy().hexdigest() != m["sha256"]:
                return None, f"bytes [0, {m['end']}) differ from the journal"
            pos = m["end"]
        asides = []
        for a in pending:
            h = _hash_range(f, a["begin"], a["end"])
            if h.hexdigest() != a["sha256"]:
                return None, f"bytes [{a['begin']}, {a['end']}) written ahead differ from the journal"
            asides.append(Aside(a["tensor"], a["begin"], a["end"], h))
    point = ResumePoint(last["end"], last["tensor"], last["chunk"], last["skip"], whole, asides)
    return point, f"resumed at byte {last['end']}"


def restart_lines(head: dict[str, Any], point: ResumePoint | None) -> list[dict[str, Any]]:
    """The journal's first lines for a run: the header, and on resume one checkpoint covering [0, point.end)."""
    if point is None:
        return [head]
    mark = {"end": point.end, "sha256": point.sha.copy().hexdigest(), "tensor": point.tensor}
    mark |= {"chunk": point.chunk, "skip": point.skip, "asides": [a.to_json() for a in point.asides]}
    return [head, mark]


def _hash_range(f, begin: int, end: int, h=None):
    """Feed bytes [begin, end) of open file `f` into `h` (a new sha256 if None). -> h

    Checks for Ctrl-C at every read: a writer worker takes it only there (interrupts.interrupt_later), and
    a resumed partial file of tens of GB is hashed whole before its first chunk is written."""
    h = hashlib.sha256() if h is None else h
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    f.seek(begin)
    left = end - begin
    while left:
        interrupts.check()
        n = f.readinto(view[: min(left, READ_BYTES)])
        if not n:
            raise OSError(f"{f.name}: ends before byte {end}")
        h.update(view[:n])
        left -= n
    return h
