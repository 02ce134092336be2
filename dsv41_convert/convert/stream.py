"""Computed tensors as a stream of row blocks: the source reads run ahead in a thread, and on CUDA each
block travels through pinned host memory with asynchronous copies, so reading, the GPU, writing and
hashing overlap:

    reader thread   pread of block k+1 (into pinned memory on CUDA)
    caller          block k: H2D, the action's kernels, D2H into pinned memory, all queued on the
                    current stream; then waits for block k-1's copies and hands them to the Sink
    Sink thread     sha256 and pwrite of block k-2 (store/sink.py)

At most DEPTH blocks are read ahead and DEPTH are on the GPU, so host memory is a few blocks whatever
the tensor size, and a tensor of any size (an Engram table of 91.5 GiB) never needs to fit on the GPU
whole: GPU memory is a few blocks of at most GPU_BLOCK_BYTES of source each, plus their outputs.

Stage times (seconds summed over blocks, in `stages`): read = pread in the reader thread (the wait for
it in the caller shows as `wait_read`); h2d, kernel, d2h = CUDA event intervals on the current stream
(on CPU, kernel = the action's wall time); launch = the caller's time to queue them (the kernels'
Python wrappers, their NaN checks' syncs, pinned allocations); wait_gpu = waiting for a block's copies;
write and hash are timed by the Sink.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator

import torch

from dsv41_convert.convert.plan import OutTensor
from dsv41_convert.convert.transform import apply, from_bytes

GPU_BLOCK_BYTES = 64 << 20  # source bytes per row block on CUDA (64 MiB blocks: per-block costs < 5%)
DEPTH = 2  # blocks read ahead, and blocks in flight on the GPU


def blocks(t: OutTensor, reader, quantizer, step: int, first: int, stages: dict | None = None) -> Iterator[tuple]:
    """Yield the action's outputs (CPU tensors) for each block of `step` rows of t's source region, from
    block `first` on. `reader` is write.py's _Reader; `stages` (if given) accumulates the stage times.
    A tensor of one block is read in the caller (nothing to overlap within it; no thread to start)."""
    stages = {} if stages is None else stages
    main = t.reads[0]
    rows = main.r1 - main.r0
    cuda = quantizer.device == "cuda"
    name = f"{reader.src / main.file}: {main.name}"
    starts = range(first * step, rows, step)
    q: queue.Queue = queue.Queue(maxsize=DEPTH)
    stop = threading.Event()
    feeder = None
    if len(starts) > 1:
        args = (t, reader, step, starts, rows, cuda, q, stop, stages)
        feeder = threading.Thread(target=_read_ahead, args=args, daemon=True)
        feeder.start()
        source = _from_queue(q, stages)
    else:
        source = _read_here(t, reader, step, starts, rows, cuda, stages)
    flight: deque = deque()
    try:
        for inputs in source:
            if len(main.shape) < 2:  # 1-d tensors travel as [rows, 1]
                inputs = [x.reshape(-1) for x in inputs]
            if not cuda:
                t0 = time.perf_counter()
                outs = apply(t.action, inputs, quantizer, name, t.dtype, t.block)
                _add(stages, "kernel", time.perf_counter() - t0)
                yield outs
                continue
            t0 = time.perf_counter()
            flight.append(_launch(t, inputs, quantizer, name))
            _add(stages, "launch", time.perf_counter() - t0)
            if len(flight) >= DEPTH:
                yield _land(flight.popleft(), stages)
        while flight:
            yield _land(flight.popleft(), stages)
    finally:
        stop.set()
        while feeder is not None and feeder.is_alive():  # unblock a reader waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            feeder.join(0.01)


def _read_block(t: OutTensor, reader, a: int, b: int, cuda: bool) -> list[torch.Tensor]:
    """The inputs of rows [a, b) of the main read (and the matching rows of the others, e.g. scales)."""
    inputs = []
    for rd in t.reads:
        ra, rb_ = a // rd.ratio, -(-b // rd.ratio)
        data, width = reader.rows(rd, ra, rb_, _pinned if cuda else bytearray)
        x = from_bytes(data, rd.dtype, rb_ - ra, width)
        if cuda and not x.is_pinned():  # a column slice, gathered in pageable memory
            x = x.pin_memory()
        inputs.append(x)
    return inputs


def _read_here(t, reader, step, starts, rows, cuda, stages) -> Iterator[list[torch.Tensor]]:
    for a in starts:
        t0 = time.perf_counter()
        inputs = _read_block(t, reader, a, min(rows, a + step), cuda)
        _add(stages, "read", time.perf_counter() - t0)
        _add(stages, "wait_read", time.perf_counter() - t0)
        yield inputs


def _from_queue(q: queue.Queue, stages: dict) -> Iterator[list[torch.Tensor]]:
    while True:
        t0 = time.perf_counter()
        item = q.get()
        _add(stages, "wait_read", time.perf_counter() - t0)
        if isinstance(item, BaseException):
            raise item
        if item is None:
            return
        yield item


def _read_ahead(t, reader, step, starts, rows, cuda, q, stop, stages) -> None:
    """The reader thread: each block's inputs, in order, then None (or the exception that stopped it)."""
    try:
        for a in starts:
            t0 = time.perf_counter()
            inputs = _read_block(t, reader, a, min(rows, a + step), cuda)
            _add(stages, "read", time.perf_counter() - t0)
            if not _put(q, inputs, stop):
                return
        _put(q, None, stop)
    except BaseException as exc:  # raised in the caller
        _put(q, exc, stop)


def _pinned(n: int):
    """n bytes of page-locked host memory (torch's caching host allocator), as a writable buffer."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            pass
    return False


def _launch(t: OutTensor, inputs: list[torch.Tensor], quantizer, name: str) -> tuple:
    """Queue one block on the GPU: H2D, kernels, D2H into pinned memory, each bracketed by events."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    dev = [x.to("cuda", non_blocking=True) for x in inputs]
    ev[1].record()
    outs = apply(t.action, dev, quantizer, name, t.dtype, t.block, to_host=False)
    ev[2].record()
    host = tuple(torch.empty(o.shape, dtype=o.dtype, pin_memory=True).copy_(o, non_blocking=True) for o in outs)
    ev[3].record()
    return host, ev, inputs, outs  # inputs and outs stay referenced until their copies are done


def _land(flight: tuple, stages: dict) -> tuple:
    """Wait for a launched block's copies to finish. -> its outputs on the host"""
    host, ev, _, _ = flight
    t0 = time.perf_counter()
    ev[3].synchronize()
    _add(stages, "wait_gpu", time.perf_counter() - t0)
    for key, a, b in (("h2d", 0, 1), ("kernel", 1, 2), ("d2h", 2, 3)):
        _add(stages, key, ev[a].elapsed_time(ev[b]) / 1e3)
    return host


def _add(stages: dict, key: str, seconds: float) -> None:
    stages[key] = stages.get(key, 0.0) + seconds


class ReadAhead:
    """A thread that reads the source regions of the tensors after the current one into the page cache
    (pread into a scratch buffer, bytes dropped), at most `ahead` bytes past the tensor the writer is on:
    the per-tensor reader threads of `blocks` overlap only within a tensor, and most computed tensors
    (each expert's weights) are one block. It only reads, so it cannot change what is written; it costs a
    copy of each source byte (0.2 CPU s per GB), which is why write.py starts it for CUDA only, where
    the host has cores to spare and the GPU path waits on reads.

    regions: [(tensor index, file, offset, nbytes)] in file order.
    """

    PIECE = 16 << 20

    def __init__(self, src, regions: list[tuple[int, str, int, int]], ahead: int, stages: dict | None = None):
        self.src, self.regions, self.ahead = src, regions, ahead
        self.stages = {} if stages is None else stages
        self._at = -1  # the tensor the writer is on
        self._read: deque = deque()  # (tensor index, bytes) read for tensors past the writer's
        self._bytes = 0  # their sum
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)
        self._thread.start()

    def at(self, index: int) -> None:
        """The writer is now on tensor `index`: what it has reached no longer counts against `ahead`."""
        with self._cv:
            self._at = index
            while self._read and self._read[0][0] <= index:
                self._bytes -= self._read.popleft()[1]
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        fds: dict[str, int] = {}
        buf = memoryview(bytearray(self.PIECE))
        try:
            for index, file, offset, nbytes in self.regions:
                pos, end = offset, offset + nbytes
                while pos < end:
                    n = min(self.PIECE, end - pos)
                    with self._cv:
                        self._cv.wait_for(
                            lambda i=index, k=n: self._stop or i <= self._at or self._bytes + k <= self.ahead
                        )
                        if self._stop:
                            return
                        if index <= self._at:  # the writer got there first
                            break
                    if file not in fds:
                        fds[file] = os.open(self.src / file, os.O_RDONLY)
                    t0 = time.perf_counter()
                    got = os.preadv(fds[file], [buf[:n]], pos)
                    _add(self.stages, "read_ahead", time.perf_counter() - t0)
                    if got <= 0:  # a short source: the writer's own read reports it
                        break
                    pos += got
                    with self._cv:
                        if index > self._at:
                            self._read.append((index, got))
                            self._bytes += got
        except OSError:
            pass  # the writer's own reads report a source that cannot be read
        finally:
            for fd in fds.values():
                os.close(fd)
