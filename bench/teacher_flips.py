"""Indexer choices of the teacher-forced check (verify.teacher) on correct and on faulty indexers, on make-tiny.

    python bench/teacher_flips.py WORK [--tp 2,4,8] [--seed 0] [--preset tiny] [--correct-only] [--threads 1]
        [--json OUT]

Writes make-tiny (--seed, --preset, no vision) into WORK, a tp-1 reference of the default prompts (no decode steps), and
the conversion at each --tp, then counts, per prompt and index module, the positions whose indexer choice
differs from the reference's by more than a near-tie (teacher.differing_choices): on the correct rank files,
and on copies with one fault planted in an indexer's own weights on rank 0 (FAULTS). Such a fault moves no
module's output, as the teacher forces the reference's top-k, so these counts are all that can show it; each
line also gives teacher.allowed_flips, the count a prompt may have. The numbers set verify.teacher's
MAX_INDEXER_FLIPS and MIN_INDEXER_FLIPS; docs/VERIFY.md records them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not PYTHONPATH's or a virtualenv's (another checkout)

from safetensors.torch import load_file, save_file  # noqa: E402

from dsv41_convert.config import load_model_args  # noqa: E402
from dsv41_convert.verify import reffile, teacher  # noqa: E402

Edit = Callable[[dict[str, torch.Tensor]], None]


def _scaled(name: str, row: int, factor: float) -> Edit:
    def edit(t: dict[str, torch.Tensor]) -> None:
        x = t[name].clone()
        x[row] = (x[row].float() * factor).to(x.dtype)
        t[name] = x

    return edit


def _scale_byte_up(name: str) -> Edit:
    """The first e8m0 block scale doubled (its exponent byte + 1)."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        raw = t[name].view(torch.uint8).clone()
        raw[0, 0] += 1
        t[name] = raw.view(t[name].dtype)

    return edit


def faults(layer: int, names: set[str]) -> dict[str, Edit]:
    """The faults planted in index source `layer`'s indexer (those of its tensors rank 0's file holds)."""
    p = f"layers.{layer}.attn.indexer"
    out = {
        f"{p}.wq_b: one scale block doubled": (f"{p}.wq_b.scale", _scale_byte_up(f"{p}.wq_b.scale")),
        f"{p}.weights_proj: head 0 x1.25": (f"{p}.weights_proj.weight", _scaled(f"{p}.weights_proj.weight", 0, 1.25)),
        f"{p}.weights_proj: head 0 x-1": (f"{p}.weights_proj.weight", _scaled(f"{p}.weights_proj.weight", 0, -1.0)),
        f"{p}.wk: row 0 x2": (f"{p}.wk.weight", _scaled(f"{p}.wk.weight", 0, 2.0)),
        f"{p}.k_norm: weight 0 x1.5": (f"{p}.k_norm.weight", _scaled(f"{p}.k_norm.weight", 0, 1.5)),
    }
    return {label: edit for label, (name, edit) in out.items() if name in names}


def run(*args: str) -> None:
    """This checkout's CLI in a child process (its package first on the path), asserted to succeed."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-P", "-m", "dsv41_convert.cli", *args], check=True, capture_output=True, env=env)


def counted(folder: Path, ref: reffile.Reference, tp: int, threads: int) -> list[dict]:
    """Per prompt: {index module: positions counted}, its positions and the allowance."""
    rows = []
    for dev in teacher.measure(folder, ref, tp, "cpu", threads=threads):
        flips = {k: v for k, v in dev.flips.items() if v}
        rows.append({"flips": flips, "positions": dev.positions, "allowed": teacher.allowed_flips(dev.positions)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--tp", default="2,4,8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="tiny", help="make-tiny's preset (medium: the real hidden sizes)")
    parser.add_argument("--correct-only", action="store_true", help="no faults: the correct conversions alone")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    opts.work.mkdir(parents=True, exist_ok=True)
    tag = f"{opts.preset}{opts.seed}"
    src, ref_path = opts.work / f"src-{tag}", opts.work / f"ref-{tag}.safetensors"
    if not src.exists():
        run("make-tiny", str(src), "--seed", str(opts.seed), "--no-vision", "--preset", opts.preset)
    if not ref_path.exists():
        run("reference-logits", str(src), str(ref_path), "--decode-steps", "0", "--threads", str(opts.threads))
    results = []
    for tp in (int(x) for x in opts.tp.split(",")):
        conv = opts.work / f"mp{tp}-{tag}"
        if not conv.exists():
            run("shard", str(src), str(conv), "--tp", str(tp))
        args = load_model_args(conv / "config.json")
        ref = reffile.load(ref_path, 128, args)
        names = set(load_file(str(conv / f"model0-mp{tp}.safetensors")))
        planted = {"correct": None}
        for layer in () if opts.correct_only else args.index_source_layers:
            planted |= faults(layer, names)
        for label, edit in planted.items():
            folder = conv
            if edit is not None:
                folder = opts.work / "faulty"
                shutil.rmtree(folder, ignore_errors=True)
                shutil.copytree(conv, folder)
                path = folder / f"model0-mp{tp}.safetensors"
                tensors = load_file(str(path))
                edit(tensors)
                save_file(tensors, str(path))
            rows = counted(folder, ref, tp, opts.threads)
            results.append({"tp": tp, "preset": opts.preset, "seed": opts.seed, "case": label, "prompts": rows})
            said = "; ".join(
                ", ".join(f"{k.removesuffix('.attn.indexer')} {v}" for k, v in r["flips"].items()) or "0" for r in rows
            )
            over = any(v > r["allowed"] for r in rows for v in r["flips"].values())
            print(f"tp {tp} {label}: {said} (allowed {rows[0]['allowed']:g} of {rows[0]['positions']})"
                  f"{' -> FAIL' if over else ''}", flush=True)  # fmt: skip
    shutil.rmtree(opts.work / "faulty", ignore_errors=True)
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
