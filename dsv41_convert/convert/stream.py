"""Computed tensors as a stream of row blocks: the source reads run ahead in a thread, and on CUDA each
block travels through pinned host memory with asynchronous copies, so reading, the GPU, writing and
hashing overlap:

    reader thread   pread of block k+1, or on CUDA its buffer taken from the file's Prefetch
                    (prefetch.py), which reads ahead across tensors into one pinned ring
    caller          block k: H2D (whole rows; a column slice is selected on the GPU), the action's
                    kernels, D2H into the staging ring, all queued on the current stream; then waits
                    for block k-1's copies and hands them to the Sink
    Sink thread     sha256 and pwrite of block k-2 (store/sink.py)

At most DEPTH blocks are read ahead and DEPTH are on the GPU, so host memory is a few blocks whatever
the tensor size, and a tensor of any size (an Engram table of 91.5 GiB) never needs to fit on the GPU
whole: GPU memory is a few blocks of at most GPU_BLOCK_BYTES of source each, plus their outputs.
`block_starts` and `block_rows` say which source rows each block reads; write.py lists the same pieces
for the Prefetch, so what it reads is what the blocks ask for.

Pinned host memory on CUDA is two rings allocated once per process (ring.py), never a buffer per block:
the Prefetch's (write.READ_AHEAD_BYTES), whose regions the caller releases against the event after
their H2D copies, and the D2H staging ring (STAGING_BYTES), whose regions come back when the Sink has
dropped the output and its copy is done; when it is full, an output is copied into pageable memory
(stage d2h_pageable). A block the Prefetch did not read (read here, or larger than its ring) is read
into pageable memory (the H2D copy from it is then synchronous).

Stage times (seconds summed over blocks, in `stages`): read = getting a block's bytes in the reader
thread (a pread, or the wait for the Prefetch's buffer; its own reads show as `read_ahead`); the wait
for the reader in the caller shows as `wait_read`; h2d, kernel, d2h = CUDA event intervals on the
current stream (on CPU, kernel = the action's wall time); launch = the caller's time to queue them (the
kernels' Python wrappers, their NaN checks' syncs); wait_gpu = waiting for a block's copies; write and
hash are timed by the Sink.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dsv41_convert.convert.plan import BF16, E4M3, E8M0, F4, OutTensor, Read
from dsv41_convert.progress import add_seconds
from dsv41_convert.quant.byte_checks import Region

if TYPE_CHECKING:
    import torch

    from dsv41_convert.convert.ring import Staging


FP4_BYTES = ("I8", "U8", F4)  # dtypes that store packed e2m1 pairs


def numpy_computes(t: OutTensor) -> bool:
    """Whether numpy computes t's action on the CPU, on bytes, so that its worker needs no torch: the fp4 ->
    fp8 cast (quant/cast_bytes.py), e4m3 x e8m0 -> bf16 (quant/fp8_bytes.py: wo_a in `shard`, the fp8
    weights of a bf16 export) and e2m1 x e8m0 -> bf16 (quant/fp4_bytes.py: a bf16 export's experts). The
    other actions (quantizing a bf16 source) go through transform.apply (torch)."""
    if t.action == "fp4_to_fp8":
        return True
    dtypes = [r.dtype for r in t.reads]
    if t.action == "dequant_bf16":
        return t.dtype == BF16 and dtypes == [E4M3, E8M0]
    return t.action == "dequant_fp4" and t.dtype == BF16 and dtypes[1:] == [E8M0] and dtypes[0] in FP4_BYTES


GPU_BLOCK_BYTES = 64 << 20  # source bytes per row block on CUDA (64 MiB blocks: per-block costs < 5%)
DEPTH = 2  # blocks read ahead, and blocks in flight on the GPU
STAGING_BYTES = 128 << 20  # pinned host memory the D2H copies land in (one ring per process)
_staging: Staging | None = None


def staging() -> Staging:
    """The process's D2H staging ring, pinned, allocated at its first use."""
    global _staging
    if _staging is None:
        from dsv41_convert.convert.ring import Staging

        _staging = Staging(STAGING_BYTES, pinned)
    return _staging


def blocks(t: OutTensor, reader, quantizer, step: int, first: int, stages: dict | None = None) -> Iterator[tuple]:
    """Yield the action's outputs (CPU tensors) for each block of `step` rows of t's source region, from
    block `first` on. `reader` is write.py's _Reader; `stages` (if given) accumulates the stage times.
    A tensor of one block is read in the caller (nothing to overlap within it; no thread to start)."""
    stages = {} if stages is None else stages
    main = t.reads[0]
    rows = main.r1 - main.r0
    cuda = quantizer.device == "cuda"
    name = main.label(reader.src)
    form = "cuda" if cuda else "bytes" if numpy_computes(t) else "tensors"  # how _read_block hands inputs over
    compute = _numpy_action(t) if form == "bytes" else _torch_action(t, quantizer)
    starts = block_starts(t, step, first)
    q: queue.Queue = queue.Queue(maxsize=DEPTH)
    stop = threading.Event()
    feeder = None
    if len(starts) > 1:
        args = (t, reader, step, starts, rows, form, q, stop, stages)
        feeder = threading.Thread(target=_read_ahead, args=args, daemon=True)
        feeder.start()
        source = _from_queue(q, stages)
    else:
        source = _read_here(t, reader, step, starts, rows, form, stages)
    flight: deque = deque()
    flat = len(main.shape) < 2  # 1-d tensors travel as [rows, 1]
    try:
        for a, inputs in zip(starts, source, strict=False):  # the source yields one block per start, in order
            where = block_name(name, main, a, min(rows, a + step), scale_label(t, reader.src))
            if not cuda:
                if flat:
                    inputs = [x.reshape(-1) for x in inputs]
                t0 = time.perf_counter()
                outs = compute(inputs, where)
                add_seconds(stages, "kernel", time.perf_counter() - t0)
                yield outs
                continue
            t0 = time.perf_counter()
            flight.append(_launch(t, inputs, quantizer, where, flat, reader.ahead, stages))
            add_seconds(stages, "launch", time.perf_counter() - t0)
            if len(flight) >= DEPTH:
                yield _land(flight.popleft(), stages)
        while flight:
            yield _land(flight.popleft(), stages)
    finally:
        stop.set()
        while feeder is not None and feeder.is_alive():  # unblock a reader waiting on a full queue
            try:
                _unused(q.get_nowait(), reader.ahead)
            except queue.Empty:
                pass
            feeder.join(0.01)
        while feeder is not None and not q.empty():
            _unused(q.get_nowait(), reader.ahead)


def block_name(name: str, main: Read, a: int, b: int, scale: str = "") -> Region:
    """`name` for the messages about one row block [a, b) of main's region: with the block's source rows
    where it is not the whole tensor; a Region, so that an index in a message counts from the source
    tensor's first row and column (a block's, or a rank's columns', said from the block's: an audit).
    scale: where its scale is stored, when not in main's file (scale_label)."""
    r0, r1 = main.r0 + a, main.r0 + b
    text = name if (r0, r1) == (0, (main.shape or (1,))[0]) else f"{name} (source rows {r0}..{r1 - 1})"
    col = main.c0 * (2 if main.dtype in FP4_BYTES else 1)  # in values: a packed byte holds two
    return Region(text, r0, col, main.shape, scale)


def scale_label(t: OutTensor, src: Path) -> str:
    """The scale t's action decodes with (its second read) as "FILE: NAME", where another source file than the
    weight's holds it (a checkpoint saved in other groupings than the published one); else "". A NaN scale
    was said of the weight's file alone, where no scale lies."""
    main, scale = t.reads[0], t.reads[1] if len(t.reads) > 1 else None
    return scale.label(src) if scale is not None and scale.file != main.file else ""


def _numpy_action(t: OutTensor):
    """A `numpy_computes` action on one row block: uint8 rows in, arrays of the output bytes' width out
    (transform.py's shapes)."""
    if t.action == "dequant_bf16":
        from dsv41_convert.quant.fp8_bytes import decode_fp8_blocks_bf16

        return lambda inputs, name: (decode_fp8_blocks_bf16(inputs[0], inputs[1], tuple(t.block), name),)
    if t.action == "dequant_fp4":
        from dsv41_convert.quant.fp4_bytes import decode_mxfp4_bf16

        return lambda inputs, name: (decode_mxfp4_bf16(inputs[0], inputs[1], 32, name),)
    from dsv41_convert.quant.cast_bytes import fp4_to_fp8_bytes

    return lambda inputs, name: fp4_to_fp8_bytes(inputs[0], inputs[1], 32, name)


def _torch_action(t: OutTensor, quantizer):
    """Any action on one row block through transform.apply (torch tensors in and out; the quantizer's device)."""
    from dsv41_convert.convert.transform import apply

    return lambda inputs, name: apply(t.action, inputs, quantizer, name, t.dtype, t.block)


def block_rows(t: OutTensor, a: int, b: int) -> Iterator[tuple[Read, int, int]]:
    """The source rows that rows [a, b) of the main read need, per read: (read, first row, end row)
    relative to its r0 (a scale read covers `ratio` main rows per row)."""
    for rd in t.reads:
        yield rd, a // rd.ratio, -(-b // rd.ratio)


def block_starts(t: OutTensor, step: int, first: int) -> range:
    """The first main-read row of each block of `step` rows, from block `first` on."""
    return range(first * step, t.reads[0].r1 - t.reads[0].r0, step)


class HostRows(NamedTuple):
    """One input of a block on its way to the GPU: whole source rows in host memory.

    rows: [rows, row bytes / itemsize]  the read's dtype, sharing `buf` (a Prefetch ring region, or
          pageable memory read by the converter)
    cols: (c0, c1) the columns the action reads (selected on the GPU), or None for all
    """

    rows: torch.Tensor
    cols: tuple[int, int] | None
    buf: object


def _read_block(t: OutTensor, reader, a: int, b: int, form: str) -> list:
    """The inputs of rows [a, b) of the main read (and the matching rows of the others, e.g. scales), in
    `form`: "tensors", CPU tensors of the selected columns; "bytes" (where `numpy_computes`), uint8 arrays
    [rows, row bytes] of them; "cuda", HostRows (whole rows: no gather on the host)."""
    if form == "bytes":
        views = []
        for rd, ra, rb_ in block_rows(t, a, b):
            data, width = reader.rows(rd, ra, rb_, bytearray)
            views.append(np.frombuffer(data, np.uint8).reshape(rb_ - ra, width))
        return views
    from dsv41_convert.convert.transform import from_bytes

    inputs = []
    for rd, ra, rb_ in block_rows(t, a, b):
        if form == "cuda":
            data, width = reader.rows(rd, ra, rb_, bytearray, whole=True)
            cols = (rd.c0, rd.c1) if rd.c1 >= 0 else None
            inputs.append(HostRows(from_bytes(data, rd.dtype, rb_ - ra, width), cols, data))
            continue
        data, width = reader.rows(rd, ra, rb_, bytearray)
        inputs.append(from_bytes(data, rd.dtype, rb_ - ra, width))
    return inputs


def _unused(item, ahead) -> None:
    """A block read but never launched (the consumer stopped): its Prefetch buffers are free now."""
    if ahead is not None and isinstance(item, list):
        for x in item:
            if isinstance(x, HostRows):
                ahead.release(x.buf)


def _read_here(t, reader, step, starts, rows, form, stages) -> Iterator[list]:
    for a in starts:
        t0 = time.perf_counter()
        inputs = _read_block(t, reader, a, min(rows, a + step), form)
        add_seconds(stages, "read", time.perf_counter() - t0)
        add_seconds(stages, "wait_read", time.perf_counter() - t0)
        yield inputs


def _from_queue(q: queue.Queue, stages: dict) -> Iterator[list]:
    while True:
        t0 = time.perf_counter()
        item = q.get()
        add_seconds(stages, "wait_read", time.perf_counter() - t0)
        if isinstance(item, BaseException):
            raise item
        if item is None:
            return
        yield item


def _read_ahead(t, reader, step, starts, rows, form, q, stop, stages) -> None:
    """The reader thread: each block's inputs, in order, then None (or the exception that stopped it)."""
    try:
        for a in starts:
            t0 = time.perf_counter()
            inputs = _read_block(t, reader, a, min(rows, a + step), form)
            add_seconds(stages, "read", time.perf_counter() - t0)
            if not _put(q, inputs, stop):
                return
        _put(q, None, stop)
    except BaseException as exc:  # raised in the caller
        _put(q, exc, stop)


def pinned(n: int):
    """n bytes of page-locked host memory (torch's caching host allocator), as a writable buffer: for
    buffers allocated once (the Prefetch's ring, the D2H staging ring), never per block."""
    import torch

    return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()


def settle_device() -> None:
    """Wait until the GPU has finished everything queued (before host buffers an aborted block may still
    be copying are reused)."""
    import torch

    torch.cuda.synchronize()


def drop_cached_pinned() -> None:
    """Return the pinned blocks torch's caching host allocator keeps but nothing uses (stray per-call
    pinned tensors) to the system; the rings, still referenced, stay. A process without torch has none."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_initialized():
        empty()


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            pass
    return False


def _launch(t: OutTensor, inputs: list[HostRows], quantizer, name: str, flat: bool, ahead, stages: dict) -> tuple:
    """Queue one block on the GPU: H2D (then the columns selected), kernels, D2H into the staging ring,
    each bracketed by events. The inputs' Prefetch buffers are released against the event after the H2D
    copies: the ring hands their bytes out again only once those copies are done."""
    import torch

    from dsv41_convert.convert.transform import apply

    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    dev = []
    for x in inputs:
        d = x.rows.to("cuda", non_blocking=True)
        if x.cols is not None:
            d = d[:, x.cols[0] : x.cols[1]].contiguous()
        dev.append(d.reshape(-1) if flat else d)
    ev[1].record()
    if ahead is not None:
        for x in inputs:
            ahead.release(x.buf, ev[1])
    outs = apply(t.action, dev, quantizer, name, t.dtype, t.block, to_host=False)
    ev[2].record()
    host, staged = [], []
    for o in outs:
        got = staging().empty(o.shape, o.dtype)
        if got is None:  # the staging ring is full: pageable memory (the copy then waits for the GPU)
            t0 = time.perf_counter()
            host.append(torch.empty(o.shape, dtype=o.dtype).copy_(o))
            add_seconds(stages, "d2h_pageable", time.perf_counter() - t0)
            continue
        host.append(got[0].copy_(o, non_blocking=True))
        staged.append(got[1])
    ev[3].record()
    for region in staged:
        region.fence = ev[3]  # its bytes come back once the tensor is gone and this copy is done
    return tuple(host), ev, inputs, outs  # inputs and outs stay referenced until their copies are done


def _land(flight: tuple, stages: dict) -> tuple:
    """Wait for a launched block's copies to finish. -> its outputs on the host"""
    host, ev, _, _ = flight
    t0 = time.perf_counter()
    ev[3].synchronize()
    add_seconds(stages, "wait_gpu", time.perf_counter() - t0)
    for key, a, b in (("h2d", 0, 1), ("kernel", 1, 2), ("d2h", 2, 3)):
        add_seconds(stages, key, ev[a].elapsed_time(ev[b]) / 1e3)
    return host
