"""The layer-streamed reference on CUDA (model/streamed.py fed by stream_feed.CudaFeed) against the whole
model on the same GPU: bit-identical prefill, decode, draft logits and hidden states (fp8 source with an
image prompt, bf16 source); each unit's dense weights read ahead by the reader threads while the previous
unit computes, routed experts read when picked, unread experts holding no GPU memory.
Planted faults it catches: compute that does not wait for its weights' copies, or reads another unit's
tensors (logits differ); no read-ahead (the names come from the running unit's thread); every expert moved
to the GPU with its unit (param_bytes). It cannot see a race that happens not to strike in this run."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch
from stream_testing import assert_bit_identical, expected_param_bytes, whole_model_runs, write_sources

from dsv41_convert.synth.presets import TINY
from dsv41_convert.verify.prompts import Prompt, default_prompts
from dsv41_convert.verify.source import SourceWeights
from dsv41_convert.verify.streamed import compute_streamed_reference

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

N_DECODE = 2


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    root = tmp_path_factory.mktemp("streamed-cuda")
    return write_sources(root)


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_streamed_on_cuda_equals_whole_model_bit_for_bit(sources, dtype):
    prompts = default_prompts(TINY.vocab_size, count=2)
    ref, timings = compute_streamed_reference(sources[dtype], prompts, N_DECODE, device="cuda")
    whole = whole_model_runs(sources[dtype], prompts, N_DECODE, [r.decode_ids for r in ref.runs], "cuda")
    assert_bit_identical(ref.runs, whole)
    assert all(t.transfer_s > 0 and t.read_s > 0 for t in timings)


def test_streamed_image_prompt_on_cuda_bit_for_bit(sources, tmp_path):
    from PIL import Image

    img = Image.new("RGB", (100, 70))
    img.putdata([((x * 7) % 256, (y * 5) % 256, (x * y) % 256) for y in range(70) for x in range(100)])
    img.save(tmp_path / "a.png")
    prompts = [Prompt(tuple(range(5, 25)), "vl", image=str(tmp_path / "a.png"))]
    ref, timings = compute_streamed_reference(sources["fp8"], prompts, 1, device="cuda")
    assert timings[0].unit == "vision"
    whole = whole_model_runs(sources["fp8"], prompts, 1, [r.decode_ids for r in ref.runs], "cuda")
    assert_bit_identical(ref.runs, whole)


class ThreadLog(SourceWeights):
    """SourceWeights that records which thread asked for which tensor."""

    def __init__(self, src: Path):
        super().__init__(src)
        self.asked: dict[str, str] = {}

    def __call__(self, names):
        who = threading.current_thread().name
        self.asked.update(dict.fromkeys(names, who))
        return super().__call__(names)


def test_next_unit_read_ahead_and_experts_on_demand(sources, monkeypatch):
    from dsv41_convert.config import load_model_args
    from dsv41_convert.model import stream_feed, streamed
    from dsv41_convert.verify.reference import pick_max_seq_len
    from dsv41_convert.verify.runner import draft_block, model_input
    from dsv41_convert.verify.streamed import fixed_decode_ids

    takes: list[tuple[str, bool]] = []

    class Logged(stream_feed.CudaFeed):
        def take(self, key, sizes, timing):
            takes.append((key, key in self.pending))  # read ahead: submitted while the previous unit ran
            return super().take(key, sizes, timing)

    monkeypatch.setattr(streamed, "CudaFeed", Logged)
    src = sources["fp8"]
    prompts = default_prompts(TINY.vocab_size, count=1, length=20)
    args = load_model_args(src / "config.json")
    seq = pick_max_seq_len([len(p.input_ids) for p in prompts], 1, None, draft_block(args))
    args = args.with_runtime(max_batch_size=1, max_seq_len=seq, temperature=0.0)
    inputs = [streamed.StreamPrompt(model_input(p, args).input_ids, fixed_decode_ids(p, 1)) for p in prompts]
    weights = ThreadLog(src)
    before = torch.cuda.memory_allocated()
    _, timings = streamed.run_streamed(args, weights, inputs, src / "tokenizer.json", device="cuda")
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()  # cuBLAS's 32 MiB, allocated at its first call in the process
    torch.cuda.empty_cache()  # frees blocks whose last use was on another stream (record_stream)
    assert torch.cuda.memory_allocated() <= before + (1 << 20)  # the units' weights are gone
    assert takes[0] == ("0:embed", False) and len(takes) > 2 * (args.n_layers + 2)  # two passes
    assert all(ahead for _, ahead in takes[1:]), takes
    experts = {n: w for n, w in weights.asked.items() if ".ffn.experts." in n}
    assert experts and all(w.startswith("stream-now") for w in experts.values())
    assert all(w.startswith("stream-ahead") for n, w in weights.asked.items() if n not in experts)
    for i in (i for i in range(args.n_layers) if i not in args.engram_layer_ids):
        t = timings[1 + i]
        assert 0 < t.experts_read and t.param_bytes >= expected_param_bytes(args, i, 0), t.unit
        assert t.param_bytes <= expected_param_bytes(args, i, t.experts_read), t.unit


def test_verify_stream_layers_on_cuda(sources, tmp_path):
    """`verify --stream-layers --device cuda` against a CUDA tp-1 file: a correct tp-2 set passes bit for bit
    on the streamed replay and the weights; one fp8 block scale of a reached weight doubled fails the replay."""
    from safetensors.torch import load_file, save_file

    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.verify import reffile
    from dsv41_convert.verify.run import VerifyOptions, verify

    prompts = default_prompts(TINY.vocab_size, count=1, length=24)
    ref, _ = compute_streamed_reference(sources["fp8"], prompts, N_DECODE, device="cuda")
    path = tmp_path / "ref.safetensors"
    reffile.save(ref, path)
    conv = tmp_path / "mp2"
    execute(build_plan(sources["fp8"], 2), conv)
    result = verify(VerifyOptions(conv, reference_logits=path, device="cuda", stream_layers=True))
    assert result.verdict == "PASS" and result.decisive == ["replay", "weights"], (result.failures, result.checks)
    rank1 = conv / "model1-mp2.safetensors"
    tensors = load_file(str(rank1))
    raw = tensors["layers.1.attn.wq_b.scale"].view(torch.uint8).clone()
    raw[0, 0] += 1
    tensors["layers.1.attn.wq_b.scale"] = raw.view(torch.float8_e8m0fnu)
    save_file(tensors, str(rank1))
    (conv / "manifest.json").unlink()
    result = verify(VerifyOptions(conv, reference_logits=path, device="cuda", stream_layers=True))
    replay = next(c for c in result.checks if c.name == "replay")
    assert result.verdict == "FAIL" and replay.failures, (result.failures, result.checks)
