"""Whole files against their records (presence, size, then a digest), several files at once: how `check`,
`manifest` (merge), `shard --resume` and `download`'s integrity check decide that a file is what its record
says.

hashlib's update and the file's readinto release the GIL, so threads hash files in parallel: one thread per
usable core, at most MAX_THREADS (each holds one CHUNK buffer), never more than there are files. A file is
hashed by one thread from start to end: sha256 is one sequential chain per file. A size that differs from
the record is reported without reading the file.

Digests: sha256 (our manifests, and the Hub's LFS files) or, where a record has no sha256, the git blob id
(sha1 of b"blob {size}\\0" + content: the Hub's id of a file kept in git itself).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dsv41_convert.file_kinds import special_kind
from dsv41_convert.progress import Progress
from dsv41_convert.store.machine import usable_cores
from dsv41_convert.store.threads import map_stoppable

CHUNK = 16 << 20
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a sha256 as hexdigest() writes it
MAX_THREADS = 8  # 128 MiB of buffers; 16 were no faster on the H200 host, cached or cold (docs/BENCHMARKS.md)
SHA256, GIT_SHA1 = "sha256", "git-sha1"


def hash_file(path: Path, hashes: list, chunk: int = CHUNK, on_bytes: Callable[[int], None] | None = None) -> None:
    """Feed the whole file at `path` into every hashlib object of `hashes`, in one read of `chunk` bytes at a
    time; on_bytes(bytes read so far) after each chunk."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    done = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            for h in hashes:
                h.update(view[:n])
            done += n
            if on_bytes is not None:
                on_bytes(done)


def sha256_of_blocks(blocks: Iterable[memoryview], between: Callable[[], None] | None = None) -> str:
    """sha256 hex of the bytes of `blocks` in order; between() before each block (store.threads' keep_going)."""
    h = hashlib.sha256()
    for block in blocks:
        if between is not None:
            between()
        h.update(block)
    return h.hexdigest()


def hex_digest(
    path: Path, kind: str = SHA256, chunk: int = CHUNK, on_bytes: Callable[[int], None] | None = None
) -> str:
    """`kind` (SHA256 or GIT_SHA1) hex digest of the file at `path`, in one read (hash_file)."""
    if kind == SHA256:
        h = hashlib.sha256()
    elif kind == GIT_SHA1:
        h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    else:
        raise ValueError(f"unknown digest {kind!r}")
    hash_file(path, [h], chunk, on_bytes)
    return h.hexdigest()


def sha256_file(path: Path, chunk: int = CHUNK, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 hex of the file at `path`."""
    return hex_digest(path, SHA256, chunk, on_bytes)


def sampled_sha256(path: Path, blocks: int = 16, block: int = 1 << 20) -> str:
    """sha256 hex of the file's size and `blocks` blocks of `block` bytes spread evenly over it, the first
    and the last included (the whole file when it is smaller): the same for a copy, different for another
    file of the same layout (other weights), for the cost of 16 MiB read, not the file's 64 GB."""
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= blocks * block:
            h.update(f.read())
        else:
            for i in range(blocks):
                f.seek(i * (size - block) // (blocks - 1))
                h.update(f.read(block))
    return h.hexdigest()


@dataclass(frozen=True)
class Recorded:
    """What a record says of a file: its size and digest, and where that record is (for messages).

    sha256 None: the git blob id is compared instead; both None: the size only."""

    size: int
    sha256: str | None
    where: str  # "manifest", "rank fragment of machine 2", ...
    if_missing: str = ""  # advice appended when the file is missing
    git_sha1: str | None = None

    def digest(self) -> tuple[str, str] | None:
        """(kind, expected hex) of the digest to compare, or None for a size-only record."""
        if self.sha256 is not None:
            return SHA256, self.sha256
        return (GIT_SHA1, self.git_sha1) if self.git_sha1 is not None else None


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a file. `kind`: missing, size, sha256 or git-sha1 here (hub/integrity adds
    header and index)."""

    path: str
    kind: str
    found: str
    expected: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind}: found {self.found}, expected {self.expected}"


def difference(path: Path, name: str, rec: Recorded, on_bytes: Callable[[int], None] | None = None) -> Problem | None:
    """None when the file at `path` has the recorded size and digest; else the first thing that differs."""
    if not path.is_file():
        found = (
            "a folder" if path.is_dir() else special_kind(path) or ("a broken link" if path.is_symlink() else "no file")
        )
        return Problem(name, "missing", found, f"{rec.size} bytes")
    size = path.stat().st_size
    if size != rec.size:
        return Problem(name, "size", f"{size} bytes", f"{rec.size} bytes")
    want = rec.digest()
    if want is None:
        return None
    kind, expected = want
    found = hex_digest(path, kind, on_bytes=on_bytes)
    return None if found == expected else Problem(name, kind, found, expected)


def describe(problem: Problem, rec: Recorded) -> str:
    """One line naming the file, what differs and where the record is."""
    name = problem.path
    if problem.kind == "missing" and problem.found != "no file":  # something else holds its name
        return f"{name}: {problem.found} where {rec.where} lists a file of {rec.size} bytes"
    if problem.kind == "missing":
        return f"{name}: missing ({rec.where} lists {rec.size} bytes){rec.if_missing}"
    if problem.kind == "size":
        return f"{name}: {problem.found}, {rec.where} says {rec.size}; truncated or replaced?"
    return f"{name}: {problem.kind} {problem.found[:16]}..., {rec.where} says {problem.expected[:16]}...; corrupt?"


def mismatch(path: Path, name: str, rec: Recorded, on_bytes: Callable[[int], None] | None = None) -> str | None:
    """None when the file at `path` matches `rec`; else describe() of what differs."""
    problem = difference(path, name, rec, on_bytes)
    return None if problem is None else describe(problem, rec)


def hash_threads(files: int) -> int:
    """Threads for hashing `files` files: one per usable core, at most MAX_THREADS and `files`, at least 1."""
    return max(1, min(files, usable_cores(), MAX_THREADS))


def differences(
    files: Mapping[str, tuple[Path, Recorded]], threads: int | None = None, progress: Progress | None = None
) -> dict[str, Problem | None]:
    """difference() of every file, `threads` at a time (None: hash_threads). -> name -> Problem or None,
    in the order of `files`. progress(name, bytes hashed, size) as each file's chunks go by, from 0. An
    OSError while reading, or Ctrl-C / SIGTERM in the calling thread, is raised once the other threads have
    stopped at their next chunk (before: each finished its whole file, tens of seconds for a 10 GB shard,
    and then every file still queued)."""
    threads = hash_threads(len(files)) if threads is None else max(1, threads)

    def one(name: str, keep_going: Callable[[], None]) -> Problem | None:
        path, rec = files[name]

        def on_bytes(done: int) -> None:
            keep_going()
            if progress is not None:
                progress(name, done, rec.size)

        on_bytes(0)
        return difference(path, name, rec, on_bytes=on_bytes)

    return dict(zip(files, map_stoppable(one, list(files), threads, "digest"), strict=True))


def mismatches(
    files: Mapping[str, tuple[Path, Recorded]], threads: int | None = None, progress: Progress | None = None
) -> dict[str, str | None]:
    """differences() as one line each (describe): name -> problem or None, in the order of `files`."""
    found = differences(files, threads, progress)
    return {name: None if p is None else describe(p, files[name][1]) for name, p in found.items()}
