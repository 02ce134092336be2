"""Write one rank file of a plan: header first, then each tensor's bytes streamed into place, in order.

Memory is bounded by the chunk size, never by tensor size: plain copies move `chunk_bytes` at a time with
pread (copy_file_range, hashing from a map of the source, was measured slower on the dev box:
docs/BENCHMARKS.md) into buffers that start at the output position's offset within a block, which an O_DIRECT
writer sends to the device without copying them again (direct_write.py); actions that compute (dequantize,
quantize, cast) take row chunks of at most COMPUTE_CHUNKS x chunk_bytes / 8 source bytes (on CUDA 64 MiB:
stream.GPU_BLOCK_BYTES), aligned to 128 rows so no scale block is split, read ahead in a thread and overlapped
with the GPU (stream.py). Reads stay ahead of the writer through the page cache: at each tensor the kernel is
asked (POSIX_FADV_WILLNEED) for the source regions of the next tensors, up to PREFETCH_BYTES, so the disk
reads while it writes. On CUDA, threads also read the computed tensors' row blocks ahead across tensors, up to
READ_AHEAD_BYTES, straight into one pinned ring the GPU copies from (prefetch.py, ring.py), which
`_Reader.rows` then takes without a copy.

A quantizing action makes two tensors (weight and scale) that lie apart in the file. Each chunk is
computed once: the part reached first is written in order; the other part's bytes are kept in memory
while all kept parts fit in `stash_bytes`, and otherwise written ahead with pwrite at their final
offset (known from the plan), then hashed by reading them back when the in-order writer reaches them
(sink.py). Only a resume that lost a stash computes a part again.

The file is written as `<name>.partial` and hashed as it is written (`write_partial`), then fsynced and
renamed (`commit`), which the caller may overlap with writing the next file. Every `journal_bytes` a
checkpoint goes to OUT/.dsv41-convert/<name>.journal (journal.py: offset, sha256 of each range, the
ranges written ahead), each after the data it covers is fsynced. With `resume`, a partial file whose
journal verifies is continued from its last checkpoint (only [0, R) is re-read, to rebuild the hash);
otherwise it is rewritten from byte 0. On an error the partial file and its journal are removed (running
out of disk space becomes an OutputError naming the file and tensor); on Ctrl-C they are kept for --resume.

transform.py (torch) is imported where a tensor is computed by torch, not at the top: a file of copied
tensors, or of tensors that numpy computes on the CPU (stream.numpy_computes: the fp4 -> fp8 cast, e4m3 ->
bf16), is written without torch (its import is 1.5 s on the dev box, 3-5 s on the 16-core H200 host).
"""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsv41_convert import interrupts
from dsv41_convert.convert.plan import ROW_ALIGN, OutTensor, RankFile, Read, pad_byte
from dsv41_convert.convert.prefetch import Prefetch
from dsv41_convert.errors import OutputError
from dsv41_convert.progress import Progress, add_seconds
from dsv41_convert.quant.byte_checks import flat_index, require_finite_copy
from dsv41_convert.store import journal
from dsv41_convert.store.direct_write import BLOCK, aligned_buffer
from dsv41_convert.store.journal import Aside, JournalWriter, ResumePoint, journal_path
from dsv41_convert.store.manifest import fsync_path
from dsv41_convert.store.own_files import remove_link
from dsv41_convert.store.safetensors_header import DTYPE_BITS, nbytes, pread_exact
from dsv41_convert.store.sink import THROTTLE_ENV as THROTTLE_ENV  # the test hook, re-exported
from dsv41_convert.store.sink import Sink

COPIED = ("copy", "as_fp4")  # actions whose bytes are copied unchanged (as_fp4: I8 bytes are e2m1 pairs)
CHUNK_BYTES = 4 << 20  # a copy's step; dev box, shard --tp 8 of the medium preset, one worker, cached source, CPU
# s per GB written (2026-12-02): 16 MiB 1.27-1.33, 8 MiB 1.24-1.29, 4 MiB 1.19-1.26, 2 MiB 1.17-1.24, 1 MiB 1.22-1.28
COMPUTE_CHUNKS = 4  # computed row chunks are sized from COMPUTE_CHUNKS x chunk_bytes on the CPU: 16 MiB, as when
# copies took 16 MiB steps (quantizing the bf16 medium preset with 4 MiB: 4-5% more CPU)
STASH_BYTES = 256 << 20
PREFETCH_BYTES = 256 << 20  # read-ahead hint; dev box, tp 8 of 23.7 GB: 64 MiB 84-90 s, 256 MiB 73-81 s
READ_AHEAD_BYTES = 256 << 20  # source bytes read ahead into (pinned) buffers at most (prefetch.Prefetch)
READ_THREADS = 4  # reads in flight of the Prefetch
READ_AHEAD_DEVICES = ("cuda",)  # on these devices only (on CPU the quantizers, not the reads, set the pace)
JOURNAL_BYTES = 1 << 30  # a resume checkpoint every this many bytes; each costs an fdatasync (256 MiB: +7 s of 33)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def row_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of one row (along dim 0) of a tensor of `dtype` and `shape`; a 0-d tensor's whole size."""
    return nbytes(dtype, shape[1:]) if shape else nbytes(dtype, shape)


class _Reader:
    """pread access to the source files, one descriptor per file."""

    def __init__(self, src: Path, chunk_bytes: int):
        self.src = src
        self.fds: dict[str, int] = {}
        self.paths: dict[str, str] = {}  # file -> its path, for error messages (made once, not per read)
        self.chunk_bytes = chunk_bytes
        self._bufs: list[memoryview] = []
        self._scratch = memoryview(b"")
        self.ahead: Prefetch | None = None  # reads ahead that rows() takes its bytes from
        self._turn = 0
        self._hinted_to = 0  # tensors before this index have had their prefetch hint
        self._hinted: deque[tuple[int, int]] = deque()  # (tensor index, bytes hinted) not yet reached, in order
        self._hinted_bytes = 0  # their sum

    def buffer(self, skew: int = 0) -> memoryview:
        """The next of three chunk buffers, in turn: with the writer's queue of one, a buffer comes back
        only after the writer has finished with it (see Sink). It starts `skew` (< BLOCK) bytes past a block
        boundary: at the file position's skew, an O_DIRECT writer sends it without a copy (direct_write)."""
        if not self._bufs:
            self._bufs = [memoryview(aligned_buffer(self.chunk_bytes + BLOCK)) for _ in range(3)]
        self._turn = (self._turn + 1) % 3
        return self._bufs[self._turn][skew : skew + self.chunk_bytes]

    def scratch(self, n: int) -> memoryview:
        """n bytes of one reused buffer, for rows read only to have columns picked from them into other memory
        (`rows` with `into`; without it, the columns of one row are a view of the rows' buffer): fresh memory
        each time cost its zeroing and page faults (memset alone 1.1% of a one-worker profile, gone with it)."""
        if len(self._scratch) < n:
            self._scratch = memoryview(aligned_buffer(max(n, self.chunk_bytes)))
        return self._scratch[:n]

    def prefetch(self, tensors: list[OutTensor], i: int) -> None:
        """Tensor i is next: let the kernel start reading the sources of the tensors after it, up to
        PREFETCH_BYTES ahead (each region capped at that too), so reads overlap the writing. With `ahead`,
        only copied tensors: its threads read the computed ones (and a hint can block the caller while
        the disk is busy)."""
        if self._hinted_to <= i:
            self._hinted_to, self._hinted, self._hinted_bytes = i + 1, deque(), 0
        while self._hinted and self._hinted[0][0] <= i:
            self._hinted_bytes -= self._hinted.popleft()[1]
        while self._hinted_to < len(tensors) and self._hinted_bytes < PREFETCH_BYTES:
            j = self._hinted_to
            size = 0
            for rd in tensors[j].reads if self.ahead is None or tensors[j].action in COPIED else ():
                rb = row_bytes(rd.dtype, rd.shape)
                n = min((rd.r1 - rd.r0) * rb, PREFETCH_BYTES)
                os.posix_fadvise(self.fd(rd.file), rd.offset + rd.r0 * rb, n, os.POSIX_FADV_WILLNEED)
                size += n
            self._hinted.append((j, size))
            self._hinted_bytes += size
            self._hinted_to += 1

    def fd(self, file: str) -> int:
        if file not in self.fds:
            self.paths[file] = str(self.src / file)
            self.fds[file] = os.open(self.paths[file], os.O_RDONLY)
        return self.fds[file]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def rows(self, rd: Read, a: int, b: int, alloc=bytearray, whole: bool = False,
             into: memoryview | None = None) -> tuple[memoryview | bytes, int]:  # fmt: skip
        """Rows [a, b) of the region `rd` (relative to rd.r0), columns selected unless `whole`.
        -> (bytes, row bytes)

        alloc(n): the writable buffer whole rows are read into, unless `ahead` has read them already
        (then a buffer of its ring on CUDA, which the caller releases: Prefetch.release).
        into: where selected columns go (at least their bytes long; the result is a view of it), else a
        new array.
        """
        rb = row_bytes(rd.dtype, rd.shape)
        pos, n = rd.offset + (rd.r0 + a) * rb, (b - a) * rb
        buf = self.ahead.take(rd.file, pos, n) if self.ahead is not None else None
        if buf is None:
            buf = alloc(n)
            pread_exact(self.fd(rd.file), memoryview(buf), pos, self.paths[rd.file])
        if rd.c1 < 0 or whole:
            return buf, rb
        esz = DTYPE_BITS[rd.dtype] // 8
        width = (rd.c1 - rd.c0) * esz
        cols = np.frombuffer(buf, dtype=np.uint8).reshape(b - a, rb)[:, rd.c0 * esz : rd.c1 * esz]
        if into is None:
            return memoryview(np.ascontiguousarray(cols)).cast("B"), width
        np.copyto(np.frombuffer(into, dtype=np.uint8, count=(b - a) * width).reshape(b - a, width), cols)
        return into[: (b - a) * width], width


def write_rank_file(
    rf: RankFile,
    src: Path,
    out: Path,
    quantizer,
    progress: Progress = lambda label, done, total: None,
    chunk_bytes: int = CHUNK_BYTES,
    stash_bytes: int = STASH_BYTES,
    on_commit: Callable[[int, str], None] | None = None,
    before_commit: Callable[[str], None] | None = None,
    **resume_kw,
) -> tuple[int, str]:
    """Write `rf` to out/rf.file (via rf.file + ".partial"), fsync, rename. -> (size, sha256 hex)

    on_commit(size, sha256 hex): called once the file is in place, before its journal goes (`commit`).
    before_commit(file name): called once every byte is written, before the file takes its name; raises to keep
    it partial.
    `resume_kw` go to `write_partial` (plan_digest, resume, journal_bytes, stats, direct_io).
    """
    size, sha = write_partial(rf, src, out, quantizer, progress, chunk_bytes, stash_bytes, **resume_kw)
    if before_commit is not None:
        before_commit(rf.file)
    commit(out, rf.file, None if on_commit is None else lambda: on_commit(size, sha))
    return size, sha


def write_partial(
    rf: RankFile,
    src: Path,
    out: Path,
    quantizer,
    progress: Progress = lambda label, done, total: None,
    chunk_bytes: int = CHUNK_BYTES,
    stash_bytes: int = STASH_BYTES,
    *,
    plan_digest: str = "",
    resume: bool = False,
    journal_bytes: int = JOURNAL_BYTES,
    stats: dict | None = None,
    direct_io: bool = True,
) -> tuple[int, str]:
    """Write every byte of `rf` to out/rf.file + ".partial" and close it (no fsync yet: see `commit`).

    resume: go on from the last verified checkpoint of an existing partial file (else from byte 0).
    stats:  if given, filled with resumed_from (bytes kept from the partial file), resume (why / why not)
            and stages (seconds: read, wait_read, read_ahead, h2d, kernel, d2h, launch, wait_gpu, write, hash).
    direct_io: append with O_DIRECT (bypassing the page cache) where the file system allows it.
    -> (size, sha256 hex)
    """
    final, partial = out / rf.file, out / (rf.file + ".partial")
    jpath = journal_path(out, rf.file)
    head = journal.header(rf.file, rf.nbytes, plan_digest, chunk_bytes)
    head["compute_chunk_bytes"] = compute_chunk_bytes(chunk_bytes, quantizer.device)  # chunk j's rows
    remove_link(partial)  # not a partial file of ours (a link, or a file of other names): written, it changed them
    start, why = journal.load(jpath, partial, head) if resume else (None, "not resuming")
    if start is not None and not _fits(start, rf):
        start, why = None, "journal does not fit the plan's tensors"
    if stats is not None:
        stats.update(resumed_from=start.end if start else 0, resume=why)
    reader = _Reader(src, chunk_bytes)
    interrupts.check()  # no file begun after Ctrl-C (a worker takes it only at checks: execute._interrupt_worker)
    sink = Sink(partial, rf.file, rf.nbytes, progress, start, direct=direct_io)
    try:
        with interrupts.deferred():  # the writer's threads share queues with this one (interrupts.py)
            if journal_bytes:
                sink.journal = JournalWriter(jpath, journal.restart_lines(head, start), sink.fd)
                sink.journal_bytes = journal_bytes
            warm = reader.ahead = _prefetch(rf, src, start, quantizer.device, chunk_bytes, sink.stages)
            try:
                _write_tensors(rf, reader, sink, quantizer, chunk_bytes, stash_bytes, start, warm)
            finally:
                if warm is not None:
                    warm.close()
                    if warm.ring is not None:
                        from dsv41_convert.convert import ring, stream

                        ring.give_back(warm.ring, stream.pinned)
                if quantizer.device == "cuda":
                    from dsv41_convert.convert import stream

                    stream.drop_cached_pinned()
            sink.finish()
            if sink.journal is not None:
                sink.journal.close()
        os.close(sink.fd)
        sink.fd = -1
        if stats is not None:
            stats["stages"] = dict(sink.stages)
        return sink.done, sink.sha.hexdigest()
    except OSError as exc:
        _discard(sink, partial, jpath)
        if exc.errno in _NO_SPACE:
            late = "; it refused them at the flush" if sink.done >= rf.nbytes else ""  # read as finished before
            where = f"while writing tensor {sink.tensor} ({sink.done} of {rf.nbytes} bytes handed to the disk{late})"
            raise _no_space(final, where, exc.errno) from exc
        raise
    except KeyboardInterrupt:  # keep what is on disk for --resume
        _discard(sink, partial, jpath, keep=True)
        raise
    except BaseException:
        _discard(sink, partial, jpath)
        raise
    finally:
        reader.close()


def _prefetch(rf: RankFile, src: Path, start: ResumePoint | None, device: str, chunk_bytes: int, stages):
    """On CUDA, threads reading ahead the source pieces of the computed tensors' row blocks, into the
    process's pinned ring (ring.borrow: READ_AHEAD_BYTES, allocated once), in the order _write_tensors
    asks for them (a group is computed at its first part). -> a prefetch.Prefetch, or None"""
    if device not in READ_AHEAD_DEVICES or not READ_AHEAD_BYTES:
        return None
    from dsv41_convert.convert import ring, stream

    first, chunk0 = (start.tensor, start.chunk) if start is not None else (0, 0)
    read_back = {a.tensor for a in start.asides} if start is not None else set()  # written ahead before
    parts = {(t.group, t.part): i for i, t in enumerate(rf.tensors) if t.group}
    redo = -1  # a group part computed again: its partner, resumed mid-tensor with no part written ahead
    if start is not None and chunk0 and rf.tensors[first].group:
        g = rf.tensors[first]
        if all(rf.tensors[a.tensor].group != g.group for a in start.asides):
            redo = parts[(g.group, 1 - g.part)]
    pieces = []
    for i in range(first, len(rf.tensors)):
        t = rf.tensors[i]
        computed_before = t.group and first <= parts[(t.group, 1 - t.part)] < i and i != redo
        if t.action in COPIED or i in read_back or computed_before:
            continue  # copied (the prefetch hint covers it), read back, or computed with its group's first part
        step = _chunk_rows(t, compute_chunk_bytes(chunk_bytes, device))
        for a in stream.block_starts(t, step, chunk0 if i == first else 0):
            for rd, ra, rb_ in stream.block_rows(t, a, min(a + step, t.reads[0].r1 - t.reads[0].r0)):
                rb = row_bytes(rd.dtype, rd.shape)
                pieces.append((i, rd.file, rd.offset + (rd.r0 + ra) * rb, (rb_ - ra) * rb))
    if device != "cuda":
        return Prefetch(src, pieces, READ_AHEAD_BYTES, bytearray, READ_THREADS, stages)
    pinned = ring.borrow(READ_AHEAD_BYTES, stream.pinned)  # allocated once per run, reused by every file
    return Prefetch(src, pieces, READ_AHEAD_BYTES, bytearray, READ_THREADS, stages, pinned, stream.settle_device)


def _write_tensors(rf, reader, sink, quantizer, chunk_bytes, stash_bytes, start: ResumePoint | None, warm=None) -> None:
    """Every tensor of `rf` from `start` (or the header) on, in file order; `warm` (a prefetch.Prefetch)
    is told which tensor is being written."""
    first = 0
    if start is None:
        sink.write(rf.header)
    else:
        first = start.tensor
        sink.asides = {rf.tensors[a.tensor].group: a for a in start.asides}
    parts = {(t.group, t.part): i for i, t in enumerate(rf.tensors) if t.group}
    written = {(t.group, t.part) for t in rf.tensors[:first] if t.group}
    stash = _Stash()
    for i in range(first, len(rf.tensors)):
        t = rf.tensors[i]
        chunk, skip = (start.chunk, start.skip) if start is not None and i == start.tensor else (0, 0)
        sink.begin_tensor(i, t.begin, chunk)
        if warm is not None:
            warm.at(i)
        if PREFETCH_BYTES:
            t0 = time.perf_counter()
            reader.prefetch(rf.tensors, i)
            add_seconds(sink.stages, "hint", time.perf_counter() - t0)
        ahead = sink.asides.get(t.group) if t.group else None
        if ahead is not None and ahead.tensor == i:
            _read_back(t, ahead, sink, skip, chunk_bytes)
        elif t.action in COPIED:  # as_fp4: the I8 bytes are already e2m1 pairs
            t0 = time.perf_counter()
            _copy(t, reader, sink, chunk_bytes, skip)
            add_seconds(sink.stages, "copy", time.perf_counter() - t0)
        elif t.group:
            other = rf.tensors[parts[(t.group, 1 - t.part)]]
            _group(t, other, parts, reader, sink, quantizer, chunk_bytes, stash, written, stash_bytes, chunk)
        else:
            with closing(_compute(t, reader, quantizer, chunk_bytes, chunk, sink.stages)) as chunks:
                for outs in chunks:
                    sink.write(_raw(outs[0]), t.name)
        if t.pad_rows:
            sink.fill(pad_byte(t.dtype), t.pad_rows * row_bytes(t.dtype, t.shape), chunk_bytes, t.name)
        if ahead is not None and ahead.tensor == i:
            del sink.asides[t.group]
        assert sink.queued == t.end, (t.name, sink.queued, t.end)


@dataclass
class _Stash:
    """Later group parts kept in memory until reached, at most `stash_bytes` in all."""

    parts: dict[tuple[str, int], list[bytes]] = field(default_factory=dict)
    used: int = 0


def _fits(start: ResumePoint, rf: RankFile) -> bool:
    """The checkpoint names a tensor of this file at its recorded offset, and asides at group parts' offsets."""
    if not 0 <= start.tensor < len(rf.tensors):
        return False
    t = rf.tensors[start.tensor]
    if t.begin + start.skip != start.end or start.end > _data_end(t):
        return False
    rd = t.reads[0]
    if t.action in COPIED and rd.c1 >= 0 and start.skip % ((rd.c1 - rd.c0) * DTYPE_BITS[rd.dtype] // 8):
        return False
    parts = {(x.group, x.part): i for i, x in enumerate(rf.tensors) if x.group}
    for a in start.asides:
        q = rf.tensors[a.tensor] if 0 <= a.tensor < len(rf.tensors) else None
        if q is None or not q.group or a.begin != q.begin or a.end > _data_end(q) or a.tensor < start.tensor:
            return False
        owner = parts.get((q.group, 1 - q.part))
        if owner is None or (a.end < _data_end(q) and owner != start.tensor):  # only the part being computed
            return False  # may be short
    return True


def _data_end(t: OutTensor) -> int:
    """Where the tensor's data ends and its padding rows begin."""
    return t.end - t.pad_rows * row_bytes(t.dtype, t.shape)


def commit(out: Path, file: str, record: Callable[[], None] | None = None) -> None:
    """fsync out/file.partial, then rename it to out/file: a file under its final name is complete and
    on disk; then record() (the done record), then its journal is dropped, so that a run killed in between
    leaves a record of ours for the file (a final name without either was a user's to the next run). A
    flush error (a full disk found at writeback) removes the partial file."""
    final, partial = out / file, out / (file + ".partial")
    try:
        fsync_path(partial)
        os.replace(partial, final)
        fsync_path(out)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        journal_path(out, file).unlink(missing_ok=True)
        if exc.errno in _NO_SPACE:
            raise _no_space(final, "while flushing it to disk", exc.errno) from exc
        raise
    if record is not None:
        record()
    journal_path(out, file).unlink(missing_ok=True)


def _no_space(final: Path, when: str, code: int) -> OutputError:
    """The error of a write the disk refused (`code`, one of _NO_SPACE): a full disk or quota, or EFBIG, a file
    larger than the file system takes (FAT32: 4 GiB) or than the process's file-size limit (`ulimit -f`), which
    no free space lifts: said as a full disk, a resume failed at the same byte."""
    if code == errno.EFBIG:
        return OutputError(
            f"{final}: larger than the file system or the file-size limit (ulimit -f) allows {when}; the partial "
            "file was removed; write to a file system that takes files this large, or raise the limit, and run "
            "again with --resume"
        )
    return OutputError(
        f"{final}: no space left on the device {when}; the partial file was removed; free space and run "
        "again with --resume"
    )


def _discard(sink: Sink, partial: Path, jpath: Path, keep: bool = False) -> None:
    """Stop the writer and the journal; remove the partial file and its journal unless `keep`."""
    try:
        sink.finish()
    except BaseException:
        pass
    if sink.journal is not None:
        sink.journal.close(raise_error=False)
    if sink.fd >= 0:
        os.close(sink.fd)
        sink.fd = -1
    if not keep:
        partial.unlink(missing_ok=True)
        jpath.unlink(missing_ok=True)


def _copy(t: OutTensor, reader: _Reader, sink: Sink, chunk_bytes: int, skip: int = 0) -> None:
    """The tensor's source bytes from byte `skip` on (a resumed file; a whole number of rows), unchanged."""
    rd = t.reads[0]
    rb, bits = row_bytes(rd.dtype, rd.shape), DTYPE_BITS[rd.dtype]
    rows = rd.r1 - rd.r0
    if rd.c1 < 0:  # one contiguous byte range, through three buffers (see Sink)
        fd, pos, left = reader.fd(rd.file), rd.offset + rd.r0 * rb + skip, rows * rb - skip
        while left:
            n = min(left, chunk_bytes)
            if left > n:  # the kernel reads the next chunk while this one is hashed and written
                os.posix_fadvise(fd, pos + n, min(left - n, chunk_bytes), os.POSIX_FADV_WILLNEED)
            buf = reader.buffer(sink.queued % BLOCK)[:n]
            pread_exact(fd, buf, pos, reader.paths[rd.file])
            _require_finite(buf, rd, reader, lambda i, e=(pos - rd.offset) * 8 // bits: flat_index(rd.shape, e + i))
            sink.write(buf, t.name)
            pos, left = pos + n, left - n
        return
    # columns of whole rows: the rows into a reused buffer, the columns into one of the three (see Sink)
    cols = rd.c1 - rd.c0
    step, width = max(1, chunk_bytes // max(rb, 1)), cols * bits // 8
    for a in range(skip // width, rows, step):
        b = min(rows, a + step)
        if (b - a) * width <= chunk_bytes:
            data, _ = reader.rows(rd, a, b, reader.scratch, into=reader.buffer(sink.queued % BLOCK))
        else:  # one row's columns outgrow a chunk: fresh memory (one row's columns may be a view of it)
            data, _ = reader.rows(rd, a, b)
        r = rd.r0 + a
        _require_finite(data, rd, reader, lambda i, r=r: [r + i // cols, *flat_index(rd.shape[1:], rd.c0 + i % cols)])
        sink.write(data, t.name)


def _require_finite(data, rd: Read, reader: _Reader, index) -> None:
    """FormatError naming the source file, the tensor and `index(i)` (its index in the source tensor) of the
    first NaN or infinity in `data`, elements of `rd` about to be copied unchanged."""
    require_finite_copy(data, rd.dtype, f"{reader.paths[rd.file]}: {rd.name}", rd.shape, index)


def _raw(x) -> memoryview:
    """The row-major bytes of a computed output: a numpy array (stream.numpy_computes) or a CPU tensor."""
    if isinstance(x, np.ndarray):
        return memoryview(np.ascontiguousarray(x)).cast("B")
    from dsv41_convert.convert.transform import to_bytes

    return to_bytes(x)


def _read_back(t: OutTensor, ahead: Aside, sink: Sink, skip: int, chunk_bytes: int) -> None:
    """A group part written ahead: hand its data bytes (from `skip` on) to the sink to hash, not write."""
    end = _data_end(t)
    assert sink.ahead_end(ahead) == end, (t.name, sink.ahead_end(ahead), end)  # its computing part queued it all
    pos = t.begin + skip
    while pos < end:
        n = min(chunk_bytes, end - pos)
        sink.read_back(pos, n, t.name)
        pos += n


def _chunk_rows(t: OutTensor, chunk_bytes: int) -> int:
    rd = t.reads[0]
    width = row_bytes(rd.dtype, rd.shape)
    if rd.c1 >= 0:
        width = width * (rd.c1 - rd.c0) // rd.shape[1]
    rows = max(1, (chunk_bytes // 8) // max(width, 1))
    return max(ROW_ALIGN, rows // ROW_ALIGN * ROW_ALIGN)


def compute_chunk_bytes(chunk_bytes: int, device: str) -> int:
    """The `chunk_bytes` that sizes computed row chunks (chunk_bytes / 8 source bytes each): COMPUTE_CHUNKS
    copy chunks on the CPU, more on CUDA, where per-chunk costs (launches, copies, a sync) dominate small
    chunks and the intermediates live on the GPU. Recorded in the journal: a resume on the other device (or
    with other chunk sizes) restarts the file."""
    if device != "cuda":
        return COMPUTE_CHUNKS * chunk_bytes
    from dsv41_convert.convert import stream

    return max(chunk_bytes, 8 * stream.GPU_BLOCK_BYTES)


def _compute(t: OutTensor, reader: _Reader, quantizer, chunk_bytes: int, first: int = 0, stages=None):
    """Yield the action's outputs for each row chunk of the tensor's source region, from chunk `first` on
    (reads ahead in a thread; on CUDA, overlapped copies: stream.py). Close it when done early."""
    from dsv41_convert.convert import stream

    step = _chunk_rows(t, compute_chunk_bytes(chunk_bytes, quantizer.device))
    return stream.blocks(t, reader, quantizer, step, first, stages)


def _group(t, other, parts, reader, sink, quantizer, chunk_bytes, stash, written, stash_bytes, first) -> None:
    """One part of a two-output action (weight, scale), each chunk computed once.

    The part reached first is computed; the other part's bytes are stashed in memory if they fit in
    `stash_bytes`, else written ahead at their offsets (an Aside, read back later). When neither is
    possible (its stash was lost to a restart), the part is computed again here.
    """
    key, okey = (t.group, t.part), (t.group, 1 - t.part)
    if key in stash.parts:
        for data in stash.parts.pop(key):
            sink.write(data, t.name)
            stash.used -= len(data)
        written.add(key)
        return
    ahead = sink.asides.get(t.group)  # set: this part was started by a run that then stopped
    fresh = okey not in written and first == 0
    if ahead is None and fresh and stash.used + _data_end(other) - other.begin > stash_bytes:
        ahead = sink.asides[t.group] = Aside(parts[okey], other.begin, other.begin)
        sink.dirty.add(t.group)
    keep = ahead is None and fresh
    if keep:
        sink.mark_ok = False  # a stash dies with the process: no checkpoint until this part is done
    kept: list[bytes] = []
    with closing(_compute(t, reader, quantizer, chunk_bytes, first, sink.stages)) as chunks:
        for outs in chunks:
            if ahead is not None:  # queued before the sink's checkpoint after this chunk, which records it
                sink.write_ahead(ahead, _raw(outs[1 - t.part]), t.name)
                sink.dirty.add(t.group)
            sink.write(_raw(outs[t.part]), t.name)
            if keep:
                kept.append(bytes(_raw(outs[1 - t.part])))
                stash.used += len(kept[-1])
    if keep:
        stash.parts[okey] = kept
        sink.mark_ok = True
    written.add(key)
