"""Write one rank file of a plan: header first, then each tensor's bytes streamed into place, in order.

Memory is bounded by the chunk size, never by tensor size: plain copies move `chunk_bytes` at a time
with pread; actions that compute (dequantize, quantize, cast) take row chunks of at most
chunk_bytes / 8 source bytes, aligned to 128 rows so no scale block is split.

A quantizing action makes two tensors (weight and scale) that lie apart in the file (scales sort first).
The first one reached is computed and written; the other's bytes are kept in memory for later when they
fit in `stash_bytes`, and recomputed otherwise.

The file is written as `<name>.partial` and hashed as it is written (`write_partial`), then fsynced and
renamed (`commit`), which the caller may overlap with writing the next file. On any error the partial
file is removed; running out of disk space becomes an OutputError naming the file and tensor.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np

from dsv41_convert.errors import OutputError
from dsv41_convert.plan import PAD_BYTE, ROW_ALIGN, OutTensor, RankFile, Read
from dsv41_convert.progress import Progress
from dsv41_convert.safetensors_header import DTYPE_BITS, nbytes, pread_exact
from dsv41_convert.transform import apply, from_bytes, to_bytes

CHUNK_BYTES = 64 << 20
STASH_BYTES = 256 << 20
THROTTLE_ENV = "DSV41_CONVERT_TEST_THROTTLE_S"  # test hook: sleep this long after each chunk
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _row_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return nbytes(dtype, shape[1:]) if shape else nbytes(dtype, shape)


class _Reader:
    """pread access to the source files, one descriptor per file."""

    def __init__(self, src: Path, chunk_bytes: int):
        self.src = src
        self.fds: dict[str, int] = {}
        self.chunk_bytes = chunk_bytes
        self._bufs: list[memoryview] = []
        self._turn = 0

    def buffer(self) -> memoryview:
        """The next of three chunk buffers, in turn: with the writer's queue of one, a buffer comes back
        only after the writer has finished with it (see _Sink)."""
        if not self._bufs:
            self._bufs = [memoryview(bytearray(self.chunk_bytes)) for _ in range(3)]
        self._turn = (self._turn + 1) % 3
        return self._bufs[self._turn]

    def fd(self, file: str) -> int:
        if file not in self.fds:
            self.fds[file] = os.open(self.src / file, os.O_RDONLY)
        return self.fds[file]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def rows(self, rd: Read, a: int, b: int) -> tuple[bytearray | memoryview, int]:
        """Rows [a, b) of the region `rd` (relative to rd.r0), columns selected. -> (bytes, row bytes)"""
        rb = _row_bytes(rd.dtype, rd.shape)
        buf = bytearray((b - a) * rb)
        pread_exact(self.fd(rd.file), memoryview(buf), rd.offset + (rd.r0 + a) * rb, str(self.src / rd.file))
        if rd.c1 < 0:
            return buf, rb
        esz = DTYPE_BITS[rd.dtype] // 8
        cols = np.frombuffer(buf, dtype=np.uint8).reshape(b - a, rb)[:, rd.c0 * esz : rd.c1 * esz]
        return memoryview(np.ascontiguousarray(cols)).cast("B"), (rd.c1 - rd.c0) * esz


class _Sink:
    """Writer of the partial file. A thread hashes and writes while the caller reads and computes the next
    chunk (hashlib and os.write release the GIL): on a slow disk this hides the sha256 cost.

    Handed-over buffers must not change until written: `_copy` cycles three buffers (`_Reader.buffer`)
    through a queue of one, so a buffer is refilled only after the writer has taken the next one.
    """

    def __init__(self, path: Path, label: str, total: int, progress: Progress):
        self.path, self.label, self.total, self.progress = path, label, total, progress
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.sha = hashlib.sha256()
        self.queued = 0  # bytes handed over
        self.done = 0  # bytes written
        self.tensor = "<header>"  # tensor being written (for error messages)
        self.error: BaseException | None = None
        self.throttle = float(os.environ.get(THROTTLE_ENV, "0") or 0)
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._drain, name=f"write {label}", daemon=True)
        self._thread.start()

    def write(self, data, tensor: str = "<header>") -> None:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        self.queued += len(view)
        self._q.put((view, tensor))
        if self.throttle:
            time.sleep(self.throttle)

    def _drain(self) -> None:
        while (item := self._q.get()) is not None:
            if self.error is not None:
                continue
            view, self.tensor = item
            try:
                self.sha.update(view)
                while len(view):
                    n = os.write(self.fd, view)
                    view = view[n:]
                    self.done += n
                self.progress(self.label, self.done, self.total)
            except BaseException as exc:  # handed to the caller by write() / finish()
                self.error = exc

    def finish(self) -> None:
        """Wait for every handed-over byte to be written; raise the writer's error if it had one."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
        if self.error is not None:
            raise self.error

    def fill(self, value: int, count: int, chunk: int, tensor: str) -> None:
        block = bytes([value]) * min(count, chunk)
        while count > 0:
            self.write(block[: min(count, len(block))], tensor)
            count -= len(block)


def write_rank_file(
    rf: RankFile,
    src: Path,
    out: Path,
    quantizer,
    progress: Progress = lambda label, done, total: None,
    chunk_bytes: int = CHUNK_BYTES,
    stash_bytes: int = STASH_BYTES,
) -> tuple[int, str]:
    """Write `rf` to out/rf.file (via rf.file + ".partial"), fsync, rename. -> (size, sha256 hex)"""
    size, sha = write_partial(rf, src, out, quantizer, progress, chunk_bytes, stash_bytes)
    commit(out, rf.file)
    return size, sha


def write_partial(
    rf: RankFile,
    src: Path,
    out: Path,
    quantizer,
    progress: Progress = lambda label, done, total: None,
    chunk_bytes: int = CHUNK_BYTES,
    stash_bytes: int = STASH_BYTES,
) -> tuple[int, str]:
    """Write every byte of `rf` to out/rf.file + ".partial" and close it (no fsync yet: see `commit`).

    -> (size, sha256 hex)
    """
    final, partial = out / rf.file, out / (rf.file + ".partial")
    reader = _Reader(src, chunk_bytes)
    sink = _Sink(partial, rf.file, rf.nbytes, progress)
    try:
        sink.write(rf.header)
        stash: dict[tuple[str, int], list[bytes]] = {}
        written: set[tuple[str, int]] = set()
        for t in rf.tensors:
            start = sink.queued
            if t.action in ("copy", "as_fp4"):  # as_fp4: the I8 bytes are already e2m1 pairs
                _copy(t, reader, sink, chunk_bytes)
            elif t.group:
                _group(t, reader, sink, quantizer, chunk_bytes, stash, written, stash_bytes)
            else:
                for outs in _compute(t, reader, quantizer, chunk_bytes):
                    sink.write(to_bytes(outs[0]), t.name)
            if t.pad_rows:
                sink.fill(PAD_BYTE[t.dtype], t.pad_rows * _row_bytes(t.dtype, t.shape), chunk_bytes, t.name)
            assert sink.queued - start == t.end - t.begin, (t.name, sink.queued - start, t.end - t.begin)
        sink.finish()
        os.close(sink.fd)
        sink.fd = -1
        return sink.done, sink.sha.hexdigest()
    except OSError as exc:
        _discard(sink, partial)
        if exc.errno in _NO_SPACE:
            raise _no_space(final, f"while writing tensor {sink.tensor} ({sink.done} of {rf.nbytes} bytes)") from exc
        raise
    except BaseException:
        _discard(sink, partial)
        raise
    finally:
        reader.close()


def commit(out: Path, file: str) -> None:
    """fsync out/file.partial, then rename it to out/file: a file under its final name is complete and
    on disk. A flush error (a full disk found at writeback) removes the partial file."""
    final, partial = out / file, out / (file + ".partial")
    try:
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, final)
        _fsync_dir(out)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        if exc.errno in _NO_SPACE:
            raise _no_space(final, "while flushing it to disk") from exc
        raise


def _no_space(final: Path, when: str) -> OutputError:
    return OutputError(
        f"{final}: no space left on the device {when}; the partial file was removed; free space and run "
        "again with --resume"
    )


def _discard(sink: _Sink, partial: Path) -> None:
    try:
        sink.finish()
    except BaseException:
        pass
    if sink.fd >= 0:
        os.close(sink.fd)
        sink.fd = -1
    partial.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy(t: OutTensor, reader: _Reader, sink: _Sink, chunk_bytes: int) -> None:
    rd = t.reads[0]
    rb = _row_bytes(rd.dtype, rd.shape)
    rows = rd.r1 - rd.r0
    if rd.c1 < 0:  # one contiguous byte range, through three buffers (see _Sink)
        fd, pos, left = reader.fd(rd.file), rd.offset + rd.r0 * rb, rows * rb
        while left:
            n = min(left, chunk_bytes)
            buf = reader.buffer()[:n]
            pread_exact(fd, buf, pos, str(reader.src / rd.file))
            sink.write(buf, t.name)
            pos, left = pos + n, left - n
        return
    step = max(1, chunk_bytes // max(rb, 1))
    for a in range(0, rows, step):
        data, _ = reader.rows(rd, a, min(rows, a + step))
        sink.write(data, t.name)


def _chunk_rows(t: OutTensor, chunk_bytes: int) -> int:
    rd = t.reads[0]
    width = _row_bytes(rd.dtype, rd.shape)
    if rd.c1 >= 0:
        width = width * (rd.c1 - rd.c0) // rd.shape[1]
    rows = max(1, (chunk_bytes // 8) // max(width, 1))
    return max(ROW_ALIGN, rows // ROW_ALIGN * ROW_ALIGN)


def _compute(t: OutTensor, reader: _Reader, quantizer, chunk_bytes: int):
    """Yield the action's outputs for each row chunk of the tensor's source region."""
    main = t.reads[0]
    rows = main.r1 - main.r0
    step = _chunk_rows(t, chunk_bytes)
    name = f"{reader.src / main.file}: {main.name}"
    for a in range(0, rows, step):
        b = min(rows, a + step)
        inputs = []
        for rd in t.reads:
            ra, rb_ = a // rd.ratio, -(-b // rd.ratio)
            data, width = reader.rows(rd, ra, rb_)
            inputs.append(from_bytes(data, rd.dtype, rb_ - ra, width))
        if len(main.shape) < 2:  # 1-d tensors travel as [rows, 1]
            inputs = [x.reshape(-1) for x in inputs]
        yield apply(t.action, inputs, quantizer, name, t.dtype, t.block)


def _group(t, reader, sink, quantizer, chunk_bytes, stash, written, stash_bytes) -> None:
    """One part of a two-output action: from the stash if the other part left it there, else computed."""
    key, other = (t.group, t.part), (t.group, 1 - t.part)
    if key in stash:
        for data in stash.pop(key):
            sink.write(data, t.name)
        written.add(key)
        return
    keep = other not in written and _part_bytes(t, 1 - t.part) <= stash_bytes
    kept: list[bytes] = []
    for outs in _compute(t, reader, quantizer, chunk_bytes):
        sink.write(to_bytes(outs[t.part]), t.name)
        if keep:
            kept.append(bytes(to_bytes(outs[1 - t.part])))
    if keep:
        stash[other] = kept
    written.add(key)


def _part_bytes(t: OutTensor, part: int) -> int:
    """An upper bound on a group part's size: the weight part is never larger than 4x the source."""
    rd = t.reads[0]
    return 4 * nbytes(rd.dtype, rd.shape)
