"""Kernel benchmarks on one CUDA GPU: effective bandwidth of the quantization kernels, gemm rates.

For each quantization kernel: bytes read + written per call over the median time, against
  - a device-to-device copy that reads and writes the same number of bytes (the ceiling),
  - the quant/ torch reference run eagerly on the GPU, and compiled with torch.compile (--compile).
For the gemms: TFLOP/s against torch._scaled_mm (per-tensor fp8, cuBLAS) and a bf16 matmul.

Usage (on the GPU machine):  python bench/bench_kernels.py [--compile] [--json out.json] [--md out.md]
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

import torch

ROWS, COLS = 65536, 7168  # a 940 MB bf16 weight: ~0.3 ms per pass, launch costs small, far past L2
GEMM_SHAPES = ((128, 4096, 7168), (4096, 4096, 7168))  # (M, N, K)
# torch.compile takes tens of seconds per function: only these are compiled (device time is scarce)
COMPILED = ("encode_fp8_blocks 32x32 ue8m0", "encode_mxfp4", "act_quant 1x32")


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


def _compile_one(job):
    module, factory, args = job
    import importlib

    getattr(importlib.import_module(module), factory)(*args)
    return job


def compile_jobs():
    k = "dsv41_convert.kernels."
    return [
        (k + "fp8_quant", "fp8_quant_kernel", (COLS, 32, 32, "bfloat16", True)),
        (k + "fp8_quant", "fp8_quant_kernel", (COLS, 128, 128, "bfloat16", True)),
        (k + "fp8_quant", "fp8_quant_kernel", (COLS, 128, 128, "bfloat16", False)),
        (k + "act_quant", "act_quant_kernel", (COLS, 32, "bfloat16", True, True, False)),
        (k + "fp4_act_quant", "fp4_act_quant_kernel", (COLS, 32, "bfloat16", False, False)),
        (k + "fp8_dequant", "fp8_dequant_kernel", (COLS, 32, 32, True, "bfloat16")),
        (k + "fp4_dequant", "fp4_dequant_kernel", (COLS, 32, "bfloat16")),
        (k + "fp4_to_fp8", "fp4_to_fp8_kernel", (COLS,)),
        (k + "fp4_to_fp8", "fp4_to_fp8_kernel", (COLS, 1)),
        (k + "fp8_gemm", "fp8_gemm_kernel", (4096, 7168, 32, True)),
        (k + "fp4_gemm", "fp4_gemm_kernel", (4096, 7168, 32, True)),
        (k + "act_quant", "act_quant_kernel", (COLS, 32, "bfloat16", True, True, False, 8)),
        (k + "fp4_act_quant", "fp4_act_quant_kernel", (COLS, 32, "bfloat16", False, False, 8)),
    ]


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


def quant_rows():
    from dsv41_convert.kernels import quant_ops
    from dsv41_convert.quant import act, cast, fp4, fp8

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
        ("fp4_to_fp8", quant_ops.fp4_to_fp8, cast.fp4_to_fp8, (p4, s4, 32, "w")),
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
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = median_ms(functools.partial(dst.copy_, src))
        del src, dst
        t_kern = median_ms(raw[name])
        t_wrap = median_ms(functools.partial(wrapper, *args))
        try:
            t_eager = median_ms(functools.partial(ref, *args), reps=5, warm=1)
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
            }
        )
        print(rows[-1], flush=True)
    return rows, cases


def variant_rows():
    """Raw kernel time of the row-group kernels at unroll 4 (default) and 8: bytes in flight per thread."""
    from dsv41_convert.kernels import act_quant, fp4_act_quant, fp4_to_fp8, quant_ops

    w = torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16)
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    q = torch.empty(ROWS, COLS, dtype=torch.float8_e4m3fn, device="cuda")
    packed = torch.empty(ROWS, COLS // 2, dtype=torch.uint8, device="cuda")
    s = torch.empty(ROWS, COLS // 32, dtype=torch.uint8, device="cuda")
    out = []
    p4, s4 = (t.view(torch.uint8) for t in quant_ops.encode_mxfp4(w, 32, "w"))
    s8 = torch.empty(-(-ROWS // 32), COLS // 32, dtype=torch.uint8, device="cuda")
    for block_rows in (1, 2):
        fn = functools.partial(fp4_to_fp8.fp4_to_fp8_kernel(COLS, block_rows), p4, s4, q.view(torch.uint8), s8, cnt)
        t = median_ms(fn)
        out.append({"kernel": "fp4_to_fp8", "block_rows": block_rows, "ms": t, "GBps": nbytes(p4, s4, q, s8) / t / 1e6})
        print(out[-1], flush=True)
    for unroll in (4, 8):
        k8 = act_quant.act_quant_kernel(COLS, 32, "bfloat16", True, True, False, unroll)
        k4 = fp4_act_quant.fp4_act_quant_kernel(COLS, 32, "bfloat16", False, False, unroll)
        for name, fn, moved in (
            ("act_quant", functools.partial(k8, w, q, s, cnt), nbytes(w, q, s)),
            ("fp4_act_quant", functools.partial(k4, w, packed, s, cnt), nbytes(w, packed, s)),
        ):
            t = median_ms(fn)
            out.append({"kernel": name, "unroll": unroll, "ms": t, "GBps": moved / t / 1e6})
            print(out[-1], flush=True)
    return out


def compile_phase(rows, cases):
    """torch.compile of the references named in COMPILED (slow to compile: run last)."""
    for row, (name, _kern, ref, args) in zip(rows, cases, strict=True):
        if name not in COMPILED:
            continue
        try:
            comp = torch.compile(ref)
            t_comp = median_ms(functools.partial(comp, *args), reps=5, warm=2)
            row["compile_GBps"] = row["MB"] * 1e6 / t_comp / 1e6
        except Exception as exc:  # a compile failure is a result to report, not a crash
            print(f"torch.compile failed for {name}: {type(exc).__name__}: {exc}"[:300])
        print(row, flush=True)


def gemm_rows():
    from dsv41_convert.kernels import quant_ops
    from dsv41_convert.kernels.fp4_gemm import fp4_gemm
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm
    from dsv41_convert.quant import act, fp8

    rows = []
    for m, n, k in GEMM_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        a, a_s = act.act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
        b, b_s = fp8.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
        b4, b4_s = quant_ops.encode_mxfp4(w, 32, "w")
        one = torch.ones((), device="cuda")
        flop = 2 * m * n * k
        t8 = median_ms(functools.partial(fp8_gemm, a, a_s, b, b_s, torch.float8_e8m0fnu, 32))
        t4 = median_ms(functools.partial(fp4_gemm, a, a_s, b4, b4_s, torch.float8_e8m0fnu, 32))
        try:
            t_sm = median_ms(
                functools.partial(torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            )
        except Exception as exc:
            print(f"_scaled_mm failed: {exc}"[:300])
            t_sm = float("nan")
        t_bf = median_ms(functools.partial(torch.matmul, x, w.t()))
        row = {"M": m, "N": n, "K": k}
        for name, t in (("fp8_gemm", t8), ("fp4_gemm", t4), ("_scaled_mm_tensorwise", t_sm), ("bf16_matmul", t_bf)):
            row[name + "_ms"] = t
            row[name + "_TFLOPs"] = flop / t / 1e9
        rows.append(row)
        print(row, flush=True)
    return rows


def markdown(quant, gemm, device, when):
    lines = [f"Measured {when} on {device}, torch {torch.__version__}; median of 20 runs (eager/compile: 5).", ""]
    lines += [
        "| kernel | MB moved | kernel ms | kernel GB/s | copy GB/s | % of copy | wrapper GB/s "
        "| torch eager GB/s | torch.compile GB/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in quant:
        comp = "-" if r["compile_GBps"] is None else f"{r['compile_GBps']:.0f}"
        lines.append(
            f"| {r['kernel']} | {r['MB']:.0f} | {r['kernel_ms']:.3f} | {r['kernel_GBps']:.0f} | {r['copy_GBps']:.0f} "
            f"| {r['pct_of_copy']:.0f}% | {r['wrapper_GBps']:.0f} | {r['eager_GBps']:.0f} | {comp} |"
        )
    lines += [
        "",
        "| M x N x K | fp8_gemm TFLOP/s | fp4_gemm TFLOP/s | _scaled_mm (tensorwise) TFLOP/s | bf16 matmul TFLOP/s |",
    ]
    lines += ["| --- | ---: | ---: | ---: | ---: |"]
    for r in gemm:
        lines.append(
            f"| {r['M']} x {r['N']} x {r['K']} | {r['fp8_gemm_TFLOPs']:.0f} | {r['fp4_gemm_TFLOPs']:.0f} "
            f"| {r['_scaled_mm_tensorwise_TFLOPs']:.0f} | {r['bf16_matmul_TFLOPs']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the references")
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args()
    with cf.ProcessPoolExecutor(args.workers) as pool:
        list(pool.map(_compile_one, compile_jobs()))
    device = f"{torch.cuda.get_device_name()} ({platform.node()})"
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    quant, cases = quant_rows()
    gemm = gemm_rows()
    variants = variant_rows()
    if args.json:
        with open(args.json.replace(".json", "_variants.json"), "w") as f:
            json.dump(variants, f, indent=1)
    write(quant, gemm, device, when, args)
    if args.compile:
        compile_phase(quant, cases)
        write(quant, gemm, device, when, args)


def write(quant, gemm, device, when, args):
    md = markdown(quant, gemm, device, when)
    print(md, flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "when": when, "quant": quant, "gemm": gemm}, f, indent=1)


if __name__ == "__main__":
    main()
