"""Manual warp-specialised GEMM prototypes (bench/gemm_ws_kernel.py) against fp8_gemm, fp4_gemm and
torch._scaled_mm, by rows (issue 19 goal 2).

For each (M, N, K): the variants' raw launches, checked for the package kernels' bytes (fp8 variants
against fp8_gemm, fp4 ones against fp4_gemm) and for the same bytes run to run, then timed beside
_scaled_mm (per-tensor fp8, cuBLAS), fp8_gemm and fp4_gemm (the wrappers as the model calls them; fp4_gemm
goes through the cast and the fp8 kernel): "queued" (50 calls between two CUDA events: GPU time per call)
and "synced" (median of 20 single calls, each waited for; the raw launches skip the wrappers' host time).
Weights from one random bf16 matrix, quantized as 32x32 fp8 and as MXFP4 (every fp4 weight here casts
exactly; the fp4 variants take the cast's block scales).

Usage, on the GPU machine (one process per variant, so that a hang names itself): bash bench/gemm_ws.sh
  python bench/gemm_ws.py [--variants a,b] [--json out.json] [--compile-only]
On any machine with nvcc (no GPU): python bench/gemm_ws.py --ptxas [--variants ...]  (ptxas's report of
each variant for sm_90a: registers, spills, and C7514 where it serializes the wgmmas)
"""

import argparse
import concurrent.futures
import functools
import json
import tempfile
from pathlib import Path

from needs_cuda import require_cuda

VARIANTS = {
    "fp8ws128": dict(fp4=False, tile=(128, 128), stages=4),
    "fp8ws64": dict(fp4=False, tile=(64, 64), stages=4),
    "fp8ws128cross": dict(fp4=False, tile=(128, 128), stages=4, cross=True),
    "fp4ws64": dict(fp4=True, tile=(64, 64), stages=4, nreg=(240, 240)),
    "fp4ws64p2": dict(fp4=True, tile=(64, 64), stages=4, producers=2, nreg=(128, 240)),
    "fp4ws64p2s6": dict(fp4=True, tile=(64, 64), stages=6, producers=2, nreg=(128, 240)),
    "fp4ws128": dict(fp4=True, tile=(128, 128), stages=3, nreg=(40, 232)),
    "fp8ws128x32": dict(fp4=False, tile=(128, 32), stages=6, nreg=(40, 232)),
    "fp8ws128x64": dict(fp4=False, tile=(128, 64), stages=6, nreg=(40, 232)),
    "fp8ws64x32": dict(fp4=False, tile=(64, 32), stages=6),
    "fp4ws128x32": dict(fp4=True, tile=(128, 32), stages=6, nreg=(72, 200)),
    "fp4ws128x64": dict(fp4=True, tile=(128, 64), stages=6, nreg=(72, 200)),
    "fp4ws64x32": dict(fp4=True, tile=(64, 32), stages=6, nreg=(240, 240)),
}
TIMED = [name for name in VARIANTS if not name.endswith("cross")]  # cross: serialized by ptxas, not timed
ROWS = (16, 64, 128, 256, 512, 4096)
NK = ((4096, 7168), (2304, 5120))


def ptxas(names: list[str]) -> None:
    """Lower each variant for sm_90a on this machine and print ptxas's report (no GPU needed)."""
    import tilelang
    from gemm_sass import nvcc_cubin
    from gemm_ws_kernel import ws_gemm

    for name in names:
        src = tilelang.compile(
            ws_gemm.get_tir(*NK[0], **VARIANTS[name]),
            target={"kind": "cuda", "arch": "sm_90a"},
            pass_configs=ws_gemm.pass_configs,
        ).get_kernel_source()
        with tempfile.TemporaryDirectory() as tmp:
            report = nvcc_cubin(src, Path(tmp)).splitlines()
        keep = [line.strip() for line in report if any(word in line for word in ("C7514", "Used", "spill"))]
        print(f"{name}: " + " | ".join(keep))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(TIMED))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M, comma-separated")
    parser.add_argument("--json")
    parser.add_argument("--compile-only", action="store_true", help="compile every kernel (into the disk cache)")
    parser.add_argument("--ptxas", action="store_true", help="ptxas's report of each variant (CPU, nvcc)")
    args = parser.parse_args()
    require_cuda()
    names = args.variants.split(",")
    if args.ptxas:
        return ptxas(names)
    import torch
    from bench_kernels import median_ms
    from fp4_route import queued_ms
    from gemm_ws_kernel import ws_gemm

    from dsv41_convert.kernels import quant_ops
    from dsv41_convert.kernels.block_gemm import launcher
    from dsv41_convert.kernels.fp4_gemm import fp4_gemm
    from dsv41_convert.kernels.fp4_to_fp8 import cast_unchecked
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm
    from dsv41_convert.quant import act, fp8

    e8 = torch.float8_e8m0fnu
    rows = []
    for n, k in NK:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            kernels = {name: pool.submit(ws_gemm, n, k, **VARIANTS[name]) for name in names}
            kernels = {name: launcher(job.result()) for name, job in kernels.items()}
        g = torch.Generator(device="cuda").manual_seed(0)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
        b, b_s = fp8.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
        b4, b4_s = quant_ops.encode_mxfp4(w, 32, "w")
        _, s8, lossy = cast_unchecked(b4, b4_s)
        assert not int(lossy.item()), "the fp4 weight must cast exactly"
        b_s_u8, b4_u8, b4_s_u8, s8_u8 = (t.view(torch.uint8) for t in (b_s, b4, b4_s, s8))
        unused = torch.zeros(n, k // 32, dtype=torch.uint8, device="cuda")
        for m in (16,) if args.compile_only else [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            a, a_s = act.act_quant(x, 32, "ue8m0", e8)
            one = torch.ones((), device="cuda")
            calls = {
                "scaled_mm": functools.partial(
                    torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                ),
                "fp8_gemm": functools.partial(fp8_gemm, a, a_s, b, b_s, e8, 32),
                "fp4_gemm": functools.partial(fp4_gemm, a, a_s, b4, b4_s, e8, 32),
            }
            want = {False: calls["fp8_gemm"](), True: calls["fp4_gemm"]()}
            if args.compile_only:
                print(f"{n}x{k}: compiled {sorted(kernels)} and the package's kernels", flush=True)
                continue
            row = {"M": m, "N": n, "K": k, "same_bytes": {}, "run_to_run": {}, "queued": {}, "synced": {}}
            for name, launch in kernels.items():
                fp4 = VARIANTS[name]["fp4"]
                operands = (
                    (a, a_s.view(torch.uint8), b4_u8, s8_u8, b4_s_u8)
                    if fp4
                    else (a, a_s.view(torch.uint8), b, b_s_u8, unused)
                )

                def call(launch=launch, operands=operands, m=m, n=n):
                    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                    launch(*operands, c)
                    return c

                first, second = call(), call()
                row["same_bytes"][name] = bool(torch.equal(first.view(torch.int16), want[fp4].view(torch.int16)))
                row["run_to_run"][name] = bool(torch.equal(first.view(torch.int16), second.view(torch.int16)))
                calls[name] = call
            flop = 2 * m * n * k
            for how, timer in (("queued", queued_ms), ("synced", median_ms)):
                row[how] = {name: flop / timer(fn) / 1e9 for name, fn in calls.items()}
            print(f"{m:5d}x{n}x{k} queued TFLOP/s: " + "  ".join(f"{nm} {v:.0f}" for nm, v in row["queued"].items()))
            print(f"      same bytes {row['same_bytes']}, run to run {row['run_to_run']}", flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
