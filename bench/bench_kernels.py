"""Kernel benchmarks on one CUDA GPU: effective bandwidth of the quantization kernels, gemm rates.

For each quantization kernel: bytes read + written per call over the median time, against
  - a device-to-device copy that reads and writes the same number of bytes (the ceiling),
  - the quant/ torch reference run eagerly on the GPU, and compiled with torch.compile (--compile).
For the gemms: TFLOP/s against torch._scaled_mm (per-tensor fp8, cuBLAS) and a bf16 matmul.

Usage (on the GPU machine):  python bench/bench_kernels.py [--compile] [--gemm-only] [--json out.json] [--md out.md]
Kernels are compiled first in parallel worker processes (TileLang's disk cache), then timed.
"""

import argparse
import concurrent.futures as cf
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
from types import SimpleNamespace

import torch
from needs_cuda import require_cuda

ROWS, COLS = 65536, 7168  # a 940 MB bf16 weight: ~0.3 ms per pass, launch costs small, far past L2
GEMM_SHAPES = ((128, 4096, 7168), (4096, 4096, 7168))  # (M, N, K)
# gemm tiles timed as raw launches (rows, columns, threads); the wrappers pick from block_gemm.FP8_TILES
# and FP4_TILES by M
GEMM_TILES = {"64x64": (64, 64, 128), "64x64/2wg": (64, 64, 256), "64x128": (64, 128, 128), "128x128": (128, 128, 256)}
# torch.compile takes tens of seconds per function: only these are compiled (device time is scarce)
COMPILED = ("encode_fp8_blocks 32x32 ue8m0", "encode_mxfp4", "act_quant 1x32")
# launch-geometry variants timed by variant_rows (the first of each is the default)
DEQUANT_VARIANTS = ((4, 4), (4, 8))  # decode_mxfp4: (packed bytes per thread and slot, slots per thread)
FP8_DEQUANT_VARIANTS = ((8, 2), (8, 4), (8, 1), (16, 2))  # decode_fp8_blocks: (e4m3 values per slot, slots per thread)
FP4_ENCODE_VARIANTS = ((2, 128), (2, 256), (1, 128))  # encode_mxfp4: (slots per thread, threads)
FP4_TO_FP8_VARIANTS = ((1, 64), (2, 16), (1, 32))  # fp4_to_fp8: (32-row blocks per CTA, threads per row)


def median_ms(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def queued_ms(fn, reps=50, warm=3):
    """GPU time per call of `reps` calls queued back to back."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graphed_ms(fn, calls: int = 50, replays: int = 5) -> float:
    """GPU time per call of `calls` calls of fn captured in one CUDA graph (median of `replays` replays)."""
    fn()  # kernels compiled and loaded, workspaces made, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm on the capture's stream too (the route binds its workspace per stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _compile_one(job):
    module, factory, args = job
    import importlib

    getattr(importlib.import_module(module), factory)(*args)
    return job


def compile_jobs(gemm_only=False):
    k = "dsv41_convert.kernels."
    bg = (k + "block_gemm", "block_gemm_kernel")
    gemm = []
    for tile in GEMM_TILES.values():
        gemm += [(*bg, (4096, 7168, 32, 32, 32, False, True, True, 4, tile))]  # fp8_gemm
        gemm += [(*bg, (4096, 7168, 32, 32, 1, True, True, True, 3, tile))]  # fp4_gemm
    if gemm_only:
        return gemm
    jobs = [
        (k + "fp8_quant", "fp8_quant_kernel", (COLS, 32, 32, "bfloat16", True)),
        (k + "fp8_quant", "fp8_quant_kernel", (COLS, 128, 128, "bfloat16", True)),
        (k + "fp8_quant", "fp8_quant_kernel", (COLS, 128, 128, "bfloat16", False)),
        (k + "act_quant", "act_quant_kernel", (COLS, 32, "bfloat16", True, True, False)),
        (k + "fp4_act_quant", "fp4_act_quant_kernel", (COLS, 32, "bfloat16", False, False)),
        (k + "fp8_dequant", "fp8_dequant_kernel", (COLS, 32, 32, True, "bfloat16")),
        (k + "fp4_dequant", "fp4_dequant_kernel", (COLS, 32, "bfloat16")),
        (k + "fp4_to_fp8", "fp4_to_fp8_kernel", (COLS,)),
    ]
    jobs += gemm
    rq = (k + "row_quant", "row_quant_kernel")
    jobs += [(*rq, (COLS, 32, "bfloat16", "e2m1", "e8m0", False, u, t)) for u, t in FP4_ENCODE_VARIANTS]
    jobs += [(k + "fp4_to_fp8", "fp4_to_fp8_kernel", (COLS, b, t)) for b, t in FP4_TO_FP8_VARIANTS]
    jobs += [
        (k + "fp8_dequant", "fp8_dequant_kernel", (COLS, 32, 32, True, "bfloat16", u, v))
        for v, u in FP8_DEQUANT_VARIANTS
    ]
    jobs += [(k + "fp4_dequant", "fp4_dequant_kernel", (COLS, 32, "bfloat16", u, v)) for v, u in DEQUANT_VARIANTS]
    return jobs


def nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts)


def raw_launches(w, q8, s8, p4, s4):
    """name -> a call of the compiled kernel alone on preallocated outputs (no checks, no sync)."""
    from dsv41_convert.kernels import act_quant, fp4_act_quant, fp4_dequant, fp4_to_fp8, fp8_dequant, fp8_quant

    dev, rows, cols = w.device, w.size(0), w.size(1)
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=dev)
    y = torch.empty(rows, cols, dtype=torch.bfloat16, device=dev)

    def blocks(b, dtype):
        return torch.empty(-(-rows // b), -(-cols // b), dtype=dtype, device=dev)

    u8, f32 = torch.uint8, torch.float32
    s_row = torch.empty(rows, cols // 32, dtype=u8, device=dev)
    packed = torch.empty(rows, cols // 2, dtype=u8, device=dev)
    p4u, s4u = p4.view(u8), s4.view(u8)
    return {
        "encode_fp8_blocks 32x32 ue8m0": functools.partial(
            fp8_quant.fp8_quant_kernel(cols, 32, 32, "bfloat16", True), w, q, blocks(32, u8), cnt
        ),
        "encode_fp8_blocks 128x128 ue8m0": functools.partial(
            fp8_quant.fp8_quant_kernel(cols, 128, 128, "bfloat16", True), w, q, blocks(128, u8), cnt
        ),
        "encode_fp8_blocks 128x128 fp32": functools.partial(
            fp8_quant.fp8_quant_kernel(cols, 128, 128, "bfloat16", False), w, q, blocks(128, f32), cnt
        ),
        "encode_fp8_blocks 1x32 ue8m0": functools.partial(
            act_quant.act_quant_kernel(cols, 32, "bfloat16", True, True, False), w, q, s_row, cnt
        ),
        "encode_mxfp4": functools.partial(
            fp4_act_quant.fp4_act_quant_kernel(cols, 32, "bfloat16", False, False), w, packed, s_row, cnt
        ),
        "fp4_to_fp8": functools.partial(fp4_to_fp8.fp4_to_fp8_kernel(cols), p4u, s4u, q.view(u8), blocks(32, u8), cnt),
        "decode_fp8_blocks 32x32": functools.partial(
            fp8_dequant.fp8_dequant_kernel(cols, 32, 32, True, "bfloat16"), q8, s8.view(u8), y
        ),
        "decode_mxfp4": functools.partial(fp4_dequant.fp4_dequant_kernel(cols, 32, "bfloat16"), p4u, s4u, y),
        "act_quant 1x32": functools.partial(
            act_quant.act_quant_kernel(cols, 32, "bfloat16", True, True, False), w, q, s_row, cnt
        ),
        "fp4_act_quant 1x32": functools.partial(
            fp4_act_quant.fp4_act_quant_kernel(cols, 32, "bfloat16", False, False), w, packed, s_row, cnt
        ),
    }


def references_on_cuda():
    """quant/'s lookup tables are CPU tensors, which torch.bucketize and indexing refuse to mix with CUDA
    inputs; the eager and compiled references in this process get CUDA copies (bench only)."""
    from dsv41_convert.quant import act, cast, fp4, fp8

    for module in (act, cast, fp4, fp8):
        for name, value in vars(module).copy().items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                setattr(module, name, value.cuda())


def quant_rows():
    from dsv41_convert.kernels import quant_ops
    from dsv41_convert.quant import act, cast, fp4, fp8

    references_on_cuda()

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(ROWS, COLS, device="cuda", generator=g, dtype=torch.bfloat16)
    q8, s8 = quant_ops.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
    p4, s4 = quant_ops.encode_mxfp4(w, 32, "w")
    raw = raw_launches(w, q8, s8, p4, s4)
    cases = [
        (
            "encode_fp8_blocks 32x32 ue8m0",
            quant_ops.encode_fp8_blocks,
            fp8.encode_fp8_blocks,
            (w, (32, 32), "ue8m0", "w"),
        ),
        (
            "encode_fp8_blocks 128x128 ue8m0",
            quant_ops.encode_fp8_blocks,
            fp8.encode_fp8_blocks,
            (w, (128, 128), "ue8m0", "w"),
        ),
        (
            "encode_fp8_blocks 128x128 fp32",
            quant_ops.encode_fp8_blocks,
            fp8.encode_fp8_blocks,
            (w, (128, 128), None, "w"),
        ),
        (
            "encode_fp8_blocks 1x32 ue8m0",
            quant_ops.encode_fp8_blocks,
            fp8.encode_fp8_blocks,
            (w, (1, 32), "ue8m0", "w"),
        ),
        ("encode_mxfp4", quant_ops.encode_mxfp4, fp4.encode_mxfp4, (w, 32, "w")),
        ("fp4_to_fp8", quant_ops.fp4_to_fp8, on_the_cpu(cast.fp4_to_fp8), (p4, s4, 32, "w")),
        ("decode_fp8_blocks 32x32", quant_ops.decode_fp8_blocks, fp8.decode_fp8_blocks, (q8, s8, (32, 32))),
        ("decode_mxfp4", quant_ops.decode_mxfp4, fp4.decode_mxfp4, (p4, s4, 32)),
        ("act_quant 1x32", quant_ops.act_quant, act.act_quant, (w,)),
        ("fp4_act_quant 1x32", quant_ops.fp4_act_quant, act.fp4_act_quant, (w,)),
    ]
    rows = []
    for name, wrapper, ref, args in cases:
        out = wrapper(*args)
        outs = out if isinstance(out, tuple) else (out,)
        ins = [a for a in args if isinstance(a, torch.Tensor)]
        moved = nbytes(*ins, *outs)
        del out, outs
        t_copy = copy_ms(moved)
        t_kern = median_ms(raw[name])
        t_wrap = median_ms(functools.partial(wrapper, *args))
        same = None
        try:
            t_eager = median_ms(functools.partial(ref, *args), reps=5, warm=1)
            want = ref(*args)
            want = want if isinstance(want, tuple) else (want,)
            got = wrapper(*args)
            got = got if isinstance(got, tuple) else (got,)
            same = all(
                bool(torch.equal(g.view(torch.uint8), r.view(torch.uint8))) for g, r in zip(got, want, strict=True)
            )
            del want, got
        except Exception as exc:  # a reference that cannot run on CUDA is a result to report
            print(f"eager reference failed for {name}: {type(exc).__name__}: {exc}"[:300])
            t_eager = float("nan")
        rows.append(
            {
                "kernel": name,
                "MB": moved / 1e6,
                "kernel_ms": t_kern,
                "kernel_GBps": moved / t_kern / 1e6,
                "copy_GBps": moved / t_copy / 1e6,
                "pct_of_copy": 100 * t_copy / t_kern,
                "wrapper_GBps": moved / t_wrap / 1e6,
                "eager_GBps": moved / t_eager / 1e6,
                "compile_GBps": None,
                "bitexact_vs_eager": same,
            }
        )
        print(rows[-1], flush=True)
    return rows, cases


def on_the_cpu(ref):
    """A CPU-only reference (quant.cast's numpy byte tables) run on copies of the CUDA arguments, its outputs moved
    back: its bytes compared, its "eager" time the CPU's with both copies (its call on CUDA tensors raised, and the
    bench compared nothing: session 49's round)."""

    def run(*args):
        out = ref(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
        return tuple(t.cuda() for t in out) if isinstance(out, tuple) else out.cuda()

    return run


def copy_ms(moved):
    """Median time of a device-to-device copy that reads and writes `moved` bytes in all."""
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = median_ms(functools.partial(dst.copy_, src))
    del src, dst
    return t


def variant_rows():
    """Raw kernel time of launch-geometry variants (bytes in flight per thread), as % of a copy."""
    from dsv41_convert.kernels import fp4_dequant, fp4_to_fp8, fp8_dequant, quant_ops, row_quant

    w = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    q = torch.empty(ROWS, COLS, dtype=torch.float8_e4m3fn, device="cuda")
    y = torch.empty(ROWS, COLS, dtype=torch.bfloat16, device="cuda")
    packed = torch.empty(ROWS, COLS // 2, dtype=torch.uint8, device="cuda")
    s = torch.empty(ROWS, COLS // 32, dtype=torch.uint8, device="cuda")
    p4, s4 = (t.view(torch.uint8) for t in quant_ops.encode_mxfp4(w, 32, "w"))
    q8, s8e = quant_ops.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
    s8 = torch.empty(-(-ROWS // 32), COLS // 32, dtype=torch.uint8, device="cuda")
    cases = []
    for block_rows, row_threads in FP4_TO_FP8_VARIANTS:
        k = fp4_to_fp8.fp4_to_fp8_kernel(COLS, block_rows, row_threads)
        fn = functools.partial(k, p4, s4, q.view(torch.uint8), s8, cnt)
        cases.append(("fp4_to_fp8", f"block_rows={block_rows} row_threads={row_threads}", fn, (p4, s4, q, s8)))
    for unroll, threads in FP4_ENCODE_VARIANTS:
        k4 = row_quant.row_quant_kernel(COLS, 32, "bfloat16", "e2m1", "e8m0", False, unroll, threads)
        fn = functools.partial(k4, w, packed, s, cnt)
        cases.append(("encode_mxfp4", f"unroll={unroll} threads={threads}", fn, (w, packed, s)))
    for vec, unroll in FP8_DEQUANT_VARIANTS:
        kd8 = fp8_dequant.fp8_dequant_kernel(COLS, 32, 32, True, "bfloat16", unroll, vec)
        fn = functools.partial(kd8, q8, s8e.view(torch.uint8), y)
        cases.append(("decode_fp8_blocks", f"vec={vec} unroll={unroll}", fn, (q8, s8e, y)))
    for vec, unroll in DEQUANT_VARIANTS:
        kd4 = fp4_dequant.fp4_dequant_kernel(COLS, 32, "bfloat16", unroll, vec)
        cases.append(("decode_mxfp4", f"vec={vec} unroll={unroll}", functools.partial(kd4, p4, s4, y), (p4, s4, y)))
    out = []
    for name, variant, fn, tensors in cases:
        moved = nbytes(*tensors)
        t, tc = median_ms(fn), copy_ms(moved)
        out.append({"kernel": name, "variant": variant, "ms": t, "GBps": moved / t / 1e6, "pct_of_copy": 100 * tc / t})
        print(out[-1], flush=True)
    return out


def compile_phase(rows, cases, every=False):
    """torch.compile of the references named in COMPILED, or of all (slow to compile: run last)."""
    for row, (name, _kern, ref, args) in zip(rows, cases, strict=True):
        if name not in COMPILED and not every:
            continue
        try:
            comp = torch.compile(ref)
            t_comp = median_ms(functools.partial(comp, *args), reps=5, warm=2)
            row["compile_GBps"] = row["MB"] * 1e6 / t_comp / 1e6
        except Exception as exc:  # a compile failure is a result to report, not a crash
            print(f"torch.compile failed for {name}: {type(exc).__name__}: {exc}"[:300])
        print(row, flush=True)


def gemm_operands(m: int, n: int, k: int) -> SimpleNamespace:
    """Random operands of one GEMM shape: x [m, k] and w [n, k] bf16; a [m, k] e4m3 with a_s [m, k / 32] e8m0
    (act_quant 1x32); b [n, k] e4m3 with b_s [n / 32, k / 32] e8m0 (32x32 blocks); b4 [n, k / 2] e2m1 pairs
    with b4_s [n, k / 32] e8m0 (mxfp4)."""
    from dsv41_convert.kernels import quant_ops
    from dsv41_convert.quant import act, fp8

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    a, a_s = act.act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
    b, b_s = fp8.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
    b4, b4_s = quant_ops.encode_mxfp4(w, 32, "w")
    return SimpleNamespace(x=x, w=w, a=a, a_s=a_s, b=b, b_s=b_s, b4=b4, b4_s=b4_s)


def gemm_calls(o: SimpleNamespace) -> dict[str, functools.partial]:
    """name -> one call of that GEMM on gemm_operands `o`: ours (fp8_gemm, fp4_gemm), cuBLAS's fp8 (_scaled_mm,
    one tensorwise scale) and bf16 (matmul)."""
    from dsv41_convert.kernels.fp4_gemm import fp4_gemm
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm

    one = torch.ones((), device="cuda")
    return {
        "fp8_gemm": functools.partial(fp8_gemm, o.a, o.a_s, o.b, o.b_s, torch.float8_e8m0fnu, 32),
        "fp4_gemm": functools.partial(fp4_gemm, o.a, o.a_s, o.b4, o.b4_s, torch.float8_e8m0fnu, 32),
        "_scaled_mm": functools.partial(
            torch._scaled_mm, o.a, o.b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        ),
        "bf16_matmul": functools.partial(torch.matmul, o.x, o.w.t()),
    }


def gemm_rows():
    from dsv41_convert.kernels.block_gemm import block_gemm_kernel

    rows = []
    for m, n, k in GEMM_SHAPES:
        o = gemm_operands(m, n, k)
        a, a_s, b, b_s, b4, b4_s = o.a, o.a_s, o.b, o.b_s, o.b4, o.b4_s
        calls = gemm_calls(o)
        flop = 2 * m * n * k
        t8 = median_ms(calls["fp8_gemm"])
        t4 = median_ms(calls["fp4_gemm"])
        # each tile as a raw launch; with e8m0 scales every tile computes the same bytes
        u8 = torch.uint8
        c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        want8, want4 = calls["fp8_gemm"](), calls["fp4_gemm"]()
        tiles, same = {}, True
        for tname, tile in GEMM_TILES.items():
            k8 = block_gemm_kernel(n, k, 32, 32, 32, False, True, True, 4, tile)
            k4 = block_gemm_kernel(n, k, 32, 32, 1, True, True, True, 3, tile)
            tiles[tname] = (
                flop / median_ms(functools.partial(k8, a, a_s.view(u8), b, b_s.view(u8), c)) / 1e9,
                flop / median_ms(functools.partial(k4, a, a_s.view(u8), b4.view(u8), b4_s.view(u8), c)) / 1e9,
            )
            k8(a, a_s.view(u8), b, b_s.view(u8), c)
            same &= bool(torch.equal(c, want8))
            k4(a, a_s.view(u8), b4.view(u8), b4_s.view(u8), c)
            same &= bool(torch.equal(c, want4))
        try:
            t_sm = median_ms(calls["_scaled_mm"])
        except Exception as exc:
            print(f"_scaled_mm failed: {exc}"[:300])
            t_sm = float("nan")
        t_bf = median_ms(calls["bf16_matmul"])
        row = {"M": m, "N": n, "K": k, "tiles_same_bytes": same, "tiles_TFLOPs": tiles}
        # back to back, as the model calls them: the host's time before a launch overlaps the kernel before it
        queued = ("fp8_gemm", "fp4_gemm") + (("_scaled_mm",) if t_sm == t_sm else ())
        row["queued_TFLOPs"] = {name: flop / queued_ms(calls[name]) / 1e9 for name in queued}
        # the same calls in one CUDA graph: the GPU's time alone (a queued cuBLAS call at 128 rows is the host's pace:
        # docs/BENCHMARKS.md, "GEMMs with the host taken out"); goal 2's figures
        row["graphed_TFLOPs"] = {}
        for name in row["queued_TFLOPs"]:
            try:
                row["graphed_TFLOPs"][name] = flop / graphed_ms(calls[name]) / 1e9
            except Exception as exc:  # a call that cannot be captured: said, not timed
                print(f"{name} not graphed: {exc}"[:300])
        times = (("fp8_gemm", t8), ("fp4_gemm", t4))
        for name, t in (*times, ("_scaled_mm_tensorwise", t_sm), ("bf16_matmul", t_bf)):
            row[name + "_ms"] = t
            row[name + "_TFLOPs"] = flop / t / 1e9
        rows.append(row)
        print(row, flush=True)
    return rows


def _rates(row: dict, key: str) -> str:
    """One shape's TFLOP/s of row[key] (name -> TFLOP/s), with fp8_gemm's share of _scaled_mm's where both ran."""
    rates = row[key]
    ratio = f" (fp8_gemm / _scaled_mm {100 * rates['fp8_gemm'] / sm:.0f}%)" if (sm := rates.get("_scaled_mm")) else ""
    return f"{row['M']} x {row['N']} x {row['K']}: " + ", ".join(f"{n} {t:.0f}" for n, t in rates.items()) + ratio


def markdown(quant, gemm, device, when, variants=()):
    lines = [f"Measured {when} on {device}, torch {torch.__version__}; median of 20 runs (eager/compile: 5).", ""]
    lines += (
        []
        if not quant
        else [
            "| kernel | MB moved | kernel ms | kernel GB/s | copy GB/s | % of copy | wrapper GB/s "
            "| torch eager GB/s | torch.compile GB/s | bytes == eager |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
        ]
    )
    for r in quant:
        comp = "-" if r["compile_GBps"] is None else f"{r['compile_GBps']:.0f}"
        lines.append(
            f"| {r['kernel']} | {r['MB']:.0f} | {r['kernel_ms']:.3f} | {r['kernel_GBps']:.0f} | {r['copy_GBps']:.0f} "
            f"| {r['pct_of_copy']:.0f}% | {r['wrapper_GBps']:.0f} | {r['eager_GBps']:.0f} | {comp} "
            f"| {dict(((True, 'yes'), (False, 'NO'))).get(r['bitexact_vs_eager'], '-')} |"
        )
    lines += [
        "",
        "| M x N x K | fp8_gemm TFLOP/s | fp4_gemm TFLOP/s | fp8 / fp4 per tile (" + ", ".join(GEMM_TILES) + ") "
        "| _scaled_mm (tensorwise) TFLOP/s | fp8_gemm / _scaled_mm | bf16 matmul TFLOP/s |",
    ]
    lines += ["| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key, said in (
        ("queued_TFLOPs", "Queued (50 calls back to back between two events, as the model calls them)"),
        ("graphed_TFLOPs", "Graphed (the same 50 calls in one CUDA graph: the GPU's time alone; goal 2's figures)"),
    ):
        if rows := [r for r in gemm if r.get(key)]:
            lines[-2:-2] = [f"{said}, TFLOP/s: " + "; ".join(_rates(r, key) for r in rows), ""]
    for r in gemm:
        per_tile = ", ".join(f"{t8:.0f} / {t4:.0f}" for t8, t4 in r["tiles_TFLOPs"].values())
        lines.append(
            f"| {r['M']} x {r['N']} x {r['K']} | {r['fp8_gemm_TFLOPs']:.0f} | {r['fp4_gemm_TFLOPs']:.0f} "
            f"| {per_tile} ({'same bytes' if r['tiles_same_bytes'] else 'bytes DIFFER'}) "
            f"| {r['_scaled_mm_tensorwise_TFLOPs']:.0f} "
            f"| {100 * r['fp8_gemm_TFLOPs'] / r['_scaled_mm_tensorwise_TFLOPs']:.0f}% | {r['bf16_matmul_TFLOPs']:.0f} |"
        )
    if variants:
        lines += ["", "| variant | kernel ms | GB/s | % of copy |", "| --- | ---: | ---: | ---: |"]
        for r in variants:
            lines.append(
                f"| {r['kernel']} {r['variant']} | {r['ms']:.3f} | {r['GBps']:.0f} | {r['pct_of_copy']:.0f}% |"
            )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the references")
    parser.add_argument("--compile-all", action="store_true", help="torch.compile every reference, not only COMPILED")
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    parser.add_argument("--gemm-only", action="store_true", help="only the gemm table")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args()
    require_cuda()
    with cf.ProcessPoolExecutor(args.workers) as pool:
        list(pool.map(_compile_one, compile_jobs(args.gemm_only)))
    try:
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(smi, capture_output=True, text=True, check=True).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        driver = "?"
    import tilelang

    device = f"{torch.cuda.get_device_name()} ({platform.node()}), driver {driver}, tilelang {tilelang.__version__}"
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    quant, cases = ([], []) if args.gemm_only else quant_rows()
    gemm = gemm_rows()
    variants = [] if args.gemm_only else variant_rows()
    if args.json:
        with open(args.json.replace(".json", "_variants.json"), "w") as f:
            json.dump(variants, f, indent=1)
    write(quant, gemm, device, when, args, variants)
    if args.compile:
        compile_phase(quant, cases, args.compile_all)
        write(quant, gemm, device, when, args, variants)


def write(quant, gemm, device, when, args, variants):
    md = markdown(quant, gemm, device, when, variants)
    print(md, flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "when": when, "quant": quant, "gemm": gemm}, f, indent=1)


if __name__ == "__main__":
    main()
