"""verify's `unreached` (run.not_run_by): what a text-only run never reads must all be named. Measured here by
poisoning: every tensor the message covers set to NaN leaves a text prompt's logits, decode steps and drafts
bit for bit unchanged; one tensor outside it (a gate's text bias) does not. Before, the message named the
vision tower and aligner only, and an audit's bias_vl + 5.0 or changed image_newline passed every mode unsaid."""

from __future__ import annotations

import re

import pytest
import torch

from dsv41_convert.config import load_model_args
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify.prompts import default_prompts
from dsv41_convert.verify.run import not_run_by
from dsv41_convert.verify.runner import build_model, load_state, model_input, run_prompt
from dsv41_convert.verify.source import reference_state

# the tensor families the message names, as state-dict name patterns
NAMED = {
    "vision tower and aligner": r"(vision|aligner)\..*",
    "image_start/image_end/image_newline": r"image_(start|end|newline)",
    "bias_vl": r".*\.ffn\.gate\.bias_vl",
}


def _runs(model, inputs):
    return [run_prompt(model, inp, 2) for inp in inputs]


def _same(a, b) -> bool:
    fields = ("logits_all", "decode_ids", "decode_logits", "draft_logits", "draft_confidence")
    pairs = [(getattr(x, f), getattr(y, f)) for x, y in zip(a, b, strict=True) for f in fields]
    return all(torch.equal(u, v) for u, v in pairs if u is not None)


@pytest.mark.slow
def test_every_tensor_unreached_by_text_is_named_and_only_those(tmp_path):
    src = tmp_path / "src"
    write_checkpoint(src, TINY, seed=0, quantized=True, vision=True)
    args = load_model_args(src / "config.json").with_runtime(max_batch_size=1, max_seq_len=64, temperature=0.0)
    prompts = default_prompts(args.vocab_size, count=2, length=12)
    inputs = [model_input(p, args) for p in prompts]
    (said,) = not_run_by(inputs, args)
    assert all(part in said for part in NAMED), said
    _, state = reference_state(src)
    model = build_model(args, src, "cpu")
    load_state(model, state)
    clean = _runs(model, inputs)
    poisoned = {n for n in state if any(re.fullmatch(p, n) for p in NAMED.values())}
    assert any(n.endswith("bias_vl") for n in poisoned) and "image_newline" in poisoned
    nan = {n: t.float().fill_(float("nan")).to(t.dtype) if t.dtype.is_floating_point and t.dtype.itemsize > 1 else t
           for n, t in state.items() if n in poisoned}  # fmt: skip
    load_state(model, state | nan)
    assert _same(clean, _runs(model, inputs))  # none of them is read
    gate_bias = next(n for n in state if n.endswith(".ffn.gate.bias"))
    load_state(model, state | nan | {gate_bias: torch.full_like(state[gate_bias], float("nan"))})
    assert not _same(clean, _runs(model, inputs))  # the poisoning shows where a tensor is read
