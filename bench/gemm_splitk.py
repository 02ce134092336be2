"""Split-K for few rows: the fp8 block gemm with K cut into `splits` ranges, one CTA each, against fp8_gemm and
torch._scaled_mm on one GPU (issue 19 goal 2 at 128 rows).

At 128 x 4096 x 7168 fp8_gemm's 64 x 64 tile gives 128 CTAs, one wave on 132 SMs, each walking 224 K blocks
of 32 in turn (a matmul and a promotion each): the kernel waits on that chain, not on memory (~0.9 TB/s of
weight). With splits, each CTA walks 224 / splits blocks into a float32 partial ([splits, M, N]), and the
partials are added in split order (torch), then rounded to bf16: deterministic, and within one bf16 ulp of
fp8_gemm's bytes (float32 sums in another order). Times: queued GPU time per call (the kernel alone, and the
kernel plus the sum); bytes: outputs differing from fp8_gemm's and the largest difference in bf16 ulps.

Usage (GPU):  python bench/gemm_splitk.py [--rows 16,64,128,256,512] [--json out.json]
"""

import argparse
import concurrent.futures as cf
import functools
import json
import os

import torch
from bench_kernels import queued_ms
from needs_cuda import require_cuda

N, K = 4096, 7168
TILES = {(64, 64, 128): 3, (64, 128, 128): 2}  # tile -> matmuls in flight (fp8_gemm's)
SPLITS = (1, 2, 4, 7)


def kernel(tile, splits):
    from dsv41_convert.kernels.block_gemm import block_gemm_kernel

    return block_gemm_kernel(N, K, 32, 32, 32, False, True, True, 4, tile, depth=TILES[tile], splits=splits)


def _compile(job):
    try:
        kernel(*job)
        return job, None
    except Exception as exc:
        return job, f"{type(exc).__name__}: {exc}"[:400]


def ulps(x: torch.Tensor, y: torch.Tensor) -> int:
    """Largest distance in bf16 steps between same-signed finite values (int16 bit patterns)."""
    a, b = x.view(torch.int16).int(), y.view(torch.int16).int()
    return int((a - b).abs().max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64,128,256,512,1024")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    require_cuda()
    jobs = [(t, s) for t in TILES for s in SPLITS if s > 1]
    with cf.ProcessPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        failed = {job: err for job, err in pool.map(_compile, jobs) if err}
    for job, err in failed.items():
        print(f"{job}: compile failed: {err}", flush=True)
    from dsv41_convert.kernels.block_gemm import launcher
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm
    from dsv41_convert.quant import act, fp8

    u8, e8 = torch.uint8, torch.float8_e8m0fnu
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
        a, a_s = act.act_quant(x, 32, "ue8m0", e8)
        b, b_s = fp8.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
        flop = 2 * m * N * K
        one = torch.ones((), device="cuda")
        t_sm = queued_ms(
            functools.partial(torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        )
        want = fp8_gemm(a, a_s, b, b_s, e8, 32)
        t_ref = queued_ms(functools.partial(fp8_gemm, a, a_s, b, b_s, e8, 32))
        base = {"M": m, "scaled_mm_TFLOPs": flop / t_sm / 1e9, "fp8_gemm_TFLOPs": flop / t_ref / 1e9}
        print(
            f"M={m}: _scaled_mm {base['scaled_mm_TFLOPs']:.0f}, fp8_gemm {base['fp8_gemm_TFLOPs']:.0f} TFLOP/s",
            flush=True,
        )
        rows.append(base | {"variant": "fp8_gemm"})
        for tile, splits in jobs:
            if (tile, splits) in failed:
                continue
            run = launcher(kernel(tile, splits))
            ws = torch.empty(splits, m, N, dtype=torch.float32, device="cuda")
            ops = (a, a_s.view(u8), b, b_s.view(u8), ws)

            def whole(run=run, ops=ops, ws=ws):
                run(*ops)
                return ws.sum(0).to(torch.bfloat16)

            got = whole()
            again = whole()
            t_k = queued_ms(functools.partial(run, *ops))
            t_all = queued_ms(whole)
            row = base | {
                "variant": f"{tile[0]}x{tile[1]} splits {splits}",
                "kernel_TFLOPs": flop / t_k / 1e9,
                "with_sum_TFLOPs": flop / t_all / 1e9,
                "pct_scaled_mm": 100 * t_sm / t_all,
                "differ": int((got != want).sum()),
                "max_ulps": ulps(got, want),
                "same_run_to_run": bool(torch.equal(got, again)),
            }
            rows.append(row)
            print(
                f"M={m:5d} {row['variant']:22s} kernel {flop / t_k / 1e9:5.0f} with sum {flop / t_all / 1e9:5.0f}"
                f" TFLOP/s ({row['pct_scaled_mm']:5.1f}% of _scaled_mm) differ {row['differ']}"
                f" max {row['max_ulps']} ulp same-run {row['same_run_to_run']}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
