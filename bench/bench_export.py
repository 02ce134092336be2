"""Benchmark `dsv41-convert export` in each format against `cp` of the source, per byte written, with peak RSS.

    python bench/bench_export.py /tmp/export-bench [--preset medium] [--workers 1] [--repeat N] [--keep]
                                 [--old DIR] [--shard-tp 8] [--formats bf16,fp8,...] [--src CKPT] [--warm]

1. `make-tiny WORK/pub --preset medium --no-vision` (4.79 GB, real hidden sizes, canonical fp8/fp4 values),
   or --src CKPT (a published-format checkpoint, kept);
2. for each format (bf16, fp8, fp8-fp4), alternating, each from a cold page cache for its files:
   `cp` of the source shards + sync, then `export WORK/pub WORK/out --format F` (it fsyncs every file);
   per byte written = (export s / output bytes) / (cp s / source bytes), in wall and in CPU seconds;
   after each round, `cp` of the export's own output files + sync ("cp out": the same bytes written, from
   a cold cache): where the disk's speed depends on how much is written (a write cache in front of it,
   the dirty-page limits), export s / cp out s compares like with like;
3. the quantizing direction and the round trip: `export WORK/bf16 --format fp8-fp4` (every weight
   quantized on the CPU), timed the same way, then every file compared with WORK/pub byte for byte (where
   files differ, verify/roundtrip.py lists the tensors and why);
4. with --shard-tp N, `shard WORK/pub OUT --tp N` the same way (the engine export shares), and with
   --peer CMD another converter's command in the same rounds, its rank files compared with ours;
5. prints a JSON result (machine, date, load) for docs/BENCHMARKS.md, then a compact table; deletes WORK
   unless --keep (a WORK holding files that a bench's run did not leave is refused, not emptied).

--old DIR: another checkout (a folder holding dsv41_convert/, e.g. `git archive <commit> | tar -x -C DIR`)
whose CLI is timed in the same rounds (cp, this code, the old code; the order of the two alternates from
round to round), and whose outputs must equal this code's: the sha256 of every file in the two
manifest.json files are compared (`same_bytes_as_old`). Each CLI runs as `python -P -m dsv41_convert.cli`
with PYTHONPATH set to its checkout, so no console script or virtual environment is needed.

The page cache: the source's pages are dropped before each run (posix_fadvise DONTNEED after a sync);
with BENCH_DROP_CACHES=1, run as root, the whole page cache too (bench_shard.evict). --warm reads the
source into the page cache before each run instead (the "source cached" case).
"""

from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from bench_shard import _cli, _median_run, evict, fresh_work, measure, warm  # noqa: E402

from dsv41_convert.synth.staged import MARK  # noqa: E402

FORMATS = ("bf16", "fp8", "fp8-fp4", "bf16 -> fp8-fp4")


WARM_SOURCE = False  # --warm: every run reads a source already in the page cache


def _source_ready(src: Path) -> None:
    """Before a timed run: the source's pages dropped (the default) or all read in (--warm); dirty pages
    written out either way."""
    if WARM_SOURCE:
        os.sync()
        warm(src)
    else:
        evict(src)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("model*.safetensors"))


def _cp(src: Path, work: Path) -> dict:
    dst = work / "cp"
    dst.mkdir()
    _source_ready(src)
    shards = sorted(str(p) for p in src.glob("*.safetensors"))
    run = measure(["sh", "-c", f'cp "$@" {dst} && sync', "cp", *shards])
    shutil.rmtree(dst)
    return run


def _run(code: Path, src: Path, out: Path, fmt: str, workers: str, shard_tp: int, keep_json: Path | None) -> dict:
    """One timed CLI run; its --json summary, condensed by _timeline_summary, under "timeline" (the whole
    summary kept in `keep_json` if given, one file per run)."""
    if out.exists():
        shutil.rmtree(out)
    _source_ready(src)
    if fmt.startswith("shard"):
        args = ["shard", str(src), str(out), "--tp", str(shard_tp)]
    else:
        args = ["export", str(src), str(out), "--format", fmt.split()[-1]]
    summary = out.with_name(out.name + ".summary.json")
    run = measure([*_cli(code), *args, "--workers", workers, "--json"], stdout=summary)
    data = json.loads(summary.read_text())
    if keep_json:
        keep_json.mkdir(parents=True, exist_ok=True)
        stem = f"{out.name}-{datetime.datetime.now(datetime.UTC).strftime('%H%M%S')}"
        shutil.copy(summary, keep_json / f"{stem}.json")
    summary.unlink()
    return run | {"workers": data["workers"], "timeline": _timeline_summary(data.get("timeline", []))}


def _timeline_summary(timeline: list[dict]) -> dict:
    """Where a run's time went, from the CLI's --json timeline: when the first file started (the start:
    planning, worker processes), when the last ended, how long the last worker to finish ran alone, and
    the stage seconds summed over files (per thread: they overlap)."""
    if not timeline:
        return {}
    ends: dict[int, float] = {}
    for r in timeline:
        ends[r["worker"]] = max(ends.get(r["worker"], 0.0), r["end_s"])
    last = sorted(ends.values())
    stages: dict[str, float] = {}
    for r in timeline:
        for k, v in r["stages"].items():
            stages[k] = round(stages.get(k, 0.0) + v, 2)
    return {
        "first_start_s": min(r["start_s"] for r in timeline),
        "last_end_s": last[-1],
        "alone_at_end_s": round(last[-1] - last[-2], 2) if len(last) > 1 else 0.0,
        "stages_s": stages,
    }


def _run_peer(command: str, src: Path, out: Path) -> dict:
    """A peer converter's shell command ({src} and {out} filled in), timed as our runs are; it must leave
    its files on disk (e.g. end with `&& sync`) for the times to compare."""
    if out.exists():
        shutil.rmtree(out)
    _source_ready(src)
    return measure(["sh", "-c", command.format(src=src, out=out)])


def _compare(a: Path, b: Path) -> list[str]:
    """Names of the files of `a` (shards, index, config, tokenizer) that differ in `b`; not make-tiny's mark,
    which marks a folder make-tiny wrote and is no part of the checkpoint (export does not copy it)."""
    names = [p.name for p in sorted(a.iterdir()) if p.is_file() and p.name != MARK]
    return [n for n in names if not (b / n).is_file() or not filecmp.cmp(a / n, b / n, shallow=False)]


def _file_hashes(out: Path) -> dict[str, str]:
    """file -> sha256, from the run's manifest.json."""
    return {name: f["sha256"] for name, f in json.loads((out / "manifest.json").read_text())["files"].items()}


def _row(cps: list[dict], runs: list[dict], src_bytes: int, out_bytes: int) -> dict:
    cp, ours = _median_run(cps), _median_run(runs)
    return {
        "export": ours,
        "runs_s": [r["seconds"] for r in runs],
        "cpu_s_runs": [r["cpu_s"] for r in runs],
        "vs_cp": round(ours["seconds"] / cp["seconds"], 2),
        "vs_cp_per_byte": round(ours["seconds"] / out_bytes / (cp["seconds"] / src_bytes), 2),
        # CPU seconds (user + system) per byte written: on a machine shared with other jobs the wall ratio
        # follows their load, the CPU ratio much less
        "vs_cp_cpu_per_byte": round(ours["cpu_s"] / out_bytes / (cp["cpu_s"] / src_bytes), 2),
    }


def _summary(result: dict) -> str:
    """One line per format and code: cp s, run s, per byte (wall, CPU), peak RSS."""
    head = (
        f"{'run':<22} {'code':<4} {'GB out':>7} {'cp s':>6} {'run s':>7} {'/B wall':>8} {'/B cpu':>7} "
        f"{'cp out s':>8} {'vs cp out':>9} {'RSS GiB':>8}"
    )
    lines = [f"{result['date']}  {result['machine']}  workers {result['workers']}", head]
    for fmt, row in result["formats"].items():
        for code in ("new", "old", "peer"):
            if code in row:
                r = row[code]
                lines.append(
                    f"{fmt:<22} {code:<4} {row['output_bytes'] / 1e9:>7.2f} {row['cp']['seconds']:>6.1f} "
                    f"{r['export']['seconds']:>7.1f} {r['vs_cp_per_byte']:>7.2f}x {r['vs_cp_cpu_per_byte']:>6.2f}x "
                    f"{row['cp_out']['seconds']:>8.1f} {r['vs_cp_same_bytes']:>8.2f}x "
                    f"{r['export']['peak_tree_rss_gib']:>8.2f}"
                )
        keys = ("same_bytes_as_old", "files_differing_from_pub", "rank_files_differing_from_peer")
        extra = {k: row[k] for k in keys if k in row}
        if extra:
            lines.append(f"{'':<22} {json.dumps(extra)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--workers", default="1", help="a number, or auto")
    ap.add_argument("--repeat", type=int, default=1, help="cp and export alternate this many times per format")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--old", type=Path, help="another checkout timed in the same rounds (see above)")
    ap.add_argument("--shard-tp", type=int, default=0, help="also time `shard --tp N` of the source")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of: " + ", ".join(FORMATS))
    ap.add_argument("--src", type=Path, help="a published-format checkpoint to use (kept) instead of make-tiny")
    ap.add_argument("--keep-json", type=Path, help="keep each run's --json summary (with its timeline) here")
    ap.add_argument(
        "--peer",
        help="with --shard-tp: a peer converter's shell command, {src} and {out} filled in, timed in the same "
        "rounds as `shard` and its rank files compared with ours, e.g. "
        "'python convert.py --hf-ckpt-path {src} --save-path {out} --model-parallel 8 && sync'",
    )
    ap.add_argument("--warm", action="store_true", help="source in the page cache for every run (else evicted)")
    a = ap.parse_args()
    global WARM_SOURCE
    WARM_SOURCE = a.warm
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    if unknown := set(formats) - set(FORMATS):
        raise SystemExit(f"--formats: unknown {sorted(unknown)}; choose from {FORMATS}")
    if "bf16 -> fp8-fp4" in formats and "bf16" not in formats:
        raise SystemExit("--formats: 'bf16 -> fp8-fp4' exports the bf16 export: list bf16 too")
    work = a.work
    fresh_work(work, a.src)
    codes = {"new": ROOT} | ({"old": a.old.resolve()} if a.old else {})
    pub = a.src.resolve() if a.src else work / "pub"
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB RAM, "
        f"load {os.getloadavg()[0]:.1f}",
        "preset": a.preset,
        "workers": a.workers,
        "source": "cached" if a.warm else "evicted",
        "codes": {k: str(v) for k, v in codes.items()},
        "formats": {},
    }
    runs_todo = formats + ([f"shard tp {a.shard_tp}"] if a.shard_tp else [])
    try:
        if not a.src:
            t0 = time.perf_counter()
            measure([*_cli(ROOT), "make-tiny", str(pub), "--preset", a.preset, "--no-vision"])
            result["make_tiny_s"] = round(time.perf_counter() - t0, 1)
        src_bytes = result["source_bytes"] = _bytes(pub)
        for fmt in runs_todo:
            src = work / "bf16-new" if fmt == "bf16 -> fp8-fp4" else pub
            outs = {code: work / f"{fmt.replace(' ', '').replace('->', '-to-')}-{code}" for code in codes}
            if fmt == "bf16":
                outs = {code: work / f"bf16-{code}" for code in codes}
            cps: list[dict] = []
            cps_out: list[dict] = []
            runs: dict[str, list[dict]] = {code: [] for code in codes}
            peer = a.peer if fmt.startswith("shard") else None
            if peer:
                outs["peer"], runs["peer"] = work / "shard-peer", []
            for i in range(a.repeat):
                cps.append(_cp(pub, work))
                order = list(runs) if i % 2 == 0 else list(runs)[::-1]  # alternate which code goes first
                for code in order:
                    if code == "peer":
                        runs[code].append(_run_peer(peer, src, outs[code]))
                    else:
                        runs[code].append(_run(codes[code], src, outs[code], fmt, a.workers, a.shard_tp, a.keep_json))
                cps_out.append(_cp(outs["new"], work))
            out_bytes = _bytes(outs["new"])
            row: dict = {"output_bytes": out_bytes, "cp": _median_run(cps), "cp_runs_s": [r["seconds"] for r in cps]}
            row["cp_out"] = _median_run(cps_out)
            row["cp_out_runs_s"] = [r["seconds"] for r in cps_out]
            for code in runs:
                row[code] = _row(cps, runs[code], src_bytes, out_bytes)
                row[code]["vs_cp_same_bytes"] = round(row[code]["export"]["seconds"] / row["cp_out"]["seconds"], 2)
            if "old" in codes:
                row["same_bytes_as_old"] = _file_hashes(outs["new"]) == _file_hashes(outs["old"])
            if peer:
                row["peer_command"] = peer
                row["rank_files_differing_from_peer"] = [
                    p.name for p in sorted(outs["new"].glob("model*-mp*.safetensors"))
                    if not filecmp.cmp(p, outs["peer"] / p.name, shallow=False)
                ]  # fmt: skip
            if src != pub or fmt == "fp8-fp4":  # a round trip, or a copy: the published files again
                row["files_differing_from_pub"] = _compare(pub, outs["new"])
                if row["files_differing_from_pub"]:  # which tensors, and why
                    from dsv41_convert.verify.roundtrip import compare_checkpoints

                    row["tensors_differing"] = [asdict(d) for d in compare_checkpoints(pub, outs["new"])]
            row["load_after"] = round(os.getloadavg()[0], 1)
            result["formats"][fmt] = row
            print(json.dumps({fmt: row}), file=sys.stderr, flush=True)
            for code, out in outs.items():  # the bf16 export stays: it is the next source
                if not (fmt == "bf16" and code == "new"):
                    shutil.rmtree(out, ignore_errors=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)  # never --src: it lies outside WORK
    print(json.dumps(result, indent=2))
    print(_summary(result))


if __name__ == "__main__":
    main()
