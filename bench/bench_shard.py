"""Benchmark `dsv41-convert shard --tp 8` against `cp` of the same bytes and an all-in-RAM converter.

    python bench/bench_shard.py /tmp/bench [--gb 4.5] [--experts 384] [--workers 2] [--repeat N] [--keep]
                                           [--skip-in-ram] [--src CKPT] [--warm]

Every CLI run is this checkout's, wherever the bench is started from (`python -P -m dsv41_convert.cli` with
PYTHONPATH set to it: `-m` alone runs the working directory's package first).

--src CKPT uses an existing checkpoint (e.g. `make-tiny CKPT --preset medium --no-vision`; kept) instead of
writing one; --warm reads the source into the page cache before each run instead of evicting it (the
"source in page cache" case, where the run is CPU-bound on a fast disk).

1. writes a published-format (fp8/fp4) checkpoint of at least --gb GB into WORK/src (real hidden sizes,
   3 or more layers of --experts routed experts + 1 MTP stage of 16; random bytes below 0x7F, finite in
   every dtype: the conversion copies and reinterprets, looking at values only to refuse NaN and infinity).
   With the real 384 experts (23.7 GB in 3 layers), routed experts are most of the bytes and tp 8 writes
   1.09x the input, near the real model's 1.05x; with 64 experts it writes 1.37x (replicated tensors weigh
   more). The smallest run, `--experts 8 --gb 0`, writes 2.48 GB (tp 8 writes 4.55 GB of it).
   Disk: WORK must hold the source and, beside it, its copy or tp 8's output (one at a time): 7.4 GB free
   for the smallest run, 13.9 GB at 64 experts, 51 GB at the default 384 (2% and 256 MiB to spare; beside
   --src, the larger of the two). Both sizes are planned first (tp 8's plan over a hollow copy's headers)
   and a disk too small is refused before anything is written;
2. times, each from a cold page cache for its files (posix_fadvise DONTNEED, then sync):
   - `cp` of the shards + sync,
   - `dsv41-convert shard SRC OUT --tp 8` (it fsyncs every file),
   - the all-in-RAM approach of upstream convert.py (tests/reference_convert.py: load everything, build
     every rank's dict, save_file each, fsync), unless --skip-in-ram; it holds about 1.4x the source, and
     a source that would not fit in the memory available is refused before anything is written;
3. records peak RSS: of the whole process tree (sampled every 0.1 s) and of the largest single process,
   and CPU seconds (user + system, the process and the children it reaped) per GB written;
4. prints a JSON result for docs/BENCHMARKS.md; deletes WORK unless --keep (a WORK holding files that a
   bench's run did not leave is refused, not emptied).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv41_convert.config import ModelArgs  # noqa: E402
from dsv41_convert.convert.catalogue import published_layout  # noqa: E402
from dsv41_convert.convert.plan import build_plan  # noqa: E402
from dsv41_convert.convert.tp import check_tp  # noqa: E402
from dsv41_convert.engram_buckets import engram_table_rows  # noqa: E402
from dsv41_convert.errors import ConfigError, ConvertError, PlanError  # noqa: E402
from dsv41_convert.store.machine import available_memory  # noqa: E402
from dsv41_convert.store.safetensors_header import build_header, nbytes  # noqa: E402

REAL_CONFIG = ROOT / "tests" / "data" / "reference" / "v41-flash.config.json"
TP = 8  # every conversion the bench times writes this many ranks


def _cli(code: Path) -> list[str]:
    """The CLI of the checkout `code`, whatever the caller's PYTHONPATH and working directory (-P: the working
    directory is not put first on sys.path, as `-m` would). `code` goes before the caller's PYTHONPATH, which
    stays after it (the GPU machine's TileLang is found there)."""
    path = os.pathsep.join([str(code), *filter(None, [os.environ.get("PYTHONPATH")])])
    return ["env", f"PYTHONPATH={path}", sys.executable, "-P", "-m", "dsv41_convert.cli"]


CLI = _cli(ROOT)  # this checkout's, wherever the bench is started from


# one Engram table of about a million rows (1,000,134: the sum of its six bucket primes, which config.py checks)
ENGRAM_VOCAB = 166_667


def bench_config(n_layers: int, n_experts: int = 384) -> dict:
    cfg = copy.deepcopy(json.loads(REAL_CONFIG.read_text()))
    del cfg["vision_config"]
    t = cfg["text_config"]
    t.update(
        vocab_size=32768, num_hidden_layers=n_layers, n_routed_experts=n_experts, engram_n_heads=2,
        num_nextn_predict_layers=1,
        compress_ratios=[0, 2, 1] + [1] * (n_layers - 3) + [0], kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2], candidate_source_layer_id=2, engram_layer_ids=[1],
        engram_vocab_size=ENGRAM_VOCAB, engram_num_embeddings=list(engram_table_rows(1, 4, 2, ENGRAM_VOCAB)),
        dspark_target_layer_ids=[n_layers - 1], dspark_n_routed_experts=16,
        dspark_noise_token_id=32767,  # a token of the vocabulary (config.py refuses one beyond it)
    )  # fmt: skip
    return cfg


def expert_count(text: str) -> int:
    """--experts: a routed expert count the bench's model can have and `shard --tp 8` can split (the tool's own
    checks, before anything is written). Raises argparse.ArgumentTypeError naming the rule it breaks."""
    try:
        n = int(text)
        where = f"{n} routed experts"
        check_tp(ModelArgs.from_hf_dict(bench_config(3, n), where), TP, where)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    except (ConfigError, PlanError) as e:
        raise argparse.ArgumentTypeError(f"{e} (a positive multiple of {TP}: 8, 16, 64, 384)") from None
    return n


def source_bytes(size: int) -> bytes:
    """`size` random bytes, each below 0x7F: finite read at any offset as F8_E4M3 (NaN 0x7F / 0xFF), F8_E8M0
    (NaN 0xFF), BF16 and F32 (the top byte's exponent bits never all ones); shard refuses a non-finite value it
    copies (quant/byte_checks.first_nonfinite), so uniformly random bytes (NaN in every dtype) cannot be
    converted. The I8 bytes of fp4 experts take any value."""
    return np.random.default_rng(0).integers(0, 0x7F, size, dtype=np.uint8).tobytes()


WORK_MARK = ".bench-work"  # in WORK: a bench's folder, which a later run may empty


def fresh_work(work: Path, src: Path | None) -> None:
    """Make WORK an empty folder of the bench's own (marked), where a run writes and which it deletes after.
    Raises SystemExit, touching nothing, where --src lies inside WORK or WORK holds files a bench did not
    write (no mark): a source or data of one's own, named by mistake."""
    if src is not None and src.resolve().is_relative_to(work.resolve()):
        raise SystemExit(f"--src {src}: inside WORK {work}, which the bench deletes; choose another WORK")
    if work.exists():
        if not work.is_dir() or (any(work.iterdir()) and not (work / WORK_MARK).is_file()):
            raise SystemExit(
                f"{work}: not a bench's folder (a file, or a folder holding files and no {WORK_MARK}, which a "
                "bench's run leaves); the bench empties WORK and deletes it after: give a new or empty folder"
            )
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / WORK_MARK).touch()


def write_source(src: Path, gb: float, n_experts: int, hollow: bool = False) -> int:
    """A published-format checkpoint of at least `gb` GB (3 layers or more), one shard per layer; hollow: its
    files sparse (headers only, the rest a hole: nothing but the headers on disk), for planning. -> bytes"""
    n_layers = 3
    while True:
        cfg = bench_config(n_layers, n_experts)
        layout = published_layout(ModelArgs.from_hf_dict(cfg))
        total = sum(nbytes(d, s) for d, s in layout.values())
        if total >= gb * 1e9 or n_layers > 60:
            break
        n_layers += 1
    src.mkdir(parents=True)
    groups: dict[str, list[str]] = {}
    for name in layout:
        key = ".".join(name.split(".")[:2]) if name.startswith(("layers.", "mtp.")) else "top"
        if ".engram.embed." in name:
            key = "engram"
        groups.setdefault(key, []).append(name)
    # one pool, written at shifting offsets: drawing 5 GB of random numbers would take longer than the benchmark
    pool = b"" if hollow else source_bytes(2 * (64 << 20))
    shift = 0
    weight_map = {}
    written = 0
    for i, names in enumerate(groups.values()):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, spans = build_header([(n, *layout[n]) for n in names])
        with open(src / file, "wb") as f:
            f.write(header)
            if hollow:
                f.truncate(max(end for _, _, end in spans))  # absolute offsets
                f.seek(0, os.SEEK_END)
                spans = []
            for _, begin, end in spans:
                left = end - begin
                while left:
                    n = min(left, 64 << 20)
                    f.write(pool[shift : shift + n])
                    left, shift = left - n, (shift + 4097) % (64 << 20)
            written += f.tell()
        weight_map.update(dict.fromkeys(names, file))
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    return written


def planned_bytes(scratch: Path, gb: float, n_experts: int, src: Path | None = None) -> tuple[int, int]:
    """(bytes of the source: `src`'s shards, or those write_source(gb, n_experts) would write; bytes `shard --tp
    8` writes of it: its own plan over the headers, of a hollow source written into `scratch` and removed)."""
    if src is None:
        write_source(scratch, gb, n_experts, hollow=True)
    try:
        folder = scratch if src is None else src
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        return size, build_plan(folder, TP).total_bytes
    except ConvertError as e:
        raise SystemExit(f"error: {e}") from None  # a --src shard cannot convert: said before any run
    finally:
        if src is None:
            shutil.rmtree(scratch)


def require_room(work: Path, source: int, output: int, write_source: bool) -> None:
    """Raise SystemExit where WORK's disk cannot hold what the bench writes at once: the source (unless --src),
    beside it `cp`'s copy of it, then tp 8's output (the all-in-RAM run's about as much), each removed before
    the next; 2% and 256 MiB to spare (file system blocks, the journal, manifest)."""
    peak = (source if write_source else 0) + max(source, output)
    need = int(peak * 1.02) + (256 << 20)
    free = shutil.disk_usage(work).free
    if free < need:
        what = f"the source, {source / 1e9:.2f} GB, then beside it" if write_source else "beside --src"
        raise SystemExit(
            f"{work}: {free / 1e9:.1f} GB free, the bench needs {need / 1e9:.1f} GB ({what} a copy of the source "
            f"or tp {TP}'s output, {max(source, output) / 1e9:.2f} GB); choose a WORK on a larger disk"
            + (", or fewer --experts" if write_source else "")
        )


IN_RAM_PER_SOURCE_BYTE = 1.5  # the all-in-RAM run's peak RSS over the source's bytes: 1.42 measured (3.5 / 2.48 GB)


def require_in_ram_fits(source: int) -> None:
    """Raise SystemExit where the all-in-RAM run (the last, after every other run) would not fit in the memory
    available now: killed there, it ended the bench without printing what it had measured."""
    need, free = int(source * IN_RAM_PER_SOURCE_BYTE), available_memory()
    if need > free:
        raise SystemExit(
            f"the all-in-RAM run holds the whole source and more, about {need / 1e9:.1f} GB here, and "
            f"{free / 1e9:.1f} GB available: pass --skip-in-ram (or fewer --experts, a smaller --src)"
        )


def evict(*folders: Path) -> None:
    """Drop the page cache of every file under `folders` (clean pages only: sync first); with
    BENCH_DROP_CACHES=1 and as root, the whole page cache too (/proc/sys/vm/drop_caches: the file system's
    metadata as well; opt-in, since on a shared machine it slows everyone's reads)."""
    os.sync()
    if os.environ.get("BENCH_DROP_CACHES") == "1":
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except OSError:
            pass  # not root: the files' own pages only
    for folder in folders:
        for p in folder.rglob("*") if folder.exists() else []:
            if p.is_file():
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)


def warm(*folders: Path) -> None:
    """Read every file under `folders` into the page cache."""
    buf = bytearray(16 << 20)
    for folder in folders:
        for p in folder.rglob("*"):
            if p.is_file():
                with open(p, "rb", buffering=0) as f:
                    while f.readinto(buf):
                        pass


def _tree_rss(root: int) -> int:
    """Summed RSS (bytes) of `root` and its descendants."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            statm = Path(f"/proc/{d}/statm").read_text().split()
        except OSError:
            continue
        parents[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
        rss[int(d)] = int(statm[1]) * os.sysconf("SC_PAGE_SIZE")
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(p for p, pp in parents.items() if pp == pid)
    return total


def measure(cmd: list[str], stdout: Path | None = None) -> dict:
    """Wall time, peak tree RSS and peak single-process RSS of `cmd` (which must succeed); its standard
    output goes to `stdout` if given."""
    t0 = time.perf_counter()
    sink = open(stdout, "wb") if stdout else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.PIPE)
    finally:
        if stdout:
            sink.close()
    peak = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - t0
    err = proc.stderr.read().decode()
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise SystemExit(f"{cmd} failed ({code}):\n{err[-2000:]}")
    return {
        "seconds": round(seconds, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "user_s": round(usage.ru_utime, 2),
        "peak_tree_rss_gib": round(peak / 2**30, 3),
        "max_process_rss_gib": round(usage.ru_maxrss * 1024 / 2**30, 3),  # the child or any descendant it reaped
    }


IN_RAM = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from pathlib import Path
from reference_convert import reference_convert
from safetensors.torch import save_file
out = Path({out!r}); out.mkdir(parents=True, exist_ok=True)
for r, sd in enumerate(reference_convert(Path({src!r}), {tp})):
    p = out / f"model{{r}}-mp{tp}.safetensors"
    save_file(sd, p)
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.close(fd)
"""


def _median(xs: list[float]) -> float:
    """The lower middle value."""
    return sorted(xs)[(len(xs) - 1) // 2]


def _median_run(runs: list[dict]) -> dict:
    """The run with the median time (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("--gb", type=float, default=4.5)
    per_layer = f"routed experts per layer, a multiple of {TP} (V4.1-Flash: 384)"
    ap.add_argument("--experts", type=expert_count, default=384, help=per_layer)
    ap.add_argument("--workers", default="2", help="a number, or auto (this code's choice)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--skip-in-ram", action="store_true")
    ap.add_argument("--repeat", type=int, default=1, help="cp and shard alternate this many times; medians reported")
    ap.add_argument("--src", type=Path, help="an existing checkpoint to convert (kept), instead of writing one")
    ap.add_argument("--warm", action="store_true", help="source in the page cache for every run (else evicted)")
    a = ap.parse_args()
    work = a.work
    fresh_work(work, a.src)
    src = a.src.resolve() if a.src else work / "src"
    prepare = warm if a.warm else evict
    try:
        size, out_planned = planned_bytes(work / "plan", a.gb, a.experts, a.src and src)
        require_room(work, size, out_planned, write_source=not a.src)
        if not a.skip_in_ram:
            require_in_ram_fits(size)
        t0 = time.perf_counter()
        size = sum(p.stat().st_size for p in src.glob("*.safetensors")) if a.src else write_source(src, a.gb, a.experts)
        gen = time.perf_counter() - t0
        shards = sorted(str(p) for p in src.glob("*.safetensors"))
        cps, shards_runs = [], []
        for _ in range(a.repeat):  # alternating, so slow phases of a shared disk hit both sides
            (work / "cp").mkdir()
            prepare(src)
            cps.append(measure(["sh", "-c", 'cp "$@" ' + str(work / "cp") + " && sync", "cp", *shards]))
            shutil.rmtree(work / "cp")
            prepare(src)
            shard_cmd = ["shard", str(src), str(work / "out"), "--tp", str(TP), "--workers", str(a.workers), "--json"]
            shards_runs.append(measure([*CLI, *shard_cmd]))
            out_bytes = sum(p.stat().st_size for p in (work / "out").glob("model*.safetensors"))
            shutil.rmtree(work / "out")
        cp, ours = _median_run(cps), _median_run(shards_runs)
        in_ram = None
        if not a.skip_in_ram:
            prepare(src)
            script = IN_RAM.format(tests=str(ROOT / "tests"), out=str(work / "ram"), src=str(src), tp=TP)
            in_ram = measure([sys.executable, "-c", script])
            shutil.rmtree(work / "ram")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)  # never --src: it lies outside WORK
    result = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM",
        "source": str(a.src) if a.src else f"synthetic, {a.experts} experts",
        "source_cache": "warm" if a.warm else "cold",
        "source_gb": round(size / 1e9, 3),
        "output_gb": round(out_bytes / 1e9, 3),
        "generate_s": round(gen, 1),
        "workers": a.workers,
        "cp": cp,
        "shard": ours,
        "in_ram": in_ram,
        "experts": a.experts,
        "cp_runs_s": [r["seconds"] for r in cps],
        "shard_runs_s": [r["seconds"] for r in shards_runs],
        "shard_vs_cp_each": [round(o["seconds"] / c["seconds"], 2) for c, o in zip(cps, shards_runs, strict=True)],
        "shard_vs_cp": round(ours["seconds"] / cp["seconds"], 2),
        "shard_vs_cp_per_byte": round(ours["seconds"] / cp["seconds"] * size / out_bytes, 2),
        "shard_cpu_s_runs": [r["cpu_s"] for r in shards_runs],
        "shard_cpu_s_per_gb_written": round(_median([r["cpu_s"] for r in shards_runs]) / (out_bytes / 1e9), 2),
        "cp_cpu_s_per_gb_read": round(_median([r["cpu_s"] for r in cps]) / (size / 1e9), 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
