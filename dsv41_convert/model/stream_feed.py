"""How the layer-streamed model (streamed.py) gets a unit's weights from the WeightProvider.

`HostFeed` (CPU): the provider's tensors, read when the unit asks for them; nothing is read ahead.

`CudaFeed` (CUDA): while one unit computes, the next unit's tensors are read in reader threads (the
provider is called for several groups of tensors at once) into pinned host buffers and copied to the GPU
asynchronously on a side stream. A provider with an `alloc` attribute (SourceWeights) reads straight into
pinned memory, so a tensor it only copies (experts, fp8 weights) needs no staging copy; the others are
staged. When the unit starts, the compute stream waits on an event recorded after those copies (a stream
wait, not a device synchronize), so compute waits only for its own weights. Routed experts, known only
once the router ran, go through the same path on a second side stream (`now`), so their copies never
queue behind the next unit's.

Bounded: at most one unit is read ahead (`ahead` is called for the next unit only). Pinned buffers come
from torch's caching host allocator and are reused once their copy finished, so host memory holds about
one unit in flight; the GPU holds the running unit plus the next unit's dense weights.

Timing (UnitTiming): read_s is the seconds spent in provider calls, summed over the reader threads (it can
exceed the wall time); transfer_s the seconds of the host-to-device copies (CUDA events around each copy)
plus the staging copies into pinned memory; wait_s the seconds the running unit stood waiting for weights
(the reading and transfer that was not hidden behind compute).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv41_convert.model.stream_records import UnitTiming, WeightProvider


def nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _groups(sizes: dict[str, int], n: int) -> list[list[str]]:
    """Split names into at most n groups of about equal bytes; a weight and its scale stay together
    (a provider computes a quantized weight's scale with it)."""
    owners: dict[str, list[str]] = {}
    for name in sizes:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    groups: list[list[str]] = [[] for _ in range(max(1, n))]
    load = [0] * len(groups)
    for names in sorted(owners.values(), key=lambda ns: -sum(sizes[x] for x in ns)):
        k = load.index(min(load))
        groups[k] += names
        load[k] += sum(sizes[x] for x in names)
    return [g for g in groups if g]


def _pinned_bytes(n: int) -> Tensor:
    """[n] uint8 in pinned host memory (torch's caching host allocator: reused once its copies finished)."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


class HostFeed:
    """The provider's tensors on the CPU, read when asked (see the module docstring)."""

    reads_ahead = False  # the runner builds the next unit early only for a feed that reads it ahead

    def __init__(self, provider: WeightProvider):
        self.provider = provider

    def ahead(self, key: str, sizes: dict[str, int]) -> None:
        """Nothing is read ahead on the CPU."""

    def take(self, key: str, sizes: dict[str, int], timing: UnitTiming) -> dict[str, Tensor]:
        return self.now(list(sizes), timing)

    def now(self, names: Sequence[str], timing: UnitTiming) -> dict[str, Tensor]:
        t0 = time.perf_counter()
        got = self.provider(names)
        spent = time.perf_counter() - t0
        timing.read_s += spent
        timing.wait_s += spent
        timing.bytes_read += nbytes(got)
        return got

    def close(self) -> None:
        pass


@dataclass
class _Part:
    """One reader thread's share of a request: its tensors on the device (copies possibly in flight)."""

    tensors: dict[str, Tensor]
    read_s: float
    stage_s: float
    copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


class CudaFeed:
    """Weights read ahead in threads, staged in pinned memory, copied on side streams (module docstring)."""

    reads_ahead = True

    def __init__(self, provider: WeightProvider, device: str | torch.device, readers: int | None = None):
        self.provider = provider
        self.device = torch.device(device)
        self.readers = readers or max(1, min(8, (os.cpu_count() or 2) // 2))
        self.ahead_pool = ThreadPoolExecutor(self.readers, thread_name_prefix="stream-ahead")
        self.now_pool = ThreadPoolExecutor(self.readers, thread_name_prefix="stream-now")
        self.ahead_stream = torch.cuda.Stream(self.device)
        self.now_stream = torch.cuda.Stream(self.device)
        self.pending: dict[str, list[Future[_Part]]] = {}
        self.queueing = threading.Lock()
        self.copies: list[tuple[UnitTiming, torch.cuda.Event, torch.cuda.Event]] = []
        if hasattr(provider, "alloc"):  # the provider reads straight into pinned memory (SourceWeights)
            provider.alloc = _pinned_bytes

    def _part(self, names: list[str], stream: torch.cuda.Stream) -> _Part:
        """Read `names`, stage each tensor in pinned memory, copy it to the device on `stream`."""
        t0 = time.perf_counter()
        with torch.inference_mode():  # as the runner's own tensors (a parameter cannot mix the two kinds)
            host = self.provider(names)
        t1 = time.perf_counter()
        part = _Part({}, t1 - t0, 0.0)
        with torch.cuda.stream(stream), torch.inference_mode():
            for name, t in host.items():
                pinned = t
                if not t.is_pinned():  # computed by the provider (wo_a dequantized, ...), or read into pageable memory
                    s0 = time.perf_counter()
                    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    pinned.copy_(t)
                    part.stage_s += time.perf_counter() - s0
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with self.queueing:  # the events bracket this copy alone, not another thread's on the stream
                    start.record(stream)
                    part.tensors[name] = pinned.to(self.device, non_blocking=True)
                    end.record(stream)
                part.copies.append((start, end))
        return part

    def _submit(self, pool: ThreadPoolExecutor, sizes: dict[str, int], stream) -> list[Future[_Part]]:
        return [pool.submit(self._part, g, stream) for g in _groups(sizes, self.readers)]

    def _collect(self, parts: list[Future[_Part]], stream, timing: UnitTiming) -> dict[str, Tensor]:
        """Wait for the reads, then make the compute stream wait for their copies."""
        t0 = time.perf_counter()
        done = [f.result() for f in parts]
        timing.wait_s += time.perf_counter() - t0
        arrived = torch.cuda.Event()
        arrived.record(stream)  # after every copy of `parts` (all were queued on `stream`)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(arrived)
        out: dict[str, Tensor] = {}
        for part in done:
            timing.read_s += part.read_s
            timing.transfer_s += part.stage_s
            self.copies += [(timing, a, b) for a, b in part.copies]
            for name, t in part.tensors.items():
                t.record_stream(compute)  # allocated on the side stream, freed after compute used it
                out[name] = t
        timing.bytes_read += nbytes(out)
        return out

    def ahead(self, key: str, sizes: dict[str, int]) -> None:
        """Start reading the unit `key` (name -> bytes of every tensor it needs)."""
        if key not in self.pending:
            self.pending[key] = self._submit(self.ahead_pool, sizes, self.ahead_stream)

    def take(self, key: str, sizes: dict[str, int], timing: UnitTiming) -> dict[str, Tensor]:
        """The unit's tensors on the device, usable on the current stream (read now if not read ahead)."""
        parts = self.pending.pop(key, None) or self._submit(self.ahead_pool, sizes, self.ahead_stream)
        return self._collect(parts, self.ahead_stream, timing)

    def now(self, names: Sequence[str], timing: UnitTiming) -> dict[str, Tensor]:
        """Tensors the running unit needs at once (routed experts), read in parallel beside the read-ahead."""
        return self._collect(self._submit(self.now_pool, dict.fromkeys(names, 1), self.now_stream), self.now_stream,
                             timing)  # fmt: skip

    def settle(self) -> None:
        """Add the finished copies' GPU time to their units' transfer_s (synchronizes the device)."""
        torch.cuda.synchronize(self.device)
        for timing, start, end in self.copies:
            timing.transfer_s += start.elapsed_time(end) / 1000
        self.copies.clear()

    def close(self) -> None:
        if getattr(self.provider, "alloc", None) is _pinned_bytes:
            self.provider.alloc = None
        for parts in self.pending.values():
            for f in parts:
                f.cancel()
        self.ahead_pool.shutdown(wait=True)
        self.now_pool.shutdown(wait=True)
        self.pending.clear()
        self.settle()
