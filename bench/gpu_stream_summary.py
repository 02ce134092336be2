"""Summarise bench/gpu_stream_ref.sh's outputs: peak GPU memory against the plan's figure, the streamed
time split, and whether the streamed prefill logits equal the whole model's byte for byte.

    python bench/gpu_stream_summary.py OUTDIR WHOLE.safetensors STREAM.safetensors
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    out, whole, stream = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    plan = _load(out / "plan.json")
    if plan is not None:
        s = plan["memory"]["streamed"]
        print(f"plan streamed: unit {s['unit'] / GIB:.2f} GiB ({s['largest_unit']}), caches {s['caches'] / GIB:.2f},"
              f" working {s['working'] / GIB:.2f}, peak {s['peak'] / GIB:.2f} GiB;"
              f" verify tp1 total {plan['memory']['verify'][0]['total'] / GIB:.2f} GiB")  # fmt: skip
    for name in ("whole_cold", "stream_a", "whole_warm", "stream_b"):
        r = _load(out / f"{name}.json")
        if r is None:
            print(f"{name}: no result")
            continue
        line = f"{name}: gpu peak {r.get('gpu_peak_bytes', 0) / GIB:.2f} GiB"
        if "units" in r:
            line += (f", read {r['read_s']:.1f} s ({r['bytes_read'] / GIB:.1f} GiB), transfer {r['transfer_s']:.1f} s,"
                     f" compute {r['compute_s']:.1f} s, wait {r['wait_s']:.1f} s,"
                     f" largest unit {r['largest_unit_bytes'] / GIB:.2f} GiB")  # fmt: skip
            top = sorted(r["units"], key=lambda u: -(u["compute_s"] + u["wait_s"]))[:4]
            line += "; slowest: " + ", ".join(
                f"{u['unit']} {u['compute_s']:.1f}+{u['wait_s']:.1f} s ({u['experts_read']} exp)" for u in top
            )
        print(line)
    try:
        import torch
        from safetensors.torch import load_file

        a, b = load_file(whole), load_file(stream)
        keys = sorted(k for k in a if k in b and not k.startswith(("decode", "draft")))

        def same(k: str) -> bool:
            x, y = a[k], b[k]
            return x.shape == y.shape and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))

        differ = [k for k in keys if not same(k)]
        print(f"streamed == whole (bytes): {len(keys) - len(differ)}/{len(keys)} prefill tensors, differ: {differ[:8]}")
    except Exception as exc:  # a summary line, whatever went wrong
        print(f"compare failed: {exc!r}")


if __name__ == "__main__":
    main()
