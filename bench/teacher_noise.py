"""Per-module noise of the teacher-forced check (verify.teacher) and the faults' effect, on make-tiny.

    python bench/teacher_noise.py --ref-device cuda --device cpu --tp 1,2 [--faults] [--json OUT]

Writes make-tiny (fp8 source, seed 0) to a temporary folder, computes a tp-1 reference on --ref-device
(default prompts, hidden states), converts at each --tp and runs every module teacher-forced on
--device: prints each module's worst deviation (bf16 ulps of the row's largest reference value) and the
share of positions whose indexer choice differs. With --faults, also every fault of the verify matrix
(tests/integration/test_verify_matrix.py) at the first tp > 1, against the matrix's 24-token prompt.
The numbers set verify.teacher.ULPS_BOUND; docs/VERIFY.md records them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not PYTHONPATH's or a virtualenv's (another checkout)

from dsv41_convert.convert.execute import execute  # noqa: E402
from dsv41_convert.convert.plan import build_plan  # noqa: E402
from dsv41_convert.synth.presets import TINY  # noqa: E402
from dsv41_convert.synth.write import write_checkpoint  # noqa: E402
from dsv41_convert.verify import teacher  # noqa: E402
from dsv41_convert.verify.prompts import default_prompts, load_prompts  # noqa: E402
from dsv41_convert.verify.reference import compute_reference_ranks  # noqa: E402


def worst_by_kind(devs: list[teacher.ModuleDeviations]) -> dict[str, float]:
    """module kind (embed, engram, attn, ffn, block, pre_mix, norm, logits, indexer) -> worst value"""
    out: dict[str, float] = {}
    for d in devs:
        for key, value in d.ulps.items():
            kind = re.sub(r"layers\.\d+", "block", key).replace("block.", "")
            out[kind] = max(out.get(kind, 0.0), value)
        for value in d.flips.values():  # positions choosing otherwise, as a share of the prompt
            out["indexer"] = max(out.get("indexer", 0.0), value / d.positions)
    return out


def worst_module(devs: list[teacher.ModuleDeviations]) -> tuple[str, float]:
    best = ("", 0.0)
    for d in devs:
        for key, value in d.ulps.items():
            if value > best[1]:
                best = (key, value)
    return best


def verify_matrix() -> ModuleType:
    """tests/integration/test_verify_matrix.py, with tests/ on the path too, as pytest runs it: its imports
    reach the other tests' helpers (test_verify_reference_file, cli_run)."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests / "integration"), str(tests)]
    import test_verify_matrix

    return test_verify_matrix


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref-device", default="cpu")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--faults", action="store_true")
    ap.add_argument("--json", type=Path)
    opts = ap.parse_args()
    torch.set_num_threads(1)
    result: dict = {"ref_device": opts.ref_device, "device": opts.device, "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="teacher-noise-") as tmp:
        root = Path(tmp)
        src = root / "src"
        write_checkpoint(src, TINY, seed=0, quantized=True, vision=False)
        ref = compute_reference_ranks(src, default_prompts(TINY.vocab_size), 1, 1, None, opts.ref_device, False, 1)
        tps = [int(t) for t in opts.tp.split(",")]
        for tp in tps:
            for experts in ("fp4", "fp8"):
                conv = root / f"conv-{experts}-mp{tp}"
                execute(build_plan(src, tp, experts), conv)
                worst = worst_by_kind(teacher.measure(conv, ref, tp, opts.device, 1))
                result[f"correct tp{tp} {experts}"] = worst
                print(f"correct tp {tp} {experts} experts:", json.dumps({k: round(v, 3) for k, v in worst.items()}))
        if opts.faults:
            matrix = verify_matrix()
            (root / "matrix").mkdir()
            m = matrix.Matrix(root / "matrix")
            prompts = load_prompts(m.prompts_file, None, TINY.vocab_size)
            mref = compute_reference_ranks(m.src, prompts, 1, 1, None, opts.ref_device, False, 1)
            tp = next(t for t in tps if t > 1)
            for name, plant in matrix.FAULTS.items():
                bad = m.faulty(name, tp)
                plant(m, bad, tp)
                try:
                    key, value = worst_module(teacher.measure(bad, mref, tp, opts.device, 1))
                except Exception as exc:  # the shards do not load: verify fails them at load
                    key, value = f"does not load ({type(exc).__name__})", float("nan")
                result[f"fault {name} tp{tp}"] = [key, value]
                print(f"fault {name} tp {tp}: {key} {value:.3g} ulps")
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
