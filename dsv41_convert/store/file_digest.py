"""Whole files against their records (size, then sha256), several files at once: how `check`, `manifest`
(merge) and `shard --resume` decide that a finished file is still what was written.

hashlib's update and the file's readinto release the GIL, so threads hash files in parallel: one thread per
usable core, at most MAX_THREADS (each holds one CHUNK buffer), never more than there are files. A file is
hashed by one thread from start to end: sha256 is one sequential chain per file. A size that differs from
the record is reported without reading the file.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsv41_convert.progress import Progress
from dsv41_convert.store.machine import usable_cores

CHUNK = 16 << 20
MAX_THREADS = 8  # 128 MiB of buffers; 16 were no faster on the H200 host, cached or cold (docs/BENCHMARKS.md)


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


def sha256_file(path: Path, chunk: int = CHUNK, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 hex of the file at `path` (hash_file)."""
    h = hashlib.sha256()
    hash_file(path, [h], chunk, on_bytes)
    return h.hexdigest()


@dataclass(frozen=True)
class Recorded:
    """What a record says of a file: its size and sha256, and where that record is (for messages)."""

    size: int
    sha256: str
    where: str  # "manifest", "rank fragment of machine 2", ...
    if_missing: str = ""  # advice appended when the file is missing


def mismatch(path: Path, name: str, rec: Recorded, on_bytes: Callable[[int], None] | None = None) -> str | None:
    """None when the file at `path` has the recorded size and sha256; else one line naming `name` and what differs."""
    if not path.is_file():
        return f"{name}: missing ({rec.where} lists {rec.size} bytes){rec.if_missing}"
    size = path.stat().st_size
    if size != rec.size:
        return f"{name}: {size} bytes, {rec.where} says {rec.size}; truncated or replaced?"
    digest = sha256_file(path, on_bytes=on_bytes)
    if digest != rec.sha256:
        return f"{name}: sha256 {digest[:16]}..., {rec.where} says {rec.sha256[:16]}...; corrupt?"
    return None


def hash_threads(files: int) -> int:
    """Threads for hashing `files` files: one per usable core, at most MAX_THREADS and `files`, at least 1."""
    return max(1, min(files, usable_cores(), MAX_THREADS))


def mismatches(
    files: Mapping[str, tuple[Path, Recorded]], threads: int | None = None, progress: Progress | None = None
) -> dict[str, str | None]:
    """mismatch() of every file, `threads` at a time (None: hash_threads). -> name -> problem or None, in the
    order of `files`. progress(name, bytes hashed, size) as each file's chunks go by; an OSError while reading
    is raised (the files already started are finished first)."""
    threads = hash_threads(len(files)) if threads is None else max(1, threads)

    def one(name: str) -> str | None:
        path, rec = files[name]
        if progress is None:
            return mismatch(path, name, rec)
        progress(name, 0, rec.size)
        return mismatch(path, name, rec, on_bytes=lambda done: progress(name, done, rec.size))

    with ThreadPoolExecutor(threads, thread_name_prefix="sha256") as pool:
        return dict(zip(files, pool.map(one, files), strict=True))
