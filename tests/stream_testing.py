"""The layer-streamed model's tests (tests/integration/test_streamed.py, tests/gpu/test_streamed_cuda.py):
the whole model run on the same weights and decode tokens, and the bit-for-bit comparison."""

from __future__ import annotations

from pathlib import Path

import torch

from dsv41_convert.config import load_model_args
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify.reference import pick_max_seq_len
from dsv41_convert.verify.runner import build_model, draft_block, load_state, model_input, run_prompt
from dsv41_convert.verify.source import reference_state


def whole_model_runs(src: Path, prompts, n_decode: int, teacher: list[torch.Tensor], device: str = "cpu"):
    """The whole model at tp 1 on the same weights, fed the same decode tokens (teacher forcing)."""
    args = load_model_args(src / "config.json")
    inputs = [model_input(p, args) for p in prompts]
    seq = pick_max_seq_len([len(i.input_ids) for i in inputs], n_decode, None, draft_block(args))
    args = args.with_runtime(max_batch_size=1, max_seq_len=seq, temperature=0.0)
    model = build_model(args, src, device)
    load_state(model, reference_state(src)[1])
    return [run_prompt(model, i, n_decode, t, True, device) for i, t in zip(inputs, teacher, strict=True)]


def assert_bit_identical(streamed, whole) -> None:
    for s, w in zip(streamed, whole, strict=True):
        assert torch.equal(s.decode_ids, w.decode_ids)
        for key in ("logits_all", "last", "decode_logits"):
            a, b = getattr(s, key), getattr(w, key)
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), key
        assert (s.draft_logits is None) == (w.draft_logits is None)
        if w.draft_logits is not None:
            assert torch.equal(s.draft_logits.view(torch.int32), w.draft_logits.view(torch.int32))
        assert sorted(s.hidden) == sorted(w.hidden)
        for key in w.hidden:
            assert torch.equal(s.hidden[key].view(torch.uint8), w.hidden[key].view(torch.uint8)), key


def expected_param_bytes(args, layer: int, experts_read: int) -> int:
    """What a layer unit without Engram holds: the whole Block's parameters, less the unread experts'."""
    from dsv41_convert.model.block import Block
    from dsv41_convert.model.layers import dense_dtype

    with dense_dtype(args):
        block = Block(layer, args)
    size = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in (block, block.ffn.experts[0])]
    return size[0] - (args.n_routed_experts - experts_read) * size[1]


def write_sources(root: Path) -> dict[str, Path]:
    """The tiny preset as an fp8 source with vision and as a bf16 source without: {"fp8": ..., "bf16": ...}."""
    out = {}
    for dtype in ("fp8", "bf16"):
        out[dtype] = root / dtype
        write_checkpoint(out[dtype], TINY, seed=0, quantized=dtype == "fp8", vision=dtype == "fp8")
    return out
