"""`shard --workers auto`: how many local worker processes a run gets, from cores, memory and rank files.

Each worker writes one rank file at a time and keeps two or three threads busy (reads and computing in
one; the pwrite of a chunk in another, its sha256 in a third at the same time: store/sink.py), with a
resident size under WORKER_RSS (0.37-0.85 GiB measured, docs/BENCHMARKS.md). Measured on the 16-core
H200 host (old code, cold source): 1 worker 2.33x cp, 4 workers 1.65x, 8 workers 1.68x: where most bytes
are copied, past a quarter of the cores the disk, not the CPU, limits. Where most output bytes are
computed on the CPU (an export that decodes or casts every expert), each worker's converting thread is
the limit instead: 4 workers of the fp8 export kept 3 of 16 cores busy at 1.98x cp per byte, 8 workers
1.63x (docs/BENCHMARKS.md, export).
With few cores the other way round: one worker leaves a core idle while its threads wait on reads and
writes, so two beat one even on two cores (dev box, 2 cores, medium preset, cold source, three
alternating rounds: `shard --tp 8` 22.4-23.0 s with two workers against 30.6-40.8 s with one, `export
--format fp8` 18.8-19.9 s against 27.0-27.5 s; docs/BENCHMARKS.md).
So: a quarter of the usable cores, half of them where most output bytes are computed, but two where there
are two cores or more; at most one worker per WORKER_RSS of half the available memory (the page cache
needs the rest), at most one per rank file, at least one. With --device cuda all workers would share one
GPU and each load the kernels: one worker.
"""

from __future__ import annotations

from dsv41_convert.store.machine import available_memory, usable_cores

WORKER_RSS = 1 << 30


def auto_workers(
    files: int,
    device: str = "cpu",
    cores: int | None = None,
    memory: int | None = None,
    computed_share: float = 0.0,
) -> int:
    """Worker processes for `files` rank files to write, `computed_share` of whose bytes are computed rather
    than copied (see the module doc)."""
    if device == "cuda" or files <= 1:
        return 1
    cores = usable_cores() if cores is None else cores
    memory = available_memory() if memory is None else memory
    per_worker = 2 if computed_share > 0.5 else 4
    by_cores = max(min(cores, 2), cores // per_worker)
    return max(1, min(files, by_cores, memory // 2 // WORKER_RSS))
