"""The layer-streamed model (model/streamed.py, verify/streamed.py) against the whole model at tp 1:
bit-identical prefill, decode and draft logits and hidden states, for fp8 and bf16 sources and an
image prompt; and the streamed path reads only what it needs (routed experts, touched Engram rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify.prompts import default_prompts, load_prompts
from dsv41_convert.verify.reference import pick_max_seq_len
from dsv41_convert.verify.runner import build_model, load_state, model_input, run_prompt
from dsv41_convert.verify.source import SourceWeights, reference_state
from dsv41_convert.verify.streamed import compute_streamed_reference, fixed_decode_ids

N_DECODE = 2


def whole_model_runs(src: Path, prompts, n_decode: int, teacher: list[torch.Tensor]):
    """The whole model at tp 1 on the same weights, fed the same decode tokens (teacher forcing)."""
    from dsv41_convert.config import load_model_args

    args = load_model_args(src / "config.json")
    inputs = [model_input(p, args) for p in prompts]
    seq = pick_max_seq_len([len(i.input_ids) for i in inputs], n_decode, None)
    args = args.with_runtime(max_batch_size=1, max_seq_len=seq, temperature=0.0)
    model = build_model(args, src / "tokenizer.json", "cpu")
    load_state(model, reference_state(src)[1])
    return [run_prompt(model, i, n_decode, t, True) for i, t in zip(inputs, teacher, strict=True)]


def assert_bit_identical(streamed, whole) -> None:
    for s, w in zip(streamed, whole, strict=True):
        assert torch.equal(s.decode_ids, w.decode_ids)
        for key in ("logits_all", "last", "decode_logits"):
            a, b = getattr(s, key), getattr(w, key)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32)), key
        assert (s.draft_logits is None) == (w.draft_logits is None)
        if w.draft_logits is not None:
            assert torch.equal(s.draft_logits.view(torch.int32), w.draft_logits.view(torch.int32))
        assert sorted(s.hidden) == sorted(w.hidden)
        for key in w.hidden:
            assert torch.equal(s.hidden[key].view(torch.int16), w.hidden[key].view(torch.int16)), key
