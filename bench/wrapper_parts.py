"""Host time of the pieces of a few-row fp8_gemm / fp4_gemm call (issue 19 goal 2): what the wrappers spend
in Python and torch besides the raw launches, per piece, at one expert shape (16 x 2304 x 5120).

Each piece runs REPS times in a loop (QUEUED times where it queues GPU work: the wrappers, the raw
launches; those run while the GPU sleeps, `torch.cuda._sleep`, as in gemm_host.py); us per call.

`--against FILE` loads another version of kernels/fp4_gemm.py (e.g. `git show OLD:dsv41_convert/kernels/
fp4_gemm.py > old.py`) beside this one and times the two fp4_gemm wrappers in alternating rounds (ROUNDS,
each both in turn, at every shape and row count of gemm_host.py), so that the host's drift hits both.

Usage (on the GPU machine):  python bench/wrapper_parts.py [--json out.json] [--against old_fp4_gemm.py]
"""

import argparse
import functools
import json
import time

import torch
from fp4_route import fp8_and_fp4_weight, fp8_rows, queued_ms
from gemm_host import cases, host_us
from needs_cuda import require_cuda

ROUNDS = 7
REPS = 2000  # calls per piece that queues nothing
QUEUED = 200  # calls per piece that queues GPU work (the launch queue is not filled)
M, N, K = 16, 2304, 5120


def per_call_us(fn, queues: bool) -> float:
    """Host time per call of fn: while the GPU sleeps where fn queues GPU work (gemm_host.host_us)."""
    if queues:
        return host_us(fn, QUEUED)
    fn()
    t0 = time.perf_counter()
    for _ in range(REPS):
        fn()
    return (time.perf_counter() - t0) / REPS * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--against")
    args = parser.parse_args()
    require_cuda()
    if args.against:
        return against(args.against, args.json)
    from dsv41_convert.kernels import fp4_gemm as fp4_mod
    from dsv41_convert.kernels import fp8_gemm as fp8_mod
    from dsv41_convert.kernels.block_gemm import FP8_TILES, dense, launcher, pick_tile

    e8, u8 = torch.float8_e8m0fnu, torch.uint8
    g = torch.Generator(device="cuda").manual_seed(0)
    b, b_s, b4, b4_s = fp8_and_fp4_weight(N, K, g)
    a, a_s = fp8_rows(M, K, g)
    dev = a.device
    fp4_mod.fp4_gemm(a, a_s, b4, b4_s, e8, 32)  # the weight becomes known to the route
    fp8_mod.fp8_gemm(a, a_s, b, b_s, e8, 32)
    raw = launcher(fp8_mod.kernels(N, K, 32, True)[pick_tile(M, N, dev, FP8_TILES)])
    c = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
    launch_args = (a.shape, a_s.shape, b.shape, b_s.shape, a.dtype, a_s.dtype, b.dtype, b_s.dtype, 32, dev)

    def made_args() -> tuple:
        return (a.shape, a_s.shape, b.shape, b_s.shape, a.dtype, a_s.dtype, b.dtype, b_s.dtype, 32, a.device)

    pieces = {
        "a.device": (lambda: a.device, False),
        "a.shape": (lambda: a.shape, False),
        "fp8 _launch lookup (arguments made)": (lambda: fp8_mod._launch(*made_args()), False),
        "fp8 _launch lookup (arguments given)": (lambda: fp8_mod._launch(*launch_args), False),
        "torch.empty(M, N) bf16 cuda": (lambda: torch.empty(M, N, dtype=torch.bfloat16, device=dev), False),
        "dense(a)": (lambda: dense(a), False),
        "a_s.view(uint8)": (lambda: a_s.view(u8), False),
        "torch.cuda.current_stream().cuda_stream": (lambda: torch.cuda.current_stream(dev).cuda_stream, False),
        "fp4_gemm._current_stream": (lambda: fp4_mod._current_stream(dev), False),
        "route state (data_ptr, _version)": (
            lambda: (b4.data_ptr(), b4_s.data_ptr(), fp4_mod._version(b4), fp4_mod._version(b4_s)),
            False,
        ),
        "fp8 raw launch": (functools.partial(raw, a, a_s.view(u8), b, b_s.view(u8), c), True),
        "_route_as_fp8 (known: bound cast launch)": (functools.partial(fp4_mod._route_as_fp8, b4, b4_s), True),
        "fp8_gemm": (functools.partial(fp8_mod.fp8_gemm, a, a_s, b, b_s, e8, 32), True),
        "fp4_gemm": (functools.partial(fp4_mod.fp4_gemm, a, a_s, b4, b4_s, e8, 32), True),
    }
    out = {}
    for name, (fn, sleep) in pieces.items():
        out[name] = per_call_us(fn, sleep)
        print(f"{name:45s} {out[name]:7.2f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"M": M, "N": N, "K": K, "us": out}, f, indent=1)


def against(path: str, json_path: str | None) -> None:
    """Host and queued time per call of this fp4_gemm and the one in `path`, alternating, ROUNDS rounds."""
    import importlib.util
    import statistics

    from dsv41_convert.kernels import fp4_gemm as this

    spec = importlib.util.spec_from_file_location("other_fp4_gemm", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    e8 = torch.float8_e8m0fnu
    out = []
    for m, n, k, (_, _, b4, b4_s), (a, a_s) in cases():
        fns = {
            "this": functools.partial(this.fp4_gemm, a, a_s, b4, b4_s, e8, 32),
            "other": functools.partial(other.fp4_gemm, a, a_s, b4, b4_s, e8, 32),
        }
        got = {name: fn() for name, fn in fns.items()}  # each module learns the weight's route
        assert torch.equal(got["this"].view(torch.uint16), got["other"].view(torch.uint16)), (m, n, k)
        row = {"M": m, "N": n, "K": k}
        for name in fns:
            row[name] = {"host_us": [], "queued_us": []}
        for _ in range(ROUNDS):
            for name, fn in fns.items():
                row[name]["host_us"].append(host_us(fn))
                row[name]["queued_us"].append(queued_ms(fn, reps=QUEUED) * 1e3)
        out.append(row)
        med = {nm: {key: statistics.median(v) for key, v in row[nm].items()} for nm in fns}
        this_, other_ = med["this"], med["other"]
        print(
            f"{m:4d} x {n} x {k}: host this {this_['host_us']:5.1f} / other {other_['host_us']:5.1f} us, "
            f"queued this {this_['queued_us']:5.1f} / other {other_['queued_us']:5.1f} us (medians of {ROUNDS})",
            flush=True,
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
