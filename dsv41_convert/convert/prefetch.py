"""Source reads ahead of the converter, straight into the buffers it computes from.

The converter reads each computed tensor in row blocks (stream.py). Most computed tensors of a real
checkpoint (each expert's w1/w2/w3) are one block, so reading ahead within a tensor overlaps nothing:
the reads have to run ahead across tensors. `Prefetch` is given, in file order, every piece of source the
converter will ask `_Reader.rows` for (write.py lists them with stream.block_reads) and reads them with
`threads` reads in flight, each into its own buffer from `alloc` (pinned host memory on CUDA, so the
host-to-device copy starts from the very bytes the disk delivered: no page-cache copy in the caller).
`take` hands a piece's buffer over when the converter reaches it.

Bounds: at most `ahead` bytes are claimed at once (being read, or read and not yet taken); one piece
larger than that is read alone. Pieces the converter passed without taking them (a resumed part, a group
part taken from the stash) are dropped when it moves on. A piece that is not listed, or whose read failed,
is left to the converter's own read (which reports the error, naming the file).

Order and threads: pieces are claimed in list order; `take` of a piece not yet claimed stops the threads
from reading it (the converter reads it itself), and a piece being read is waited for.

With a `ring` (ring.HostRing, pinned, on CUDA) each piece's buffer is carved from the ring in claim order
instead of allocated, so the host memory read ahead is the ring, allocated once per run. A taken buffer
stays the converter's until it calls `release(buf, fence)` (fence: the CUDA event after its host-to-device
copy); its bytes are claimed again only once the fence has passed. A piece larger than the ring is read
alone into `alloc(n)`. `close` waits for the device (`settle`) before it takes back buffers the converter
never released (it stopped on an error).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dsv41_convert.progress import add_seconds
from dsv41_convert.store.safetensors_header import pread_exact

if TYPE_CHECKING:  # ring.py imports torch; a CPU run never makes a ring
    from dsv41_convert.convert.ring import HostRing, Region

Piece = tuple[int, str, int, int]  # (tensor index, file, offset, nbytes)


class Prefetch:
    """Threads reading `pieces` ahead of the converter into buffers from `alloc(nbytes)`.

    pieces: [(tensor index, file, offset, nbytes)] in the order the converter asks for them.
    stages: if given, `read_ahead` accumulates the seconds of the reads (summed over threads).
    ring:   if given, the buffers are regions of it (see the module docstring); `alloc` then serves only
            pieces larger than the ring.
    settle: with a ring, called by close() before it takes back buffers never released (waits for the device).
    """

    def __init__(
        self,
        src: Path,
        pieces: list[Piece],
        ahead: int,
        alloc: Callable[[int], object] = bytearray,
        threads: int = 2,
        stages: dict | None = None,
        ring: HostRing | None = None,
        settle: Callable[[], None] = lambda: None,
    ):
        self.src, self.pieces, self.ahead, self.alloc = Path(src), pieces, ahead, alloc
        self.ring, self.settle = ring, settle
        self._regions: dict[int, Region] = {}  # position -> its ring region, while being read or ready
        self._lent: dict[int, tuple[object, Region]] = {}  # id(buffer) -> (buffer, region), taken
        self.stages = {} if stages is None else stages
        self._where: dict[tuple[str, int, int], list[int]] = {}
        for pos, (_, file, offset, n) in enumerate(pieces):
            self._where.setdefault((file, offset, n), []).append(pos)
        self._next = 0  # the next piece a thread claims
        self._cursor = 0  # pieces before this one are behind the converter
        self._ready: dict[int, object] = {}  # position -> buffer read, not yet taken
        self._failed: set[int] = set()
        self._reading: set[int] = set()
        self._claimed = 0  # bytes of pieces being read or ready
        self._fds: dict[str, int] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, name=f"prefetch {k}", daemon=True) for k in range(max(1, threads))
        ]
        for th in self._threads:
            th.start()

    def take(self, file: str, offset: int, nbytes: int):
        """The buffer holding bytes [offset, offset + nbytes) of `file`, waiting while it is being read.
        -> it, or None when the converter must read them itself (not listed, not claimed yet, failed)."""
        with self._cv:
            pos = next((p for p in self._where.get((file, offset, nbytes), ()) if p >= self._cursor), None)
            if pos is None:
                return None
            self._advance(pos)
            self._next = max(self._next, pos + 1)  # no thread starts it now; pieces after it go on
            self._cv.wait_for(lambda: pos not in self._reading)
            self._cursor = pos + 1
            if pos in self._failed:
                self._failed.discard(pos)
                self._claimed -= nbytes
            buf = self._ready.pop(pos, None)
            if buf is not None:
                self._claimed -= nbytes
                region = self._regions.pop(pos, None)
                if region is not None:
                    self._lent[id(buf)] = (buf, region)
            self._cv.notify_all()
            return buf

    def release(self, buf, fence: object | None = None) -> None:
        """The converter is done with a buffer `take` gave it once `fence` has passed (a CUDA event
        recorded after the copy that reads it; None: done now). A buffer not from the ring: nothing to do."""
        with self._cv:
            lent = self._lent.pop(id(buf), None)
            if lent is not None:
                self.ring.release(lent[1], fence)
                self._cv.notify_all()

    def at(self, index: int) -> None:
        """The converter is on tensor `index`: the pieces of earlier tensors are no longer wanted."""
        with self._cv:
            pos = self._cursor
            while pos < len(self.pieces) and self.pieces[pos][0] < index:
                pos += 1
            self._advance(pos)
            self._next = max(self._next, pos)
            self._cv.notify_all()

    def claimed(self) -> int:
        """Bytes being read or read and not yet taken (at most `ahead`, or with a ring its size, plus one
        piece larger than that)."""
        with self._cv:
            return self._claimed

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for th in self._threads:
            th.join()
        if self._lent:
            self.settle()  # the converter stopped holding buffers: their copies may still be queued
        with self._cv:
            self._ready.clear()
            for region in [*self._regions.values(), *(r for _, r in self._lent.values())]:
                self.ring.release(region)
            self._regions.clear()
            self._lent.clear()
            if self.ring is not None:
                self.ring.settle()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def _advance(self, pos: int) -> None:
        """Drop what is ready before piece `pos` (the converter passed it); call with the lock held."""
        if pos <= self._cursor:
            return
        for p in [p for p in self._ready if p < pos]:
            del self._ready[p]
            self._drop_region(p)
            self._claimed -= self.pieces[p][3]
        for p in [p for p in self._failed if p < pos]:
            self._failed.discard(p)
            self._claimed -= self.pieces[p][3]
        self._cursor = pos

    def _drop_region(self, pos: int) -> None:
        """Piece `pos` will not be used: its ring region (if any) is free once older ones are."""
        region = self._regions.pop(pos, None)
        if region is not None:
            self.ring.release(region)

    def _claim(self) -> int | None:
        """The next piece for a thread (its bytes counted as claimed; with a ring, its region carved), or
        None to stop."""
        with self._cv:
            while True:
                if self._stop or self._next >= len(self.pieces):
                    return None
                n = self.pieces[self._next][3]
                if self.ring is not None and n <= self.ring.size:
                    region = self.ring.carve(n)
                    if region is None:
                        fence = self.ring.blocking_fence()
                        if fence is None:
                            self._cv.wait()  # the oldest region is ready or lent: a take or release frees it
                        else:  # a released region whose copy is still running
                            self._cv.release()
                            try:
                                fence.synchronize()
                            finally:
                                self._cv.acquire()
                        continue
                    self._regions[self._next] = region
                elif not (self._claimed == 0 or (self.ring is None and self._claimed + n <= self.ahead)):
                    self._cv.wait()  # without a ring, within `ahead`; a piece larger than the ring alone
                    continue
                pos = self._next
                self._next += 1
                self._claimed += n
                self._reading.add(pos)
                return pos

    def _fd(self, file: str) -> int:
        with self._cv:
            if file not in self._fds:
                self._fds[file] = os.open(self.src / file, os.O_RDONLY)
            return self._fds[file]

    def _run(self) -> None:
        while (pos := self._claim()) is not None:
            _, file, offset, n = self.pieces[pos]
            buf = None
            t0 = time.perf_counter()
            try:
                fd = self._fd(file)
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)  # the whole piece queued at once
                with self._cv:
                    region = self._regions.get(pos)
                buf = region.view if region is not None else self.alloc(n)
                pread_exact(fd, memoryview(buf).cast("B"), offset, str(self.src / file))
            except BaseException:  # the converter's own read of this piece reports it
                buf = None
            dt = time.perf_counter() - t0
            with self._cv:
                add_seconds(self.stages, "read_ahead", dt)
                self._reading.discard(pos)
                if pos < self._cursor:  # passed while being read
                    self._claimed -= n
                    self._drop_region(pos)
                elif buf is None:
                    self._failed.add(pos)
                    self._drop_region(pos)
                else:
                    self._ready[pos] = buf
                self._cv.notify_all()
