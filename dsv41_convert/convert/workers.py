"""`shard --workers auto`: how many local worker processes a run gets, from cores, memory and rank files.

Each worker writes one rank file at a time and keeps two or three threads busy (reads and computing in
one; the pwrite of a chunk in another, its sha256 in a third at the same time: store/sink.py), with a
resident size under WORKER_RSS (0.37-0.85 GiB measured, docs/BENCHMARKS.md). Measured on the 16-core
H200 host (old code, cold source): 1 worker 2.33x cp, 4 workers 1.65x, 8 workers 1.68x: where most bytes
are copied, past a quarter of the cores the disk, not the CPU, limits. Where most output bytes are
computed on the CPU (an export that decodes or casts every expert), each worker's converting thread is
the limit instead: 4 workers of the fp8 export kept 3 of 16 cores busy at 1.98x cp per byte, 8 workers
1.63x (docs/BENCHMARKS.md, export).
With few cores the other way round: a worker leaves its core idle while its threads wait on reads and
writes, so more workers than cores fill the gaps (dev box, 2 cores, medium preset, three alternating
rounds: `shard --tp 8` 22.4-23.0 s with two workers against 30.6-40.8 s with one, `export --format fp8`
18.8-19.9 s against 27.0-27.5 s; session 15, source cached, paired rounds: `shard --tp 8` with four workers
0.76-0.96x the wall time of two in all ten, the same CPU; `export --format fp8`, most of whose bytes are
computed, 0.87-1.02x, no clear gain; docs/BENCHMARKS.md).
So: a quarter of the usable cores, but four where there are two cores or more (COPY_FLOOR); where most
output bytes are computed, half the cores, but two (COMPUTE_FLOOR); at most one worker per WORKER_RSS of
half the available memory (the page cache needs the rest), at most one per rank file, at least one. With
--device cuda all workers would share one GPU and each load the kernels: one worker.
"""

from __future__ import annotations

from dsv41_convert.store.machine import available_memory, usable_cores

WORKER_RSS = 1 << 30
COPY_FLOOR = 4  # workers at least, on two cores or more, where most output bytes are copied
COMPUTE_FLOOR = 2  # likewise where most are computed (each worker's converting thread keeps a core busy)


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
    computed = computed_share > 0.5
    floor = (COMPUTE_FLOOR if computed else COPY_FLOOR) if cores >= 2 else 1
    by_cores = max(floor, cores // (2 if computed else 4))
    return max(1, min(files, by_cores, memory // 2 // WORKER_RSS))
