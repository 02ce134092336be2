"""What feeds the layer-streamed model its weights (model/stream_feed.py) and the provider's read buffers
(SourceWeights.alloc, which the CUDA feed points at pinned memory). The CUDA feed itself runs in
tests/gpu/test_streamed_cuda.py."""

from __future__ import annotations

import torch

from dsv41_convert.model.stream_feed import HostFeed, _groups
from dsv41_convert.model.stream_records import UnitTiming
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify.source import SourceWeights


def test_groups_keep_a_weight_with_its_scale_and_balance_bytes():
    sizes = {"a.weight": 100, "a.scale": 4, "b.weight": 60, "c.weight": 50, "c.scale": 2, "d": 10}
    groups = _groups(sizes, 2)
    assert sorted(n for g in groups for n in g) == sorted(sizes)  # each name once
    for g in groups:
        assert ("a.weight" in g) == ("a.scale" in g) and ("c.weight" in g) == ("c.scale" in g)
    load = sorted(sum(sizes[n] for n in g) for g in groups)
    assert load == [112, 114]  # largest first onto the lighter group: a + d, b + c
    assert _groups(sizes, 8) and len(_groups(sizes, 8)) == 4  # never more groups than owners


def test_source_weights_read_into_the_given_buffers(tmp_path):
    """A copied tensor (fp4 expert, fp8 weight and scale) comes back as a view of a buffer from `alloc`
    (no second host copy), with the bytes of the default read. Planted fault it catches: alloc ignored."""
    write_checkpoint(tmp_path, TINY, seed=0, quantized=True, vision=False)
    names = ["layers.0.ffn.experts.3.w1.weight", "layers.0.ffn.experts.3.w1.scale", "layers.0.attn.wq_a.weight",
             "layers.0.attn.wo_a.weight", "layers.0.attn_norm.weight"]  # fmt: skip
    plain = SourceWeights(tmp_path)
    given = SourceWeights(tmp_path)
    buffers: list[torch.Tensor] = []

    def alloc(n: int) -> torch.Tensor:
        buffers.append(torch.empty(n, dtype=torch.uint8))
        return buffers[-1]

    given.alloc = alloc
    try:
        a, b = plain(names), given(names)
    finally:
        plain.close()
        given.close()
    for n in names:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
        assert torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)), n
    starts = {buf.data_ptr() for buf in buffers}
    for n in names[:3]:
        assert b[n].data_ptr() in starts, n
    assert b["layers.0.attn.wo_a.weight"].data_ptr() not in starts  # dequantized: a new tensor


def test_host_feed_waits_for_every_read(tmp_path):
    write_checkpoint(tmp_path, TINY, seed=0, quantized=True, vision=False)
    weights = SourceWeights(tmp_path)
    timing = UnitTiming("layers.0")
    try:
        got = HostFeed(weights).take("0:layers.0", {"layers.0.attn_norm.weight": 1}, timing)
    finally:
        weights.close()
    assert list(got) == ["layers.0.attn_norm.weight"]
    assert timing.read_s > 0 and timing.wait_s == timing.read_s and timing.bytes_read == TINY.dim * 2
