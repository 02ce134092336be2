"""fp8 x fp8 with 32x32 block scales through an exact bf16 widening and cuBLAS, against fp8_gemm (issue 19 goal 2).

A V4.1 fp8 operand is e4m3 codes times power-of-two (e8m0) scales per 32 along K, and every such value is
exact in bf16 (3 mantissa bits, the scale only moves the exponent). So a @ b^T can also run as a bf16 GEMM of
the widened operands with fp32 accumulation and no per-32 promotion: fewer instructions per tensor-core
cycle, at half the fp8 tensor-core rate and with the widening's extra bytes. This bench times, in one
process per shape:

  scaled_mm     torch._scaled_mm, per-tensor scales (the goal's yardstick; not the same math)
  fp8_gemm      the package's kernel (per-32 promotion)
  bf16_mm       torch.matmul of the operands already widened (the route's ceiling)
  route_cached  widen a, matmul with b widened once (a weight kept in bf16: twice the bytes)
  route         widen a and b, matmul (nothing kept)
  fused_cached  widen a with the package's dequant kernel (kernels/fp8_dequant.py, 1 x 32 blocks), b kept
  fused         widen a and b with that kernel, matmul

and the error of fp8_gemm and of the route against kernels/ref.py (max |diff| and how many outputs differ
from the reference's bf16 bytes). Queued TFLOP/s (50 calls between two CUDA events).

Usage (on the GPU machine, tilelang on the path):  python bench/gemm_bf16_route.py [--json out.json]
"""

import argparse
import functools
import json

import torch
from fp4_route import fp8_rows, fp8_weight, queued_ms
from needs_cuda import require_cuda

ROWS = (128, 512, 1024, 2048, 4096)
NK = ((4096, 7168), (2304, 5120), (5120, 2304), (7168, 2048))


def widen_rows(a: torch.Tensor, a_s: torch.Tensor, block: int = 32) -> torch.Tensor:
    """[M, K] e4m3 codes times [M, K/block] e8m0 scales -> [M, K] bf16, exact (normal range)."""
    s = a_s.to(torch.bfloat16).repeat_interleave(block, dim=1)
    return a.to(torch.bfloat16) * s


def against_ref(fn, want: torch.Tensor) -> dict:
    """How fn()'s bf16 result differs from the reference's, and whether a second call gives its bytes again."""
    got = fn()
    return {
        "max_abs": float((got.float() - want.float()).abs().max()),
        "max_ref": float(want.float().abs().max()),
        "bytes_differ": int((got.view(torch.int16) != want.view(torch.int16)).sum()),
        "run_to_run_same": bool(torch.equal(got.view(torch.int16), fn().view(torch.int16))),
    }


def one_weight(n: int, k: int) -> list[dict]:
    """Every ROWS count against one random [n, k] weight: the rates and the errors, printed and returned."""
    from dsv41_convert.kernels import ref
    from dsv41_convert.kernels.fp8_dequant import decode_fp8_blocks
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm

    e8 = torch.float8_e8m0fnu
    g = torch.Generator(device="cuda").manual_seed(0)
    _, b, b_s = fp8_weight(n, k, g)
    b16 = decode_fp8_blocks(b, b_s)
    one = torch.ones((), device="cuda")
    out = []
    for m in ROWS:
        a, a_s = fp8_rows(m, k, g)
        a16 = widen_rows(a, a_s)
        exact = bool(torch.equal(a16.float(), a.float() * a_s.float().repeat_interleave(32, dim=1)))
        exact = exact and bool(torch.equal(decode_fp8_blocks(a, a_s, (1, 32)), a16))

        def route(cached: bool, a=a, a_s=a_s) -> torch.Tensor:
            return torch.matmul(widen_rows(a, a_s), (b16 if cached else decode_fp8_blocks(b, b_s)).t())

        def fused(cached: bool, a=a, a_s=a_s) -> torch.Tensor:
            return torch.matmul(decode_fp8_blocks(a, a_s, (1, 32)), (b16 if cached else decode_fp8_blocks(b, b_s)).t())

        fns = {
            "scaled_mm": functools.partial(
                torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
            ),
            "fp8_gemm": functools.partial(fp8_gemm, a, a_s, b, b_s, e8, 32),
            "bf16_mm": functools.partial(torch.matmul, a16, b16.t()),
            "route_cached": functools.partial(route, True),
            "route": functools.partial(route, False),
            "fused_cached": functools.partial(fused, True),
            "fused": functools.partial(fused, False),
        }
        want = ref.fp8_gemm(a, a_s, b, b_s, e8, 32)
        errs = {name: against_ref(fns[name], want) for name in ("fp8_gemm", "route", "fused")}
        rate = {name: 2 * m * n * k / queued_ms(fn) / 1e9 for name, fn in fns.items()}
        out.append({"M": m, "N": n, "K": k, "widening_exact": exact, "tflops": rate, "vs_ref": errs})
        print(
            f"{m:5d}x{n}x{k}: "
            + "  ".join(f"{name} {r:5.0f}" for name, r in rate.items())
            + f"  | fp8_gemm/_scaled_mm {rate['fp8_gemm'] / rate['scaled_mm']:.0%}"
            f" route/_scaled_mm {rate['route'] / rate['scaled_mm']:.0%}"
            f" | exact widening {exact}; vs ref: "
            + "; ".join(
                f"{nm} max {e['max_abs']:.3g} of {e['max_ref']:.3g}, {e['bytes_differ']} differ,"
                f" run-to-run same {e['run_to_run_same']}"
                for nm, e in errs.items()
            ),
            flush=True,
        )
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    require_cuda()
    rows = [row for n, k in NK for row in one_weight(n, k)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
