"""`demo [DIR]`: the whole main job on a model small enough for a laptop, in under a minute.

    make-tiny DIR/src (published fp8/fp4 layout, no vision)
    shard     DIR/src -> DIR/mp8 at tp 8
    verify    DIR/mp8 against DIR/src: 8 ranks (gloo) beside their twin, tp-1 reference

The demo keeps the run short: one built-in prompt of 24 tokens (longer than the tiny preset's
16-token window, so compressed attention and the indexer take part) and 2 decode steps.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsv41_convert.errors import OutputError
from dsv41_convert.progress import Progress as ByteProgress

Step = Callable[[str], None]


def run_demo(
    folder: Path,
    tp: int = 8,
    seed: int = 0,
    overwrite: bool = False,
    step: Step | None = None,
    progress: ByteProgress | None = None,
    threads: int | None = None,
) -> tuple[Any, dict[str, float]]:
    """-> (VerifyResult, seconds per stage). `step(message)` announces each stage; `progress` gets
    byte progress of the writes."""
    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import write_checkpoint
    from dsv41_convert.verify.prompts import default_prompts
    from dsv41_convert.verify.run import VerifyOptions, verify

    say = step or (lambda _m: None)
    folder = Path(folder)
    src, out = folder / "src", folder / f"mp{tp}"
    if folder.exists() and any(folder.iterdir()):
        if not overwrite:
            raise OutputError(f"{folder}: not empty; pass --overwrite or choose another folder")
        for p in (src, out):
            shutil.rmtree(p, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    seconds = {}
    t = time.perf_counter()
    say(f"1/3 make-tiny {src} (seed {seed}, fp8/fp4)")
    write_checkpoint(src, PRESETS["tiny"], seed=seed, quantized=True, vision=False, progress=progress)
    seconds["make-tiny"] = time.perf_counter() - t
    t = time.perf_counter()
    say(f"2/3 shard {src} -> {out} (tp {tp})")
    execute(build_plan(src, tp), out, progress=progress or (lambda *_: None))
    seconds["shard"] = time.perf_counter() - t
    t = time.perf_counter()
    say(f"3/3 verify {out} against {src} ({tp} ranks)")
    prompt = default_prompts(PRESETS["tiny"].vocab_size, count=1, length=24)[0]
    prompts_file = folder / "demo-prompts.jsonl"
    prompts_file.write_text('{"input_ids": [' + ", ".join(map(str, prompt.input_ids)) + "]}\n")
    opts = VerifyOptions(out, reference=src, prompts=prompts_file, n_decode=2, threads=threads)
    result = verify(opts, progress=say)
    seconds["verify"] = time.perf_counter() - t
    return result, seconds
