"""The I/O side of `shard --device cuda` of a bf16 source, emulated on a machine without a GPU: the
Prefetch on, CUDA's 64 MiB row blocks, and quantizers that return zero outputs of the right shapes and
dtypes (no compute beyond a memset, no H2D/D2H), so what remains is the converting thread's own reads, hints,
copies and hand-overs, the Prefetch threads and the Sink. The bytes written are not meaningful; the times and the
stages show which of those holds the caller up.

    python bench/bench_io_path.py SRC OUT [--tp 2] [--make-source]

--make-source writes SRC first: the medium preset's bf16 layout (13.13 GB) with every tensor's bytes a
repeated 64 MiB block of random bytes below 0x7F (seconds, not make-tiny's minutes; finite as bf16 and f32,
since the writer refuses a non-finite value it copies; the stand-in quantizers never look at them). Prints one
JSON line: wall, CPU seconds, peak RSS, stages (summed over files).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from bench_shard import evict, source_bytes  # noqa: E402

from dsv41_convert.convert import stream, write  # noqa: E402
from dsv41_convert.convert.plan import build_plan  # noqa: E402


# zeros, not torch.empty: the converter checks every encoding it writes (transform._require_finite_encoding),
# and leftover bytes of an empty tensor read as NaN or infinite blocks; a memset is far below a quantization
def encode_fp8_blocks(w, block=(32, 32), scale_fmt="ue8m0", name=""):
    """w: [out, in] bf16 -> ([out, in] float8_e4m3fn, [ceil(out/b0), ceil(in/b1)] float8_e8m0fnu), all zero bytes"""
    scales = (math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
    return torch.zeros(w.shape, dtype=torch.uint8).view(torch.float8_e4m3fn), _zero_scales(scales)


def encode_mxfp4(w, block=32, name=""):
    """w: [..., in] bf16 -> ([..., in/2] float4_e2m1fn_x2, [..., ceil(in/block)] float8_e8m0fnu), all zero bytes"""
    rows = w.shape[:-1]
    packed = torch.zeros((*rows, w.shape[-1] // 2), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    return packed, _zero_scales((*rows, math.ceil(w.shape[-1] / block)))


def _zero_scales(shape: tuple[int, ...]) -> torch.Tensor:
    """e8m0 bytes 0 (2**-127): finite, unlike the byte 255 (NaN) an empty tensor may hold."""
    return torch.zeros(shape, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def make_source(src: Path) -> None:
    """The medium bf16 layout with headers from make-tiny's own catalogue and filler bytes."""
    import dsv41_convert.synth.write as synth
    from dsv41_convert.store.safetensors_header import build_header
    from dsv41_convert.synth.presets import PRESETS

    block = source_bytes(64 << 20)  # finite in every dtype

    def filled(out, shard, seed, quantized, progress=None):
        header, _ = build_header([(t.name, t.dtype, tuple(t.shape)) for t in shard.tensors])
        with open(out / shard.file, "wb") as f:
            f.write(header)
            left = shard.nbytes
            while left:
                left -= f.write(block[: min(left, len(block))])
        return (out / shard.file).stat().st_size

    synth.write_shard = filled
    synth.write_checkpoint(src, PRESETS["medium"], quantized=False, vision=False, overwrite=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--make-source", action="store_true")
    a = ap.parse_args()
    if a.make_source:
        make_source(a.src)
    quantizer = SimpleNamespace(device="cpu", encode_fp8_blocks=encode_fp8_blocks, encode_mxfp4=encode_mxfp4)
    write.READ_AHEAD_DEVICES = ("cpu",)  # the Prefetch as on CUDA, into pageable buffers
    write.compute_chunk_bytes = lambda chunk_bytes, device: 8 * stream.GPU_BLOCK_BYTES  # CUDA's row blocks
    plan = build_plan(a.src, a.tp)
    shutil.rmtree(a.out, ignore_errors=True)
    a.out.mkdir(parents=True)
    torch.set_num_threads(1)
    evict(a.src)
    stages: dict[str, float] = {}
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for rf in plan.files:
        stats: dict = {}
        write.write_partial(rf, a.src, a.out, quantizer, stats=stats)
        for k, v in stats["stages"].items():
            stages[k] = stages.get(k, 0.0) + v
        write.commit(a.out, rf.file)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    shutil.rmtree(a.out)
    print(json.dumps({
        "source_gb": round(sum(p.stat().st_size for p in a.src.glob("*.safetensors")) / 1e9, 2),
        "wall_s": round(wall, 2),
        "user_s": round(after.ru_utime - before.ru_utime, 2),
        "sys_s": round(after.ru_stime - before.ru_stime, 2),
        "peak_rss_gib": round(after.ru_maxrss / 2**20, 2),
        "stages_s": {k: round(v, 2) for k, v in sorted(stages.items())},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
