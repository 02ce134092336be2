"""The writer of one `<file>.partial`: a thread that hashes and writes the byte stream in file order and
hands checkpoints to the resume journal.

The caller (write.py) hands over four kinds of work, in file order:
  write(data)          bytes to append;
  copy(fd, pos, n)     bytes [pos, pos + n) of a source file, appended unchanged;
  read_back(pos, n)    bytes already written ahead at [pos, pos + n) (a group's later part): hashed by
                       reading them back, not written again;
  checkpoints          made by write() / read_back() every `journal_bytes` (counting bytes written
                       ahead too), where the caller allows them.
Bytes are hashed once, into the whole-file sha256; a checkpoint records a copy of its state's digest (the
sha256 of the prefix), which costs microseconds, not a second pass over the bytes.

Buffered writes (the default: the page cache lets the kernel write back while the next chunk is read;
on the dev box 1.24-1.28x of cp against 1.40-1.50x with O_DIRECT, tp 8 of 23.7 GB) happen in the
caller's thread, before the bytes are queued: the writer thread only hashes, so the sha256 (0.6 CPU-s
per GB with SHA-NI) runs beside the next chunk's read and write instead of after its write. `copy` moves
source bytes with copy_file_range (page cache to page cache in the kernel, no pread into a buffer) and
the writer thread hashes them from a read-only map of the source's pages: one copy of each byte instead
of two. With `direct` (O_DIRECT where the file system allows it) the writer thread writes through a
DirectAppender as before. Bytes written ahead and read back go through the ordinary descriptor `fd`. A
checkpoint first flushes the appender, so the journal's fdatasync covers every byte before it.

A source file truncated while it is mapped makes the hash read fault (SIGBUS); the plan checked every
source size before the run, and a short copy_file_range (truncated before the copy) raises HeaderError.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import threading
import time
from pathlib import Path

from dsv41_convert.errors import HeaderError
from dsv41_convert.progress import Progress
from dsv41_convert.store.direct_write import DirectAppender
from dsv41_convert.store.direct_write import _pwrite_all as pwrite_all
from dsv41_convert.store.journal import Aside, JournalWriter, ResumePoint
from dsv41_convert.store.safetensors_header import pread_exact

THROTTLE_ENV = "DSV41_CONVERT_TEST_THROTTLE_S"  # test hook: sleep this long after each chunk
READ_BACK_BYTES = 16 << 20
_NO_COPY_RANGE = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)  # then pwrite from the map


class Sink:
    """Hashes (and with O_DIRECT writes) while the caller reads, computes and writes the next chunk (hashlib
    and pwrite release the GIL; with O_DIRECT the appender's pwrites run in threads of their own).

    Handed-over buffers must not change until hashed (and written): `_copy` (write.py) cycles three
    buffers through a queue of one, so a buffer is refilled only after the writer has taken the next one.

    `stages` collects seconds: write (the caller's pwrite or copy), hash (this thread); write.py adds the
    stages of the computed tensors (stream.py).
    """

    def __init__(
        self,
        path: Path,
        label: str,
        total: int,
        progress: Progress,
        start: ResumePoint | None = None,
        direct: bool = False,
    ):
        self.path, self.label, self.total, self.progress = path, label, total, progress
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if start else os.O_TRUNC), 0o644)
        self.sha = start.sha if start else hashlib.sha256()
        self.queued = self.done = start.end if start else 0  # bytes handed over / written
        if start:
            if not start.asides:
                os.ftruncate(self.fd, start.end)
            elif os.fstat(self.fd).st_size > total:
                os.ftruncate(self.fd, total)
        self.out = DirectAppender(path, start.end if start else 0, direct=direct)
        self.buffered = self.out.direct_fd < 0  # the caller's thread writes; the writer thread only hashes
        self.copy_range = hasattr(os, "copy_file_range")
        self.tensor = "<header>"  # tensor being written (for error messages)
        self.error: BaseException | None = None
        self.throttle = float(os.environ.get(THROTTLE_ENV, "0") or 0)
        # checkpoints (set by the caller): where the writer is, and whether it could go on from here
        self.journal: JournalWriter | None = None
        self.journal_bytes = 0
        self.asides: dict[str, Aside] = {}  # group -> its later part written ahead
        self.dirty: set[str] = set()  # groups whose aside grew since the last checkpoint
        self.ahead = 0  # bytes written ahead so far: they count towards the next checkpoint too
        # the progress shown counts bytes written ahead when they are written: done + (bytes written ahead
        # by an earlier run, past done, + self.ahead) - bytes read back; each counter has one writing thread
        self._ahead_before = sum(max(0, a.end - max(a.begin, self.done)) for a in start.asides) if start else 0
        self._read_back = 0
        self.mark_ok = False
        self.index = self.chunk = self.t_begin = 0
        self._last_mark = self.queued
        self.stages: dict[str, float] = {}  # seconds: write (caller's pwrite / copy), hash; callers add theirs
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._drain, name=f"write {label}", daemon=True)
        self._thread.start()

    def begin_tensor(self, index: int, begin: int, chunk: int = 0) -> None:
        """The next bytes are tensor `index` of the file (starting at file offset `begin`), data chunk `chunk`."""
        self.index, self.t_begin, self.chunk, self.mark_ok = index, begin, chunk, True

    def write(self, data, tensor: str = "<header>") -> None:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        if self.buffered:
            self.tensor = tensor
            t0 = time.perf_counter()
            pwrite_all(self.fd, self.fd, view, self.queued)
            self._time("write", t0)
            self.queued += len(view)
            self._q.put(("h", view, tensor))
        else:
            self.queued += len(view)
            self._q.put(("w", view, tensor))
        self._after_chunk()

    def copy(self, src_fd: int, pos: int, n: int, src_path: str, tensor: str) -> None:
        """Append bytes [pos, pos + n) of the source file `src_fd` unchanged (see the module doc); buffered
        writes only (with O_DIRECT the caller reads into buffers and calls write)."""
        assert self.buffered
        if self.error is not None:
            raise self.error
        self.tensor = tensor
        if n == 0:  # (a map of length 0 would be the whole file)
            return
        if os.fstat(src_fd).st_size < pos + n:  # a map past the end would fault instead of failing
            raise HeaderError(f"{src_path}: unexpected end of file before byte {pos + n}; truncated while reading?")
        base = pos - pos % mmap.ALLOCATIONGRANULARITY
        window = mmap.mmap(src_fd, pos - base + n, access=mmap.ACCESS_READ, offset=base)
        view = memoryview(window)[pos - base :]
        try:
            t0 = time.perf_counter()
            self._copy_range(src_fd, pos, view, src_path)
            self._time("write", t0)
        except BaseException:
            view.release()
            window.close()
            raise
        self.queued += n
        self._q.put(("h", (window, view), tensor))
        self._after_chunk()

    def _copy_range(self, src_fd: int, pos: int, view: memoryview, src_path: str) -> None:
        """view (the source's bytes at `pos`) to the file at `queued`: in the kernel where it can."""
        done = 0
        while self.copy_range and done < len(view):
            try:
                got = os.copy_file_range(src_fd, self.fd, len(view) - done, pos + done, self.queued + done)
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE:
                    raise
                self.copy_range = False  # another file system or an old kernel: copy from the map
                break
            if got == 0:
                raise HeaderError(f"{src_path}: unexpected end of file at byte {pos + done}; truncated while reading?")
            done += got
        pwrite_all(self.fd, self.fd, view[done:], self.queued + done)

    def read_back(self, pos: int, n: int, tensor: str) -> None:
        """Bytes [pos, pos + n), written ahead, are next in the file: hash them, skip over them."""
        if self.error is not None:
            raise self.error
        assert pos == self.queued, (pos, self.queued)
        self.queued += n
        self._q.put(("r", (pos, n), tensor))
        self._after_chunk()

    def _after_chunk(self) -> None:
        self.chunk += 1
        progressed = self.queued + self.ahead
        if self.journal is not None and self.mark_ok and progressed - self._last_mark >= self.journal_bytes:
            self._last_mark = progressed
            mark = {"end": self.queued, "tensor": self.index, "chunk": self.chunk, "skip": self.queued - self.t_begin}
            mark["asides"] = [self.asides[g].to_json() for g in sorted(self.dirty) if g in self.asides]
            self.dirty.clear()
            self._q.put(("m", mark, ""))
        if self.throttle:
            time.sleep(self.throttle)

    def _drain(self) -> None:
        buf = None
        while (item := self._q.get()) is not None:
            if self.error is not None:
                continue
            kind, payload, tensor = item
            try:
                if kind == "m":
                    self.out.flush()
                    payload["sha256"] = self.sha.copy().hexdigest()
                    self.journal.put(payload)
                    continue
                if kind == "h":  # written (and self.tensor set) by the caller
                    t0 = time.perf_counter()
                    if isinstance(payload, tuple):  # a source map: hash, then unmap
                        window, view = payload
                        self.sha.update(view)
                        self.done += len(view)
                        view.release()
                        window.close()
                    else:
                        self.sha.update(payload)
                        self.done += len(payload)
                    self._time("hash", t0)
                elif kind == "w":
                    self.tensor = tensor
                    self.sha.update(payload)
                    self.out.write(payload)
                    self.done += len(payload)
                else:
                    self.tensor = tensor
                    buf = buf or memoryview(bytearray(READ_BACK_BYTES))
                    pos, left = payload
                    while left:
                        n = min(left, len(buf))
                        pread_exact(self.fd, buf[:n], pos, str(self.path))
                        self.sha.update(buf[:n])
                        pos, left, self.done = pos + n, left - n, self.done + n
                        self._read_back += n
                    if not self.buffered:
                        self.out.seek(pos)
                pending = max(0, self._ahead_before + self.ahead - self._read_back)
                self.progress(self.label, min(self.total, self.done + pending), self.total)
            except BaseException as exc:  # handed to the caller by write() / finish()
                self.error = exc

    def _time(self, stage: str, t0: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for every handed-over byte to be in the file; raise the writer's error if it had one."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
            if self.error is not None:
                self.out.abort()
            else:
                try:
                    self.out.close()  # flushes, then aborts (closes) whatever happens
                except BaseException as exc:
                    self.error = exc
        if self.error is not None:
            raise self.error

    def fill(self, value: int, count: int, chunk: int, tensor: str) -> None:
        """Append `count` bytes of `value` (padding rows); no checkpoint falls inside padding."""
        self.mark_ok = False
        block = bytes([value]) * min(count, chunk)
        while count > 0:
            self.write(block[: min(count, len(block))], tensor)
            count -= len(block)
