"""Benchmark the streaming quantization of a bf16 source (`shard --device cuda|cpu`) against `cp`, with
the time of each pipeline stage (issue 21).

    python bench/bench_quant_stream.py SRC OUT [--tp 2] [--device cuda] [--prefetch-mib M] [--read-ahead-mib M]
        [--read-threads K] [--json FILE]

SRC: a bf16 checkpoint (`make-tiny SRC --preset medium --no-vision --source-dtype bf16`). In one run:
`cp` of SRC's shards to OUT.cp + sync (source evicted from the page cache first), then every rank file
of `shard SRC OUT --tp N` written in process as execute() does with one worker (write_partial, then each
file's fsync + rename in a thread while the next is written; source evicted again; the kernels compile or
load from the cache in a warm-up file first, not timed), with seconds per stage summed over files: read
(getting each block's bytes), read_ahead (the Prefetch threads' reads, summed over threads), wait_read
(the converter waiting for a block), h2d / kernel / d2h (CUDA events), launch,
wait_gpu, write (pwrite / copy_file_range), hash (sha256, writer thread), commit (fsync + rename, its
thread). Stages overlap, so they sum to more than the wall time; the largest is the bottleneck.
--prefetch-mib sets write.PREFETCH_BYTES (the source read-ahead hint) for this run.
--read-ahead-mib / --read-threads set write.READ_AHEAD_BYTES / READ_THREADS (the Prefetch, CUDA only).
Prints JSON: wall, cp, ratio per byte read, stages, CPU seconds of the timed run, peak host RSS (of the
whole process, and of the timed run alone: VmHWM reset before it, so the warm-up's in-process kernel
compiles do not count), pinned bytes held by torch's host allocator, and peak GPU memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_shard import evict  # noqa: E402
from needs_cuda import require_cuda  # noqa: E402

from dsv41_convert.convert import stream, write  # noqa: E402
from dsv41_convert.convert.plan import build_plan  # noqa: E402
from dsv41_convert.convert.transform import quantizer_for  # noqa: E402
from dsv41_convert.convert.write import commit, write_partial, write_rank_file  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefetch-mib", type=int)
    ap.add_argument("--read-ahead-mib", type=int)
    ap.add_argument("--read-threads", type=int)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.device == "cuda":
        require_cuda()
    if a.prefetch_mib is not None:
        write.PREFETCH_BYTES = a.prefetch_mib << 20
    if a.read_ahead_mib is not None:
        write.READ_AHEAD_BYTES = a.read_ahead_mib << 20
    if a.read_threads is not None:
        write.READ_THREADS = a.read_threads
    shards = sorted(a.src.glob("*.safetensors"))
    src_bytes = sum(p.stat().st_size for p in shards)
    cp_dir = a.out.with_name(a.out.name + ".cp")
    shutil.rmtree(cp_dir, ignore_errors=True)
    cp_dir.mkdir(parents=True)
    evict(a.src)
    t0 = time.perf_counter()
    subprocess.run(["sh", "-c", f'cp "$@" {cp_dir} && sync', "cp", *map(str, shards)], check=True)
    cp_s = time.perf_counter() - t0
    shutil.rmtree(cp_dir)

    plan = build_plan(a.src, a.tp)
    quantizer = quantizer_for(a.device)
    torch.set_num_threads(1)  # as execute's jobs
    warm = a.out.with_name(a.out.name + ".warm")  # kernels compiled (or loaded) outside the timing
    shutil.rmtree(warm, ignore_errors=True)
    warm.mkdir(parents=True)
    t0 = time.perf_counter()
    write_rank_file(plan.files[0], a.src, warm, quantizer, journal_bytes=0)
    warm_s = time.perf_counter() - t0
    shutil.rmtree(warm)
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    evict(a.src)
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stages: dict[str, float] = {"commit": 0.0}

    def timed_commit(file: str) -> None:
        t = time.perf_counter()
        commit(a.out, file)
        stages["commit"] += time.perf_counter() - t

    rss_before = _status_gib("VmRSS")
    timed_hwm = _reset_peak_rss()  # peak RSS of the timed run alone, not the warm-up's kernel compiles
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as committer:
        pending = None
        for rf in plan.files:
            stats: dict = {}
            write_partial(rf, a.src, a.out, quantizer, stats=stats)
            for k, v in stats["stages"].items():
                stages[k] = stages.get(k, 0.0) + v
            if pending is not None:
                pending.result()
            pending = committer.submit(timed_commit, rf.file)
        pending.result()
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    peak_timed = _status_gib("VmHWM") if timed_hwm else None
    pinned = _pinned_stats() if a.device == "cuda" else None
    out_bytes = sum(f.nbytes for f in plan.files)
    result = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
        "device": a.device,
        "tp": a.tp,
        "prefetch_mib": write.PREFETCH_BYTES >> 20,
        "source_gb": round(src_bytes / 1e9, 3),
        "output_gb": round(out_bytes / 1e9, 3),
        "warmup_file_s": round(warm_s, 2),
        "cp_s": round(cp_s, 2),
        "shard_s": round(wall, 2),
        "shard_vs_cp_per_byte_read": round(wall / cp_s, 2),
        "source_read_gb_per_s": round(src_bytes / wall / 1e9, 3),
        "cpu_s": {"user": round(cpu1.ru_utime - cpu0.ru_utime, 2), "sys": round(cpu1.ru_stime - cpu0.ru_stime, 2)},
        "read_ahead": {"bytes": write.READ_AHEAD_BYTES, "threads": write.READ_THREADS},
        "stages_s": {k: round(v, 2) for k, v in sorted(stages.items())},
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "host_rss_before_timed_gib": rss_before,
        "peak_host_rss_timed_gib": peak_timed,
        "pinned": pinned,
        "d2h_staging_bytes": stream.STAGING_BYTES,
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if a.device == "cuda" else None,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.json:
        a.json.write_text(text + "\n")


def _status_gib(key: str) -> float | None:
    """A size line of /proc/self/status (VmRSS: resident now, VmHWM: peak resident), in GiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 2**20, 3)
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0). -> whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _pinned_stats() -> dict | None:
    """Pinned bytes torch's caching host allocator owns (in use + cached), now and at peak, in GiB."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    got = stats()
    keys = ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current", "active_bytes.peak")
    return {k: round(got[k] / 2**30, 3) for k in keys if k in got} | {"num_host_alloc": got.get("num_host_alloc")}


if __name__ == "__main__":
    main()
