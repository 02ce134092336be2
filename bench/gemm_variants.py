"""Time block_gemm variants (tile, K tile, ping-pong, stages) against torch._scaled_mm on one CUDA GPU.

Each variant is compiled first (parallel worker processes, TileLang's disk cache), then timed as a raw
launch at the GEMM_SHAPES of bench_kernels.py with e8m0 scales per 32-wide K block (as the model runs
them); each variant's output bytes are compared with the first variant's of the same kind (with e8m0
scales every variant computes the same bytes).

Usage (on the GPU machine):  python bench/gemm_variants.py [--json out.json]
"""

import argparse
import concurrent.futures as cf
import functools
import json
import os

import torch
from bench_kernels import GEMM_SHAPES, median_ms

N, K = 4096, 7168
# (name, fp4, tile, stages, k_tile, pingpong); kt32 is one K block per stage (the previous kernel's loop)
VARIANTS = (
    ("fp8 kt32 wide", False, (128, 128, 256), 4, 32, False),
    ("fp8 kt128 wide", False, (128, 128, 256), 4, 128, False),
    ("fp8 kt128 pp wide", False, (128, 128, 256), 4, 128, True),
    ("fp8 kt128 pp wide s3", False, (128, 128, 256), 3, 128, True),
    ("fp8 kt128 pp wide s5", False, (128, 128, 256), 5, 128, True),
    ("fp8 kt128 pp 64x128", False, (64, 128, 128), 4, 128, True),
    ("fp8 kt128 pp 64x128 s6", False, (64, 128, 128), 6, 128, True),
    ("fp8 kt128 pp narrow", False, (64, 64, 128), 4, 128, True),
    ("fp8 kt128 pp narrow s6", False, (64, 64, 128), 6, 128, True),
    ("fp4 kt128 wide", True, (128, 128, 256), 3, 128, False),
    ("fp4 kt128 pp wide", True, (128, 128, 256), 3, 128, True),
    ("fp4 kt128 pp wide s4", True, (128, 128, 256), 4, 128, True),
    ("fp4 kt128 pp 64x128", True, (64, 128, 128), 4, 128, True),
    ("fp4 kt128 pp narrow", True, (64, 64, 128), 4, 128, True),
    ("fp4 kt128 pp 64x64x256", True, (64, 64, 256), 4, 128, True),
)


def kernel(fp4, tile, stages, k_tile, pingpong):
    from dsv41_convert.kernels.block_gemm import block_gemm_kernel

    b_rows = 1 if fp4 else 32
    return block_gemm_kernel(N, K, 32, 32, b_rows, fp4, True, True, stages, tile, True, k_tile, pingpong)


def _compile(v):
    try:
        kernel(*v[1:])
        return v[0], None
    except Exception as exc:  # a variant that does not compile is a result to report
        return v[0], f"{type(exc).__name__}: {exc}"[:300]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="", help="comma-separated substrings of variant names")
    args = parser.parse_args()
    wanted = [v for v in VARIANTS if not args.only or any(s in v[0] for s in args.only.split(","))]
    with cf.ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        failed = dict((name, err) for name, err in pool.map(_compile, wanted) if err)
    for name, err in failed.items():
        print(f"{name}: compile failed: {err}")
    from dsv41_convert.kernels import quant_ops
    from dsv41_convert.quant import act, fp8

    u8 = torch.uint8
    rows = []
    for m, n, k in GEMM_SHAPES:
        assert (n, k) == (N, K)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
        a, a_s = act.act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)
        b, b_s = fp8.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
        b4, b4_s = quant_ops.encode_mxfp4(w, 32, "w")
        flop = 2 * m * n * k
        one = torch.ones((), device="cuda")
        t_sm = median_ms(
            functools.partial(torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        )
        print(f"M={m}: _scaled_mm {flop / t_sm / 1e9:.0f} TFLOP/s", flush=True)
        first = {}
        for name, fp4, *rest in wanted:
            if name in failed:
                continue
            kern = kernel(fp4, *rest)
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ops = (a, a_s.view(u8), b4.view(u8), b4_s.view(u8), c) if fp4 else (a, a_s.view(u8), b, b_s.view(u8), c)
            kern(*ops)
            outs = [c.clone()]
            t = median_ms(functools.partial(kern, *ops))
            kern(*ops)
            outs.append(c.clone())
            same_run = bool(torch.equal(outs[0], outs[1]))
            ref = first.setdefault(fp4, outs[0])
            same = bool(torch.equal(outs[0], ref))
            row = {"M": m, "variant": name, "ms": t, "TFLOPs": flop / t / 1e9, "pct_scaled_mm": 100 * t_sm / t}
            row |= {"same_as_first": same, "same_run_to_run": same_run}
            rows.append(row)
            print(
                f"M={m:5d} {name:26s} {row['TFLOPs']:6.0f} TFLOP/s {row['pct_scaled_mm']:5.1f}% of _scaled_mm"
                f" same={'y' if same else 'N'}{'y' if same_run else 'N'}",
                flush=True,
            )
        rows.append({"M": m, "variant": "_scaled_mm", "ms": t_sm, "TFLOPs": flop / t_sm / 1e9})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
