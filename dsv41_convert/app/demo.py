"""`demo [DIR]`: the whole main job on a model small enough for a laptop, in under a minute.

    make-tiny          DIR/src (published fp8/fp4 layout, no vision)
    shard              DIR/src -> DIR/mp8 at tp 8
    reference-logits   DIR/src -> DIR/ref-tp1.safetensors: the reference at tp 1, computed once
    verify             DIR/mp8 against that file: 8 ranks (gloo), then the decisive checks: every
                       tensor against the digests of the weights the reference ran, and the rank
                       files merged back to tp 1 and replayed bit for bit against the reference

The demo keeps the run short: one built-in prompt of 24 tokens (longer than the tiny preset's
16-token window, so compressed attention and the indexer take part) and 2 decode steps.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dsv41_convert import interrupts, torchrun
from dsv41_convert.errors import ConfigError, OutputError
from dsv41_convert.file_kinds import refuse_unmakeable
from dsv41_convert.progress import Progress as ByteProgress

Step = Callable[[str], None]
MARK = ".dsv41-demo"  # in DIR: the demo's own list of the conversions it wrote; --overwrite removes nothing else
REFERENCE = "ref-tp1.safetensors"


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
    from dsv41_convert.config import ModelArgs
    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.convert.tp import check_tp
    from dsv41_convert.synth.presets import PRESETS, hf_config
    from dsv41_convert.synth.write import write_checkpoint
    from dsv41_convert.verify import reffile
    from dsv41_convert.verify.launch import default_threads
    from dsv41_convert.verify.prompts import default_prompts
    from dsv41_convert.verify.reference import compute_reference_ranks
    from dsv41_convert.verify.run import VerifyOptions, verify

    say = step or (lambda _m: None)
    tiny = ModelArgs.from_hf_dict(hf_config(PRESETS["tiny"], compressed_vocab_size=1, vision=False))
    check_tp(tiny, tp, "the demo's tiny model")  # before anything is written
    if torchrun.world() not in (None, 1):  # a broken RANK/WORLD_SIZE pair is refused here too, not after make-tiny
        raise ConfigError("demo runs in one process: run it without torchrun (RANK and WORLD_SIZE are set)")
    folder = Path(folder)
    src, out = folder / "src", folder / f"mp{tp}"
    refuse_unmakeable(src, OutputError)  # DIR a link to nothing, or a file: mkdir said only "File exists"
    if folder.exists() and any(folder.iterdir()):
        # what --overwrite refuses is refused first, without it too: "not empty; pass --overwrite" was said of
        # a folder of a user's files, where --overwrite then refused (an audit)
        earlier = _earlier_demo(folder, out)
        if not overwrite:
            raise OutputError(
                f"{folder}: not empty (an earlier demo's output); pass --overwrite to replace it, or choose another "
                "folder"
            )
        interrupts.check()  # one postponed since an import: the earlier demo stays (an audit: it was removed)
        for conv in earlier:
            if conv.is_dir() and not conv.is_symlink():
                shutil.rmtree(conv)
        (folder / REFERENCE).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    mark = {"note": "written by `dsv41-convert demo`; its --overwrite removes only these", "wrote": [out.name]}
    (folder / MARK).write_text(json.dumps(mark) + "\n", encoding="utf-8")
    seconds = {}
    t = time.perf_counter()
    say(f"1/4 make-tiny {src} (seed {seed}, fp8/fp4)")
    write_checkpoint(src, PRESETS["tiny"], seed=seed, quantized=True, vision=False, progress=progress, overwrite=True)
    seconds["make-tiny"] = time.perf_counter() - t
    t = time.perf_counter()
    say(f"2/4 shard {src} -> {out} (tp {tp})")
    execute(build_plan(src, tp), out, progress=progress or (lambda *_: None))
    seconds["shard"] = time.perf_counter() - t
    t = time.perf_counter()
    ref_file = folder / REFERENCE
    say(f"3/4 reference-logits {src} -> {ref_file} (tp 1)")
    prompt = default_prompts(PRESETS["tiny"].vocab_size, count=1, length=24)[0]
    ref_threads = threads or default_threads(1)
    torch.set_num_threads(ref_threads)
    reffile.save(compute_reference_ranks(src, [prompt], 1, 2, None, "cpu", False, ref_threads), ref_file)
    seconds["reference"] = time.perf_counter() - t
    t = time.perf_counter()
    say(f"4/4 verify {out} against {ref_file} ({tp} ranks, then the rank files replayed at tp 1)")
    opts = VerifyOptions(out, reference_logits=ref_file, threads=threads)
    result = verify(opts, progress=say)
    seconds["verify"] = time.perf_counter() - t
    return result, seconds


def _earlier_demo(folder: Path, out: Path) -> list[Path]:
    """The conversions an earlier demo wrote in `folder` (its MARK lists them), which --overwrite removes with
    its reference (src/ is left to make-tiny's --overwrite, which replaces only its own files), once checked:
    OutputError unless none holds a file shard does not write, `out` (this run's conversion) is absent or one
    of them (a folder, no link), src/ is no link and holds only make-tiny's files, and the reference's name is
    no folder: --overwrite removed every mp<N>/ with shard's records (a user's own conversion too) and src/ with
    whatever was in it, and wrote through a src/ link (audits). Removes nothing."""
    from dsv41_convert.convert.execute import shard_writes
    from dsv41_convert.synth.staged import check_out

    mark = folder / MARK
    if not mark.is_file():
        raise OutputError(
            f"{folder}: not a folder an earlier demo wrote (no {MARK} listing its output); --overwrite replaces only "
            "such a folder: choose an empty or new one, or remove it yourself"
        )
    try:
        wrote = json.loads(mark.read_text(encoding="utf-8"))["wrote"]
    except (OSError, ValueError, KeyError, TypeError):  # a demo's of before 2026-12-05: a line of text, no list
        raise OutputError(
            f"{mark}: no list of the conversions a demo wrote (a demo before 2026-12-05 left a line of text that "
            "names none); --overwrite replaces only a listed demo's output: choose an empty or new folder, or remove "
            "this one yourself"
        ) from None
    conversions = [folder / name for name in wrote if re.fullmatch(r"mp\d+", str(name))]
    if (out.exists() or out.is_symlink()) and out not in conversions:
        raise OutputError(
            f"{out}: not a conversion an earlier demo wrote (a shard of yours?); demo --overwrite replaces only its "
            "own output: move it, or run the demo with another --tp"
        )
    if out.is_symlink() or (out.exists() and not out.is_dir()):  # not removed below: the shard step failed on it,
        # after the reference was removed and src/ written (an audit)
        raise OutputError(
            f"{out}: a {'link' if out.is_symlink() else 'file'}, where the demo writes its conversion; --overwrite "
            "replaces only its own output: move it, or run the demo with another --tp"
        )
    if (folder / "src").is_symlink():
        raise OutputError(f"{folder / 'src'}: a link; the demo writes a src/ of its own: remove the link, or choose "
                          "another folder")  # fmt: skip
    for conv in (c for c in conversions if c.is_dir() and not c.is_symlink()):
        foreign = sorted(p.name for p in conv.iterdir() if not shard_writes(p.name))
        if foreign:
            raise OutputError(
                f"{conv}: holds what shard does not write ({', '.join(foreign[:5])}); demo --overwrite replaces "
                "only its own output: move them, or choose another folder"
            )
    if (folder / "src").exists():
        check_out(folder / "src", overwrite=True)  # refuses a src/ holding what make-tiny does not write
    ref = folder / REFERENCE
    if ref.is_dir() and not ref.is_symlink():  # unlink below fails on it: after the conversions went (an audit)
        raise OutputError(
            f"{ref}: a folder, where the demo writes its reference file; --overwrite replaces only its own output: "
            "move it, or choose another folder"
        )
    return conversions
