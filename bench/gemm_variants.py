"""Time block_gemm variants (tile, stages, matmuls in flight, scale hoist) against torch._scaled_mm on one GPU.

Each variant is compiled first (parallel worker processes, TileLang's disk cache), then timed as a raw
launch at the GEMM_SHAPES of bench_kernels.py with e8m0 scales per 32-wide K block (as the model runs
them); each variant's output bytes are compared with the first variant's of the same kind (with e8m0
scales every variant computes the same bytes) and with its own second run. Then the wrappers: the
previous one (checks, views and TileLang's call per call, `old_wrapper`), the current fp8_gemm /
fp4_gemm, and their kernels' raw launches.

Usage (on the GPU machine):  python bench/gemm_variants.py [--json out.json] [--only SUBSTR,...] [--rows M,...]
                             [--no-wrappers]
"""

import argparse
import concurrent.futures as cf
import functools
import json
import os

import torch
from bench_kernels import GEMM_SHAPES, median_ms
from needs_cuda import require_cuda

N, K = 4096, 7168
OLD = {"scale_tma": False, "depth": 2, "scale_lut": False}  # main 8554f92's kernel
NO_LUT = {"scale_lut": False}
OLD_TILES = {False: ((64, 64, 128), (64, 128, 128)), True: ((64, 64, 256), (128, 128, 256))}  # fp4 -> wrapper tiles


def old_pick(m: int, n: int, sms: int, tiles: tuple) -> tuple:
    """8554f92's rule: the second tile once its CTAs cover every SM."""
    few, many = tiles
    return many if -(-m // many[0]) * -(-n // many[1]) >= sms else few


# (name, fp4, tile, stages, block_gemm_kernel keywords); "old" rows are main 8554f92's kernels
VARIANTS = (
    ("fp8 old 64x64", False, (64, 64, 128), 4, OLD),
    ("fp8 old 64x128", False, (64, 128, 128), 4, OLD),
    ("fp8 old 128x128", False, (128, 128, 256), 4, OLD),
    ("fp8 64x64 tma", False, (64, 64, 128), 4, NO_LUT),
    ("fp8 64x64 tma d3", False, (64, 64, 128), 4, {"depth": 3} | NO_LUT),
    ("fp8 64x64 tma d3 lut", False, (64, 64, 128), 4, {"depth": 3}),
    ("fp8 64x64 tma d4 lut", False, (64, 64, 128), 4, {"depth": 4}),
    ("fp8 64x64 tma d3 s6 lut", False, (64, 64, 128), 6, {"depth": 3}),
    ("fp8 64x128 tma lut", False, (64, 128, 128), 4, {}),
    ("fp8 128x128 tma", False, (128, 128, 256), 4, NO_LUT),
    ("fp8 128x128 tma lut", False, (128, 128, 256), 4, {}),
    ("fp8 128x128 tma s3 lut", False, (128, 128, 256), 3, {}),
    ("fp8 128x64 tma d4 lut", False, (128, 64, 256), 4, {"depth": 4}),
    ("fp4 old 64x64/2wg", True, (64, 64, 256), 3, OLD),
    ("fp4 old 128x128", True, (128, 128, 256), 3, OLD),
    ("fp4 64x64/2wg tma", True, (64, 64, 256), 3, NO_LUT),
    ("fp4 64x64/2wg tma lut", True, (64, 64, 256), 3, {}),
    ("fp4 64x64/2wg tma d3 lut", True, (64, 64, 256), 3, {"depth": 3}),
    ("fp4 64x64/2wg tma d4 lut", True, (64, 64, 256), 3, {"depth": 4}),
    ("fp4 64x64 tma d4 lut", True, (64, 64, 128), 4, {"depth": 4}),
    ("fp4 128x128 tma", True, (128, 128, 256), 3, NO_LUT),
    ("fp4 128x128 tma lut", True, (128, 128, 256), 3, {}),
    ("fp4 128x128 tma s4 lut", True, (128, 128, 256), 4, {}),
)


def kernel(fp4, tile, stages, kw):
    from dsv41_convert.kernels.block_gemm import block_gemm_kernel

    b_rows = 1 if fp4 else 32
    return block_gemm_kernel(N, K, 32, 32, b_rows, fp4, True, True, stages, tile, **kw)


def _compile(v):
    try:
        kernel(*v[1:])
        return v[0], None
    except Exception as exc:  # a variant that does not compile is a result to report
        return v[0], f"{type(exc).__name__}: {exc}"[:300]


def old_wrapper(kern, a, a_s, b, b_s):
    """The per-call work of fp8_gemm / fp4_gemm at main 8554f92: shape and dtype checks, contiguous views,
    the output, TileLang's Python call path."""
    k, n = a.size(-1), b.size(0)
    if a.dtype != torch.float8_e4m3fn or not a.is_cuda or b.size(1) not in (k, k // 2):
        raise ValueError("bad operands")
    m = a.numel() // k
    if a_s.numel() != m * (k // 32) or b_s.size(1) != k // 32 or a_s.dtype != b_s.dtype:
        raise ValueError("bad scales")
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    kern(
        a.contiguous().view(m, k),
        a_s.contiguous().view(torch.uint8).view(m, -1),
        b.contiguous().view(torch.uint8) if b.dtype != torch.float8_e4m3fn else b.contiguous(),
        b_s.contiguous().view(torch.uint8),
        c,
    )
    return c.view(*a.shape[:-1], n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default="", help="comma-separated substrings of variant names")
    parser.add_argument("--no-wrappers", action="store_true", help="time the variants only")
    parser.add_argument("--rows", default="", help="comma-separated M values (default: bench_kernels.GEMM_SHAPES)")
    args = parser.parse_args()
    require_cuda()
    shapes = [(int(m), N, K) for m in args.rows.split(",")] if args.rows else GEMM_SHAPES
    wanted = [v for v in VARIANTS if not args.only or any(s in v[0] for s in args.only.split(","))]
    with cf.ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        failed = dict((name, err) for name, err in pool.map(_compile, wanted) if err)
    for name, err in failed.items():
        print(f"{name}: compile failed: {err}")
    from dsv41_convert.kernels import quant_ops
    from dsv41_convert.kernels.block_gemm import FP4_TILES, FP8_TILES, _sm_count, launcher, pick_tile
    from dsv41_convert.kernels.fp4_gemm import fp4_gemm, fp4_gemm_kernel
    from dsv41_convert.kernels.fp8_gemm import fp8_gemm, fp8_gemm_kernel
    from dsv41_convert.quant import act, fp8

    u8, e8 = torch.uint8, torch.float8_e8m0fnu
    rows = []
    for m, n, k in shapes:
        assert (n, k) == (N, K)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
        a, a_s = act.act_quant(x, 32, "ue8m0", e8)
        b, b_s = fp8.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
        b4, b4_s = quant_ops.encode_mxfp4(w, 32, "w")
        flop = 2 * m * n * k
        one = torch.ones((), device="cuda")
        t_sm = median_ms(
            functools.partial(torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        )
        print(f"M={m}: _scaled_mm {flop / t_sm / 1e9:.0f} TFLOP/s", flush=True)

        def record(name, t, same=True, same_run=True, m=m, flop=flop, t_sm=t_sm):
            row = {"M": m, "variant": name, "ms": t, "TFLOPs": flop / t / 1e9, "pct_scaled_mm": 100 * t_sm / t}
            row |= {"same_as_first": same, "same_run_to_run": same_run}
            rows.append(row)
            print(
                f"M={m:5d} {name:28s} {row['TFLOPs']:6.0f} TFLOP/s {row['pct_scaled_mm']:5.1f}% of _scaled_mm"
                f" same={'y' if same else 'N'}{'y' if same_run else 'N'}",
                flush=True,
            )

        first = {}
        for name, fp4, *rest in wanted:
            if name in failed:
                continue
            kern = launcher(kernel(fp4, *rest))
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            ops = (a, a_s.view(u8), b4.view(u8), b4_s.view(u8), c) if fp4 else (a, a_s.view(u8), b, b_s.view(u8), c)
            kern(*ops)
            outs = [c.clone()]
            t = median_ms(functools.partial(kern, *ops))
            kern(*ops)
            outs.append(c.clone())
            ref = first.setdefault(fp4, outs[0])
            record(name, t, bool(torch.equal(outs[0], ref)), bool(torch.equal(outs[0], outs[1])))
        # the wrappers: previous per-call path, current one, and the raw launch of the tile they pick
        for fp4 in () if args.no_wrappers else (False, True):
            bb, bs = (b4, b4_s) if fp4 else (b, b_s)
            tiles = FP4_TILES if fp4 else FP8_TILES
            tile = pick_tile(m, n, a.device, tiles)
            new = (fp4_gemm_kernel if fp4 else fp8_gemm_kernel)(n, k, 32, True, tile)
            wrap = fp4_gemm if fp4 else fp8_gemm
            want = wrap(a, a_s, bb, bs, e8, 32)
            tag = "fp4" if fp4 else "fp8"
            old_tile = old_pick(m, n, _sm_count(0), OLD_TILES[fp4])
            old = kernel(fp4, old_tile, 3 if fp4 else 4, OLD)
            t_old = median_ms(functools.partial(old_wrapper, old, a, a_s, bb, bs))
            record(
                f"{tag} old wrapper {old_tile[0]}x{old_tile[1]}",
                t_old,
                bool(torch.equal(old_wrapper(old, a, a_s, bb, bs), want)),
            )
            t_new = median_ms(functools.partial(wrap, a, a_s, bb, bs, e8, 32))
            record(f"{tag} {wrap.__name__} (new wrapper)", t_new, bool(torch.equal(wrap(a, a_s, bb, bs, e8, 32), want)))
            c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            run = launcher(new)
            ops = (a, a_s.view(u8), bb.view(u8) if fp4 else bb, bs.view(u8), c)
            t_raw = median_ms(functools.partial(run, *ops))
            record(f"{tag} raw launch of its kernel", t_raw, bool(torch.equal(c, want)))
        rows.append({"M": m, "variant": "_scaled_mm", "ms": t_sm, "TFLOPs": flop / t_sm / 1e9})
        t_again = median_ms(
            functools.partial(torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        )
        rows.append({"M": m, "variant": "_scaled_mm again", "ms": t_again, "TFLOPs": flop / t_again / 1e9})
        print(f"M={m}: _scaled_mm again {flop / t_again / 1e9:.0f} TFLOP/s (first {flop / t_sm / 1e9:.0f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
