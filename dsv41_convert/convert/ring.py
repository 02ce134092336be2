"""One host buffer, allocated once, handed out as byte regions in the order they are claimed.

On CUDA the converter's host memory is pinned (page-locked) so copies to and from the GPU run
asynchronously. torch's caching host allocator rounds every pinned block up to a power of two and keeps
it cached for the life of the process, so allocating a pinned buffer per piece held well above the bytes
in use (issue 21: 2.16 GiB peak RSS, docs/BENCHMARKS.md). A `HostRing` is allocated once (`alloc(size)`)
and carved into regions:

    claimed in order    [tail ............ head)      regions live between tail and head; a region that
                                                      does not fit before the end wraps to byte 0
    released in any order, each with a fence          the bytes come back only when every older region
                                                      is released too and each fence has passed

A fence is whatever says that the last user of the bytes is done (a CUDA event recorded after the
host-to-device copy that reads them; `query()` -> done?, `synchronize()` waits); None: done already.
The bytes of a region are never handed out again before its fence has passed, and two live regions never
overlap. A ring is not thread-safe: its owner holds a lock around every call (`Prefetch`, `Staging`).
`Staging` is the ring the device-to-host copies land in: a region comes back when the host tensor on it
is garbage (the Sink has hashed and written it) and its copy's fence has passed.

`borrow` / `give_back` keep rings per process (one per concurrent user, each allocated once per run).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 4096  # every region starts on a page: DMA-friendly, and any dtype's view of it is aligned


@dataclass(eq=False)
class Region:
    """Bytes [start, start + nbytes) of a ring; `view` is a writable memoryview of them."""

    start: int
    nbytes: int
    view: memoryview
    released: bool = False
    fence: object | None = None  # has query() -> bool and synchronize(); None: nothing pending

    @property
    def end(self) -> int:
        return self.start + self.nbytes


class HostRing:
    """`size` bytes from `alloc(size)` (pinned on CUDA: stream.pinned), as regions in claim order."""

    def __init__(self, size: int, alloc: Callable[[int], object] = bytearray, align: int = ALIGN):
        if size <= 0:
            raise ValueError(f"a ring needs a positive size, got {size}")
        self.size, self.align = size, align
        self.memory = memoryview(alloc(size)).cast("B")
        self._live: deque[Region] = deque()  # oldest first

    def carve(self, nbytes: int) -> Region | None:
        """The next `nbytes` of the ring (after reclaiming what is done), or None when they do not fit now.
        A request larger than the ring never fits (the caller reads it elsewhere)."""
        if nbytes > self.size:
            return None
        self.reclaim()
        start = self._place(-(-nbytes // self.align) * self.align)
        if start is None:
            return None
        region = Region(start, nbytes, self.memory[start : start + nbytes])
        self._live.append(region)
        return region

    def _end(self, region: Region) -> int:
        """Where the next region may start: the region's end rounded up to `align`."""
        return min(self.size, -(-region.end // self.align) * self.align)

    def release(self, region: Region, fence: object | None = None) -> None:
        """The owner is done with `region` once `fence` has passed (None: now)."""
        region.released, region.fence = True, fence

    def reclaim(self) -> None:
        """Take back the oldest regions while they are released and their fences have passed."""
        while self._live and self._live[0].released:
            fence = self._live[0].fence
            if fence is not None and not fence.query():
                return
            self._live.popleft()

    def blocking_fence(self) -> object | None:
        """The fence of the oldest region when it is released but its fence has not passed (wait on it,
        without the owner's lock, to make room); None otherwise."""
        if self._live and self._live[0].released and self._live[0].fence is not None:
            return self._live[0].fence
        return None

    def settle(self) -> None:
        """Wait for every fence of a released region, then reclaim: at the end of a run, or before the
        ring is lent to its next user."""
        for region in self._live:
            if region.released and region.fence is not None:
                region.fence.synchronize()
                region.fence = None
        self.reclaim()

    def live(self) -> list[tuple[int, int]]:
        """(start, end) of every region not taken back yet, oldest first."""
        return [(r.start, r.end) for r in self._live]

    def held(self) -> int:
        """Bytes between tail and head, counting the end skipped by a wrap (what is unavailable)."""
        if not self._live:
            return 0
        tail, head = self._live[0].start, self._end(self._live[-1])
        return self.size - tail + head if self._wraps() else head - tail

    def _wraps(self) -> bool:
        """Whether the live regions run past the end and on from byte 0."""
        return bool(self._live) and self._live[-1].start < self._live[0].start

    def _place(self, nbytes: int) -> int | None:
        if not self._live:
            return 0  # empty: start over at byte 0, the most room in one piece
        tail, head = self._live[0].start, self._end(self._live[-1])
        if self._wraps():
            return head if head + nbytes <= tail else None
        if head + nbytes <= self.size:
            return head
        return 0 if nbytes <= tail else None  # wrap: the bytes after head stay unused this lap


_pool: dict[tuple[int, object], list[HostRing]] = {}
_pool_lock = threading.Lock()


def borrow(size: int, alloc: Callable[[int], object]) -> HostRing:
    """A ring of `size` bytes from `alloc` kept by this process (allocated at the first call), for one
    user at a time; hand it back with `give_back` once every region is released."""
    with _pool_lock:
        free = _pool.setdefault((size, alloc), [])
        if free:
            return free.pop()
    return HostRing(size, alloc)


def give_back(ring: HostRing, alloc: Callable[[int], object]) -> None:
    """Return a ring to the pool; regions still live (their owner failed) wait for their fences."""
    ring.settle()
    if ring.live():
        raise AssertionError(f"ring given back with live regions {ring.live()}")
    with _pool_lock:
        _pool.setdefault((ring.size, alloc), []).append(ring)


class Staging:
    """Host tensors that device-to-host copies land in, carved from one ring allocated once.

    A tensor's bytes come back when the last reference to it (and to every view of it, e.g. the Sink's
    memoryview) is gone and the fence its copy set on its region (`region.fence`) has passed. It never
    waits: when the ring has no room, `empty` says so and the caller uses pageable memory.
    """

    def __init__(self, size: int, alloc: Callable[[int], object] = bytearray, align: int = ALIGN):
        self.ring = HostRing(size, alloc, align)
        self._lock = threading.RLock()  # re-entrant: a collection inside carve may free a tensor

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Region] | None:
        """-> ([*shape] dtype, sharing a region of the ring; its region), or None when it does not fit now."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not nbytes:
            return None
        with self._lock:
            region = self.ring.carve(nbytes)
        if region is None:
            return None
        raw = np.frombuffer(region.view, dtype=np.uint8)
        weakref.finalize(raw, self._free, region)
        return torch.from_numpy(raw).view(dtype).view(shape), region

    def held(self) -> int:
        with self._lock:
            self.ring.reclaim()
            return self.ring.held()

    def _free(self, region: Region) -> None:
        with self._lock:
            self.ring.release(region, region.fence)
