"""GPU time of the GEMMs with the host taken out (issue 19 goal 2): are the queued figures of bench_kernels.py
the GPU's, or the host's pace of issuing calls?

bench_kernels.py times 50 calls queued back to back between two events: where the host takes longer to issue a
call than the GPU takes to run it, that is the host's pace (bench_kernels now gives the graphed figures too).
cuBLAS's `torch._scaled_mm` at 128 rows gave 267 to 541 TFLOP/s queued in rounds of sessions 41-50, while our
raw-launched fp8_gemm stayed at 202-213. Here, for each GEMM of bench_kernels.GEMM_SHAPES, per call:

  queued   50 calls back to back between two events (bench_kernels.queued_ms)
  graphed  the same 50 calls captured once in a CUDA graph (bench_kernels.graphed_ms), replayed between two
           events: the GPU's time alone (no host work between kernels)
  host     the host's time to issue one call while the GPU is held busy (gemm_host.host_us), nothing waiting

in ROUNDS rounds, the GEMMs in another order each round. fp4_gemm's graph holds its cast and the fp8 kernel.

Usage (on the GPU machine):  python bench/gemm_graphed.py [--json out.json]
"""

import argparse
import json
import statistics

import torch
from bench_kernels import GEMM_SHAPES, gemm_calls, gemm_operands, graphed_ms, queued_ms
from gemm_host import host_us
from needs_cuda import require_cuda

ROUNDS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    require_cuda()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    for m, n, k in GEMM_SHAPES:
        flop = 2 * m * n * k
        fns = gemm_calls(gemm_operands(m, n, k))
        names = list(fns)
        runs: dict[str, dict[str, list[float]]] = {name: {"queued": [], "graphed": [], "host_us": []} for name in names}
        for r in range(ROUNDS):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                fn = fns[name]
                runs[name]["queued"].append(flop / queued_ms(fn) / 1e9)
                try:
                    runs[name]["graphed"].append(flop / graphed_ms(fn) / 1e9)
                except Exception as exc:  # a call that cannot be captured: said, not timed
                    runs[name]["graphed_error"] = [f"{type(exc).__name__}: {exc}"[:200]]
                runs[name]["host_us"].append(host_us(fn))
        shape = {"M": m, "N": n, "K": k, "runs": runs}
        out["shapes"].append(shape)
        print(f"{m} x {n} x {k}: TFLOP/s per round (queued | graphed), host us per call")
        for name in names:
            got = runs[name]
            q = " ".join(f"{v:.0f}" for v in got["queued"])
            g = " ".join(f"{v:.0f}" for v in got["graphed"]) or got.get("graphed_error", ["-"])[0]
            h = statistics.median(got["host_us"])
            print(f"  {name:12s} queued {q} | graphed {g} | host {h:.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
