"""The block gemm's tiles per wrapper (block_gemm.FP8_TILES, FP4_TILES) by rows: what pick_tile should take.

For each N x K of fp4_route.NK and each row count of ROWS, times every tile as a raw launch of the wrapper's
kernel (`fp8_gemm.fp8_gemm_kernel(n, k, 32, True, tile)`: e4m3 weights in 32 x 32 blocks;
`fp4_gemm.fp4_gemm_kernel(n, k, 32, True, tile)`: packed e2m1, the kernel fp4_gemm runs where the fp8 route
is refused; all compiled at once before timing), e8m0 scales per 32-wide block as the model runs them,
queued (fp4_route.queued_ms) and synced (bench_kernels.median_ms); then fp8_gemm itself (its pick). Checks
that the tiles give the same bytes, prints each tile's CTA count and pick_tile's choice. pick_tile's rates
are fits to this table's rows (docs/BENCHMARKS.md, "Gemms, 2026-12-02, session 10" and "session 13");
--extra-tiles times candidates.

Usage (on the GPU machine):  python bench/gemm_tiles.py [--json out.json] [--kinds fp8,fp4] [--extra-tiles 128x64x256]
"""

import argparse
import concurrent.futures
import functools
import json

import torch
from bench_kernels import median_ms
from fp4_route import NK, queued_ms
from needs_cuda import require_cuda

ROWS = (64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 2048)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--kinds", default="fp8,fp4")
    parser.add_argument("--extra-tiles", default="", help="more fp8 tiles to time, e.g. 128x64x256,64x128x128")
    args = parser.parse_args()
    require_cuda()
    from dsv41_convert.kernels import fp4_gemm, fp8_gemm, quant_ops
    from dsv41_convert.kernels.block_gemm import FP4_TILES, FP8_TILES, _sm_count, launcher, pick_tile
    from dsv41_convert.quant import act, fp8

    device = torch.device("cuda", 0)
    sms = _sm_count(0)
    print(f"{torch.cuda.get_device_name(0)}: {sms} SMs; fp8 tiles {FP8_TILES}, fp4 tiles {FP4_TILES}", flush=True)
    e8 = torch.float8_e8m0fnu
    extra = [tuple(int(v) for v in t.split("x")) for t in args.extra_tiles.split(",") if t]
    kinds = args.kinds.split(",")
    factory = {"fp8": fp8_gemm.fp8_gemm_kernel, "fp4": fp4_gemm.fp4_gemm_kernel}
    tile_sets = {"fp8": (*FP8_TILES, *extra), "fp4": tuple(FP4_TILES)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # compile every kernel at once
        jobs = [(kind, n, k, t) for kind in kinds for n, k in NK for t in tile_sets[kind]]
        futures = {job: pool.submit(factory[job[0]], job[1], job[2], 32, True, job[3]) for job in jobs}
        compiled = {job: f.result() for job, f in futures.items()}
    out = []
    for kind in kinds:
        tiles = FP8_TILES if kind == "fp8" else FP4_TILES
        for n, k in NK:
            g = torch.Generator(device="cuda").manual_seed(0)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
            if kind == "fp8":
                b, b_s = fp8.encode_fp8_blocks(w, (32, 32), "ue8m0", "w")
            else:
                b, b_s = quant_ops.encode_mxfp4(w, 32, "w")
                b = b.view(torch.uint8)
            runs = {tile: launcher(compiled[kind, n, k, tile]) for tile in tile_sets[kind]}
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
                a, a_s = act.act_quant(x, 32, "ue8m0", e8)
                operands = (a, a_s.view(torch.uint8), b, b_s.view(torch.uint8))
                flop = 2 * m * n * k
                row = {"kind": kind, "M": m, "N": n, "K": k, "picked": list(pick_tile(m, n, device, tiles))}
                outs = {}
                for tile, run in runs.items():
                    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                    call = functools.partial(run, *operands, c)
                    call()
                    outs[tile] = c.clone()
                    row["x".join(map(str, tile[:2]))] = {
                        "ctas": -(-m // tile[0]) * -(-n // tile[1]),
                        "queued_tflops": flop / queued_ms(call) / 1e9,
                        "synced_tflops": flop / median_ms(call) / 1e9,
                    }
                if kind == "fp8":
                    call = functools.partial(fp8_gemm.fp8_gemm, a, a_s, b, b_s, e8, 32)
                    row["fp8_gemm"] = {"queued_tflops": flop / queued_ms(call) / 1e9}
                first, *rest = outs.values()
                row["same_bytes"] = all(torch.equal(first.view(torch.int16), o.view(torch.int16)) for o in rest)
                out.append(row)
                cells = "  ".join(
                    f"{name} ({v['ctas']:4d} CTAs) {v['queued_tflops']:5.0f} q / {v['synced_tflops']:5.0f} s"
                    for name, v in row.items()
                    if isinstance(v, dict) and "ctas" in v
                )
                wrapper = f"; fp8_gemm {row['fp8_gemm']['queued_tflops']:5.0f} q" if kind == "fp8" else ""
                print(
                    f"{kind} {m:5d}x{n}x{k}: {cells} TFLOP/s{wrapper}; pick_tile {row['picked'][:2]}, "
                    f"same bytes {row['same_bytes']}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sms": sms, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
