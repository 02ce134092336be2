"""Host time against GPU time per call of fp8_gemm and fp4_gemm at few rows (issue 19 goal 2): which one
paces the expert GEMMs of the MoE, where each expert sees few rows.

For each N x K of fp4_route.NK and each of ROWS rows, per call of:

  fp8_gemm     the wrapper, weight in 32 x 32 fp8 blocks
  fp4_gemm     the wrapper, packed MXFP4 weight (the route: cast into the workspace, then the fp8 kernel)
  cast         the cast's raw launch into fp4_gemm's workspace (`fp4_to_fp8.cast_into`), as the route runs it
  fp8 raw      the raw launch of the fp8 kernel fp8_gemm picks

"host us": the time the host takes to issue one call while the GPU is held busy (`torch.cuda._sleep`), so
nothing waits on the GPU; "queued us": GPU time per call of CALLS calls queued back to back (fp4_route.queued_ms).
Where host us >= queued us the host paces the call.

Usage (on the GPU machine):  python bench/gemm_host.py [--json out.json]
"""

import argparse
import functools
import json
import time

import torch
from fp4_route import NK, fp8_and_fp4_weight, fp8_rows, queued_ms
from needs_cuda import require_cuda

ROWS = (16, 64, 128, 256)
CALLS = 200


def host_us(fn, calls: int = CALLS) -> float:
    """Host time per call of fn, issued while the GPU sleeps (the queue is not drained meanwhile)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU cycles: longer than the calls take to issue
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return host * 1e6


def cases():
    """For every N x K of NK and row count of ROWS, the same operands every run (one generator per N x K):
    -> (m, n, k, (b, b_s, b4, b4_s), (a, a_s)); the weight as fp8_and_fp4_weight, the rows as fp8_rows."""
    for n, k in NK:
        g = torch.Generator(device="cuda").manual_seed(0)
        weight = fp8_and_fp4_weight(n, k, g)
        for m in ROWS:
            yield m, n, k, weight, fp8_rows(m, k, g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    require_cuda()
    from dsv41_convert.kernels import fp4_gemm as fp4_mod
    from dsv41_convert.kernels import fp8_gemm as fp8_mod
    from dsv41_convert.kernels.block_gemm import FP8_TILES, launcher, pick_tile
    from dsv41_convert.kernels.fp4_to_fp8 import cast_into

    e8 = torch.float8_e8m0fnu
    out = []
    for m, n, k, (b, b_s, b4, b4_s), (a, a_s) in cases():
        fp4_mod.fp4_gemm(a, a_s, b4, b4_s, e8, 32)  # the weight becomes known to the route
        ws = fp4_mod._workspace(n, k, a.device)
        counter = torch.zeros(1, dtype=torch.int32, device="cuda")
        kernel = fp8_mod.kernels(n, k, 32, True)[pick_tile(m, n, a.device, FP8_TILES)]
        c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        u8 = torch.uint8
        fns = {
            "fp8_gemm": functools.partial(fp8_mod.fp8_gemm, a, a_s, b, b_s, e8, 32),
            "fp4_gemm": functools.partial(fp4_mod.fp4_gemm, a, a_s, b4, b4_s, e8, 32),
            "cast": functools.partial(cast_into, b4.view(u8), b4_s.view(u8), ws.w8_bytes, ws.s8, counter),
            "fp8 raw": functools.partial(launcher(kernel), a, a_s.view(u8), b, b_s.view(u8), c),
        }
        row = {"M": m, "N": n, "K": k}
        for name, fn in fns.items():
            row[name] = {"host_us": host_us(fn), "queued_us": queued_ms(fn, reps=CALLS) * 1e3}
        out.append(row)
        print(
            f"{m:4d} x {n} x {k}: "
            + "  ".join(f"{nm} host {row[nm]['host_us']:5.1f} / GPU {row[nm]['queued_us']:6.1f} us" for nm in fns),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
