"""fp4_gemm's two routes against fp8_gemm and torch._scaled_mm on one GPU, by rows (issue 19 goal 2).

For each (M, N, K): the fp4 kernel alone (fp4_gemm below VIA_FP8_ROWS), the route through fp8 (the
cast into the weight shape's workspace, `fp4_to_fp8.cast_into`, plus the fp8 kernel: fp4_gemm from
VIA_FP8_ROWS rows, the weight known after its first call), the cast alone (`cast_unchecked`, which
allocates its outputs),
fp8_gemm on the same weight encoded as 32x32 fp8, and per-tensor fp8 torch._scaled_mm (cuBLAS), all
timed in the same run, the wrappers as the model calls them, two ways: "synced" (median of 20 single
calls between CUDA events, each waited for: the host's time per call counts) and "queued" (50 calls back
to back between two events, the host running ahead as in a forward pass). Checks that both fp4 routes
give the same bytes. Shapes: bench_kernels.GEMM_SHAPES' N x K and V4.1-Flash's expert
projections (w1/w3 [2304, 5120], w2 [5120, 2304]).

Usage (on the GPU machine):  python bench/fp4_route.py [--json out.json]
"""

import argparse
import functools
import json

import torch
from bench_kernels import median_ms, queued_ms
from needs_cuda import require_cuda

ROWS = (16, 64, 128, 256, 512, 1024, 2048, 4096)
NK = ((4096, 7168), (2304, 5120), (5120, 2304))


def fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random [n, k] bf16 weight on the GPU and its 32x32 fp8 encoding: -> (w, b, b_s)."""
    from dsv41_convert.quant import fp8

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    return (w, *fp8.encode_fp8_blocks(w, (32, 32), "ue8m0", "w"))


def fp8_and_fp4_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One random [n, k] weight as 32x32 fp8 and as MXFP4 (packed, e8m0 per 32): -> (b, b_s, b4, b4_s)."""
    from dsv41_convert.kernels import quant_ops

    w, b, b_s = fp8_weight(n, k, g)
    return (b, b_s, *quant_ops.encode_mxfp4(w, 32, "w"))


def fp8_rows(m: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random activations [m, k] quantized as the model does (e4m3, e8m0 per 32): -> (a, a_s)."""
    from dsv41_convert.quant import act

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    return act.act_quant(x, 32, "ue8m0", torch.float8_e8m0fnu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    require_cuda()
    from dsv41_convert.kernels import fp4_gemm as fp4_mod
    from dsv41_convert.kernels.fp4_to_fp8 import cast_unchecked
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm

    e8 = torch.float8_e8m0fnu
    rows = []
    for n, k in NK:
        g = torch.Generator(device="cuda").manual_seed(0)
        b, b_s, b4, b4_s = fp8_and_fp4_weight(n, k, g)
        t_cast = queued_ms(functools.partial(cast_unchecked, b4, b4_s))
        for m in ROWS:
            a, a_s = fp8_rows(m, k, g)
            flop = 2 * m * n * k
            one = torch.ones((), device="cuda")
            sm = functools.partial(torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            fp4_mod.VIA_FP8_ROWS = 1 << 30
            direct = fp4_mod.fp4_gemm(a, a_s, b4, b4_s, e8, 32)
            fp4_mod.VIA_FP8_ROWS = 1
            routed = fp4_mod.fp4_gemm(a, a_s, b4, b4_s, e8, 32)
            same = bool(torch.equal(direct.view(torch.int16), routed.view(torch.int16)))
            routes = fp4_mod._route_as_fp8(b4, b4_s) is not None  # False: "via fp8" timed the fp4 kernel
            row = {"M": m, "N": n, "K": k, "same_bytes": same, "routed": routes, "cast_ms": t_cast}
            for how, timer in (("synced", median_ms), ("queued", queued_ms)):
                times = {"scaled_mm": timer(sm), "fp8_gemm": timer(functools.partial(fp8_gemm, a, a_s, b, b_s, e8, 32))}
                fp4_mod.VIA_FP8_ROWS = 1 << 30
                times["fp4_direct"] = timer(functools.partial(fp4_mod.fp4_gemm, a, a_s, b4, b4_s, e8, 32))
                fp4_mod.VIA_FP8_ROWS = 1
                times["fp4_via_fp8"] = timer(functools.partial(fp4_mod.fp4_gemm, a, a_s, b4, b4_s, e8, 32))
                times["scaled_mm_again"] = timer(sm)
                row[how] = {name: flop / t / 1e9 for name, t in times.items()}
                r = row[how]
                print(
                    f"{how} {m:5d}x{n}x{k}: _scaled_mm {r['scaled_mm']:5.0f}/{r['scaled_mm_again']:5.0f}"
                    f"  fp8 {r['fp8_gemm']:5.0f}  fp4 direct {r['fp4_direct']:5.0f}"
                    f"  fp4 via fp8 {r['fp4_via_fp8']:5.0f} TFLOP/s (cast alone {t_cast * 1e3:.1f} us queued)"
                    f"  same bytes {same}, routed {routes}",
                    flush=True,
                )
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
