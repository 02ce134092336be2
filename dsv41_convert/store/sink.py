"""The writer of one `<file>.partial`: a thread that hashes and writes the byte stream in file order and
hands checkpoints to the resume journal.

The caller (write.py) hands over three kinds of work, in file order:
  write(data)          bytes to append;
  write_ahead(a, data) bytes of a group's later part, at their final offset past the in-order end (an
                       Aside: hashed into its own sha256 for the journal, then pwritten);
  read_back(pos, n)    bytes already written ahead at [pos, pos + n) (a group's later part): hashed by
                       reading them back, not written again;
  checkpoints          made by write() / read_back() every `journal_bytes` (counting bytes written
                       ahead too), where the caller allows them.
Bytes are hashed once, into the whole-file sha256; a checkpoint records a copy of its state's digest (the
sha256 of the prefix), which costs microseconds, not a second pass over the bytes. Given at least
HASH_THREAD_CORES usable cores, a chunk of at least HASH_APART_BYTES is hashed by a second thread
(hasher.py) while this one writes it, so a chunk costs the slower of the two, not their sum; the next
item is taken only once both are done, so a checkpoint still records exactly the bytes hashed and
written before it, and the caller's buffer cycle is unchanged. On the 2-core dev box, with other jobs
running, the thread gained no wall time and cost up to 1.3 s more CPU per 4.8 GB (docs/BENCHMARKS.md).

The stream goes to the file through a DirectAppender: O_DIRECT by default where the file system allows
it (direct_write.py has the measurements), buffered writes with `direct` False. Bytes written ahead and
read back go through the ordinary descriptor `fd`. A checkpoint first flushes the appender, so the
journal's fdatasync covers every byte before it. A chunk the appender sends from the caller's memory
(no copy) is waited for (`settle`) before the next item is taken, so the caller's buffer cycle still
holds.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from functools import partial
from pathlib import Path

from dsv41_convert import interrupts
from dsv41_convert.progress import Progress, add_seconds
from dsv41_convert.store.direct_write import DirectAppender
from dsv41_convert.store.hasher import Hasher
from dsv41_convert.store.journal import Aside, JournalWriter, ResumePoint
from dsv41_convert.store.machine import usable_cores
from dsv41_convert.store.own_files import open_own
from dsv41_convert.store.safetensors_header import pread_exact

THROTTLE_ENV = "DSV41_CONVERT_TEST_THROTTLE_S"  # test hook: sleep this long after each chunk
READ_BACK_BYTES = 16 << 20
HASH_APART_BYTES = 1 << 20  # smaller chunks are hashed in the writer thread: a hand-over costs ~20 us
HASH_THREAD_CORES = 4  # fewer usable cores: no hasher thread (the reading, writing and hashing threads compete)


class Sink:
    """Hashes and writes while the caller reads and computes the next chunk (hashlib and pwrite release the
    GIL; with O_DIRECT the appender's pwrites run in threads of their own): on a slow disk this hides the
    sha256.

    Handed-over buffers must not change until written: `_copy` (write.py) cycles three buffers through a
    queue of one, so a buffer is refilled only after the writer has taken the next one.

    `stages` collects seconds of this thread: write, wait_hash (the hash of a chunk outlasting its write),
    and hash (of this thread and the hasher's); write.py adds the stages of the computed tensors (stream.py).
    """

    def __init__(
        self,
        path: Path,
        label: str,
        total: int,
        progress: Progress,
        start: ResumePoint | None = None,
        direct: bool = True,
    ):
        self.path, self.label, self.total, self.progress = path, label, total, progress
        self.fd = open_own(path, os.O_RDWR | (0 if start else os.O_TRUNC))
        self.sha = start.sha if start else hashlib.sha256()
        self.queued = self.done = start.end if start else 0  # bytes handed over / written
        if start:
            if not start.asides:
                os.ftruncate(self.fd, start.end)
            elif os.fstat(self.fd).st_size > total:
                os.ftruncate(self.fd, total)
        self.out = DirectAppender(path, start.end if start else 0, direct=direct)
        self.tensor = "<header>"  # tensor being written (for error messages)
        self.error: BaseException | None = None
        self.throttle = float(os.environ.get(THROTTLE_ENV, "0") or 0)
        # checkpoints (set by the caller): where the writer is, and whether it could go on from here
        self.journal: JournalWriter | None = None
        self.journal_bytes = 0
        self.asides: dict[str, Aside] = {}  # group -> its later part written ahead
        self.dirty: set[str] = set()  # groups whose aside grew since the last checkpoint
        self.ahead = 0  # bytes written ahead so far: they count towards the next checkpoint too
        self._ahead_to: dict[int, int] = {}  # aside tensor -> end of the bytes queued for it (caller's side)
        # the progress shown counts bytes written ahead when they are written: done + (bytes written ahead
        # by an earlier run, past done, + self.ahead) - bytes read back; each counter has one writing thread
        self._ahead_before = sum(max(0, a.end - max(a.begin, self.done)) for a in start.asides) if start else 0
        self._read_back = 0
        self.mark_ok = False
        self.index = self.chunk = self.t_begin = 0
        self._last_mark = self.queued
        self.stages: dict[str, float] = {}  # seconds in this thread: hash, write
        self._q: queue.Queue = queue.Queue(maxsize=1)
        self._hasher = Hasher(f"sha256 {label}") if usable_cores() >= HASH_THREAD_CORES else None
        self._thread = threading.Thread(target=self._drain, name=f"write {label}", daemon=True)
        self._thread.start()

    def begin_tensor(self, index: int, begin: int, chunk: int = 0) -> None:
        """The next bytes are tensor `index` of the file (starting at file offset `begin`), data chunk `chunk`."""
        self.index, self.t_begin, self.chunk, self.mark_ok = index, begin, chunk, True

    def write(self, data, tensor: str = "<header>") -> None:
        interrupts.check()  # before the queue is touched (interrupts.py)
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        self.queued += len(view)
        self._q.put(("w", view, tensor))
        self._after_chunk()

    def write_ahead(self, aside: Aside, data, tensor: str) -> None:
        """The next bytes of a group's later part, written ahead at their final offset (after those queued
        for `aside` before): hashed into aside.sha and pwritten in this thread, so neither stalls the
        caller; a checkpoint queued after them records them. Not counted in `queued` (file order)."""
        interrupts.check()
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        pos = self.ahead_end(aside)
        self._ahead_to[aside.tensor] = pos + len(view)
        self.ahead += len(view)
        self._q.put(("a", (aside, pos, view), tensor))

    def ahead_end(self, aside: Aside) -> int:
        """Where the bytes queued for `aside` end (aside.end once the writer has caught up); caller's side."""
        return self._ahead_to.get(aside.tensor, aside.end)

    def read_back(self, pos: int, n: int, tensor: str) -> None:
        """Bytes [pos, pos + n), written ahead, are next in the file: hash them, skip over them."""
        interrupts.check()
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
            mark["asides"] = [self.asides[g] for g in sorted(self.dirty) if g in self.asides]  # as JSON when written
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
                if kind == "m":  # every aside write queued before it is done, none after it started
                    self.out.flush()
                    payload["asides"] = [a.to_json() for a in payload["asides"]]
                    payload["sha256"] = self.sha.copy().hexdigest()
                    self.journal.put(payload)
                    continue
                self.tensor = tensor
                if kind == "a":
                    aside, pos, view = payload
                    self._hash_and_write(aside.sha, view, partial(_pwrite_aside, self.fd, pos=pos, aside=aside))
                    continue
                if kind == "w":
                    self._hash_and_write(self.sha, payload, self.out.write)
                    self.out.settle()  # the caller refills the buffer once the next item is taken
                    self.done += len(payload)
                else:
                    buf = buf or memoryview(bytearray(READ_BACK_BYTES))
                    pos, left = payload
                    while left:
                        n = min(left, len(buf))
                        pread_exact(self.fd, buf[:n], pos, str(self.path))
                        self.sha.update(buf[:n])
                        pos, left, self.done = pos + n, left - n, self.done + n
                        self._read_back += n
                    self.out.seek(pos)
                pending = max(0, self._ahead_before + self.ahead - self._read_back)
                self.progress(self.label, min(self.total, self.done + pending), self.total)
            except BaseException as exc:  # handed to the caller by write() / finish()
                self.error = exc

    def finish(self) -> None:
        """Wait for every handed-over byte to be in the file; raise the writer's error if it had one."""
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
            if self._hasher is not None:
                self._hasher.close()
                add_seconds(self.stages, "hash", self._hasher.seconds)
            if self.error is not None:
                self.out.abort()
            else:
                try:
                    self.out.close()  # flushes, then aborts (closes) whatever happens
                except BaseException as exc:
                    self.error = exc
        if self.error is not None:
            raise self.error

    def _hash_and_write(self, sha, view: memoryview, write) -> None:
        """sha.update(view) and write(view), at once in two threads when the chunk is large enough."""
        if self._hasher is None or len(view) < HASH_APART_BYTES:  # write first: it may only queue the bytes
            t0 = time.perf_counter()
            write(view)
            t1 = time.perf_counter()
            sha.update(view)
            add_seconds(self.stages, "write", t1 - t0)
            add_seconds(self.stages, "hash", time.perf_counter() - t1)
            return
        self._hasher.start(sha, view)
        t0 = time.perf_counter()
        try:
            write(view)
        finally:  # the hasher reads `view` until then, and the next item may be a checkpoint of `sha`
            t1 = time.perf_counter()
            self._hasher.wait()
            add_seconds(self.stages, "write", t1 - t0)
            add_seconds(self.stages, "wait_hash", time.perf_counter() - t1)

    def fill(self, value: int, count: int, chunk: int, tensor: str) -> None:
        """Append `count` bytes of `value` (padding rows); no checkpoint falls inside padding."""
        self.mark_ok = False
        block = bytes([value]) * min(count, chunk)
        while count > 0:
            self.write(block[: min(count, len(block))], tensor)
            count -= len(block)


def _pwrite_aside(fd: int, view: memoryview, pos: int, aside: Aside) -> None:
    """All of `view` at `pos`, moving aside.end along with the bytes written."""
    while len(view):
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n
        aside.end = pos
