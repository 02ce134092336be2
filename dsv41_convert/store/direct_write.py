"""Appending to a file, through O_DIRECT or through the page cache.

O_DIRECT: bytes go from aligned staging pieces (or the caller's own memory, below) straight to the device;
`depth` pieces are in flight at once, each written by its own thread with pwrite, so the device always has
work queued. A buffered writer instead spends CPU copying every byte into the page cache, and the kernel
writes back while the caller reads its next chunk. `shard` and `export` write with O_DIRECT unless given
--buffered-io: measured on 2026-12-02 (docs/BENCHMARKS.md, "shard", sessions 9 and 10), the medium preset
at tp 8 took half the wall time and 40-60% of the CPU of buffered writes on the 2-core dev box, cached or
cold source, one or two workers, and the same wall time with 15% less CPU on the 16-core H200 host (4
workers, cold); earlier (2026-11-30, 23.7 GB in) buffered writes had been faster on the dev box. Buffered
writes are one pwrite per call, no staging copy.

The stream position may be any byte: a piece starts at the block boundary at or below it and carries the
bytes before the position (already in the file) as its head, so every O_DIRECT write is block aligned. A
long write whose memory lies at the same offset within a block as its file position (the copy path reads
into buffers placed so: write.py) is not copied into pieces: its bytes up to the next block boundary
complete the current piece, its whole blocks go to the device straight from the caller's memory, and the
rest starts the next piece; the caller keeps that memory unchanged until `settle`. What does not fill a
whole block at a flush goes through an ordinary descriptor: the kernel writes such cached pages back
before a later O_DIRECT write over the same block.

Where the file system refuses O_DIRECT (tmpfs on older kernels, some network file systems) the same
code writes through the ordinary descriptor.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from pathlib import Path

import numpy as np

from dsv41_convert.store.own_files import open_own

BLOCK = 4096  # O_DIRECT alignment of offsets, lengths and buffers: covers 512- and 4096-byte sectors
PIECE_BYTES = 8 << 20
DEPTH = 4
THROUGH_BYTES = 1 << 20  # shorter writes are copied into pieces even when their memory is aligned
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectAppender:
    """Sequential writes to `path` from byte `start` on (the file is created if missing, never truncated
    here). `fd` is an ordinary read-write descriptor of the same file, for the caller's pread, ftruncate
    and fsync.

    write(data) copies into the current piece and returns (O_DIRECT), or pwrites `data` into the page cache
    before it returns (buffered: `direct` False, or O_DIRECT refused): the caller may reuse `data` at once.
    flush() returns once every byte handed over is in the file. seek(pos) flushes, then appends at pos.
    A write error (a full disk: OSError ENOSPC) is raised by that write (buffered), or by the next write,
    flush or close.
    """

    def __init__(self, path: Path, start: int = 0, *, direct: bool = True, piece_bytes: int = PIECE_BYTES,
                 depth: int = DEPTH):  # fmt: skip
        assert piece_bytes % BLOCK == 0 and depth >= 1
        self.path = Path(path)
        self.fd = open_own(self.path, os.O_RDWR)
        self.direct_fd = _open_direct(self.path) if direct else -1
        self.piece_bytes = piece_bytes
        self.error: BaseException | None = None
        pieces = depth if self.direct_fd >= 0 else 0  # buffered: no staging pieces, no writer threads
        self._free: queue.Queue = queue.Queue()
        for _ in range(pieces + 1 if pieces else 0):
            self._free.put(aligned_buffer(piece_bytes))
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self._through = 0  # writes from the caller's memory not yet done
        self._idle = threading.Condition()
        self._threads = [threading.Thread(target=self._run, name=f"pwrite {self.path.name}", daemon=True)
                         for _ in range(pieces)]  # fmt: skip
        for t in self._threads:
            t.start()
        self._buf: mmap.mmap | None = None
        self._begin(start)

    @property
    def position(self) -> int:
        """The file offset of the next byte written."""
        return self._base + self._fill

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if self.direct_fd < 0:  # buffered: the page cache is the queue, no copy into a piece
            self._raise()
            _pwrite_all(self.fd, self.fd, view, self._base)
            self._base += len(view)
            return
        if len(view) >= THROUGH_BYTES and address(view) % BLOCK == self.position % BLOCK:
            self._write_through(view)
            return
        while len(view):
            self._raise()
            n = min(len(view), self.piece_bytes - self._fill)
            self._buf[self._fill : self._fill + n] = view[:n]
            self._fill, view = self._fill + n, view[n:]
            if self._fill == self.piece_bytes:
                self._submit(self._buf, 0, self._base, self._fill)
                self._base, self._fill, self._head, self._buf = self._base + self._fill, 0, 0, self._free.get()

    def settle(self) -> None:
        """Return once every write that went out from the caller's memory is in the file (the caller may
        then reuse that memory); raise the first write error, if any."""
        with self._idle:
            self._idle.wait_for(lambda: self._through == 0)
        self._raise()

    def _write_through(self, view: memoryview) -> None:
        """`view` (at least 2 blocks, at the file position's offset within a block) without copying its
        whole blocks: see the module docstring."""
        self._raise()
        lead = -self.position % BLOCK
        self._buf[self._fill : self._fill + lead] = view[:lead]
        self._fill += lead
        if self._fill > self._head:  # else the piece holds only bytes already in the file
            self._submit(self._buf, 0, self._base, self._fill)
            self._buf = None
        start = self._base + self._fill
        whole = (len(view) - lead) // BLOCK * BLOCK
        with self._idle:
            self._through += 1
        self._submit(view, lead, start, whole, keep=True, through=True)
        rest = view[lead + whole :]
        self._buf = self._buf or self._free.get()
        self._buf[: len(rest)] = rest
        self._base, self._fill, self._head = start + whole, len(rest), 0

    def flush(self) -> None:
        """Write every byte handed over; the stream goes on at the same position."""
        pos = self.position
        whole = (self._fill // BLOCK) * BLOCK
        if self._fill > self._head:
            if whole > 0:
                self._submit(self._buf, 0, self._base, whole, keep=True)
            if self._fill > whole:
                self._submit(self._buf, whole, self._base + whole, self._fill - whole, keep=True, plain=True)
        self._wait()
        self._raise()
        if whole > 0 or self._fill > self._head:
            self._begin(pos)

    def seek(self, pos: int) -> None:
        """Flush, then append at `pos` (the bytes before it, back to a block boundary, are read from the file)."""
        self.flush()
        self._begin(pos)

    def close(self) -> None:
        """Flush and close both descriptors; raise the first write error, if any."""
        try:
            self.flush()
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop the writer threads and close the descriptors, writing nothing more and raising nothing."""
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        for fd in (self.direct_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.direct_fd = self.fd = -1

    def _begin(self, pos: int) -> None:
        """Start a piece (the current buffer, or a free one) at the block boundary at or below `pos`, holding
        the file's bytes before `pos`."""
        if self.direct_fd < 0:  # buffered: write() goes straight to the file at _base
            self._base, self._fill, self._head = pos, 0, 0
            return
        if self._buf is None:
            self._buf = self._free.get()
        base = pos - pos % BLOCK
        head = pos - base
        if head:
            got = os.preadv(self.fd, [memoryview(self._buf)[:head]], base)
            if got != head:
                raise OSError(errno.EIO, f"{self.path}: expected {head} bytes before offset {pos}, read {got}")
        self._base, self._fill, self._head = base, head, head

    def _submit(self, buf: mmap.mmap | memoryview, start: int, offset: int, length: int, keep: bool = False,
                plain: bool = False, through: bool = False) -> None:  # fmt: skip
        """Queue buf[start : start + length] for the file at `offset`; `keep`: the caller goes on using buf;
        `through`: buf is the caller's memory (counted in _through until written)."""
        with self._idle:
            self._pending += 1
        self._jobs.put((buf, start, offset, length, plain, keep, through))

    def _wait(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            buf, start, offset, length, plain, keep, through = job
            try:
                if self.error is None:
                    fd = self.fd if plain else self.direct_fd
                    _pwrite_all(fd, self.fd, memoryview(buf)[start : start + length], offset)
            except BaseException as exc:  # raised to the caller by its next write / flush / close / settle
                self.error = self.error or exc
            finally:
                if not keep:
                    self._free.put(buf)
                with self._idle:
                    self._pending -= 1
                    self._through -= through
                    self._idle.notify_all()


def address(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """nbytes of anonymous memory starting at a page (so at a BLOCK) boundary."""
    return mmap.mmap(-1, nbytes)


def _open_direct(path: Path) -> int:
    if not _O_DIRECT:
        return -1
    try:
        return os.open(path, os.O_WRONLY | _O_DIRECT | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return -1
        raise


def _pwrite_all(fd: int, plain_fd: int, view: memoryview, offset: int) -> None:
    """All of `view` at `offset`. After a short write (a file size limit, a nearly full disk) the rest is
    unaligned, and a limit that cuts a direct write unaligned makes it EINVAL: both go on through
    `plain_fd`, where the real error, if any, shows (EFBIG, ENOSPC)."""
    while len(view):
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or fd == plain_fd:
                raise
            fd = plain_fd
            continue
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        view, offset, fd = view[n:], offset + n, plain_fd
