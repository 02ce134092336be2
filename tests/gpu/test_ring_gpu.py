"""`shard --device cuda` of a bf16 source through the pinned rings (convert/ring.py): the rank files equal
the CPU path's, and the pinned memory the process holds is the two rings, allocated once per run.

Planted faults it catches: a ring region read into while its H2D copy still runs, or a staging region
reused before its D2H copy lands (bytes differ, most likely with the small rings that wrap every few
pieces); a buffer allocated per block again (pinned bytes above the rings, or growing with a second run).
"""

from pathlib import Path

import pytest
import torch

from dsv41_convert.convert import ring, stream, write
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("ring-gpu") / "bf16"
    write_checkpoint(src, TINY, seed=7, quantized=False)
    return src


def _shard(src: Path, out: Path, device: str) -> list[bytes]:
    plan = build_plan(src, 2)
    out.mkdir(parents=True)
    quantizer = quantizer_for(device)
    for rf in plan.files:
        write.write_rank_file(rf, src, out, quantizer)
    return [(out / rf.file).read_bytes() for rf in plan.files]


def _pinned_bytes() -> int:
    """Bytes of pinned blocks torch's caching host allocator owns (in use + cached)."""
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


@pytest.mark.parametrize(
    "ring_bytes, staging_bytes",
    [(write.READ_AHEAD_BYTES, stream.STAGING_BYTES), (64 << 10, 64 << 10)],
    ids=["default rings", "64 KiB rings: wraps, pieces read alone, pageable D2H"],
)
def test_cuda_shard_through_the_rings_equals_cpu(bf16_src, tmp_path, monkeypatch, ring_bytes, staging_bytes):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(write, "READ_AHEAD_BYTES", ring_bytes)
    monkeypatch.setattr(stream, "STAGING_BYTES", staging_bytes)
    monkeypatch.setattr(stream, "_staging", None)  # a staging ring of this size
    cpu = _shard(bf16_src, tmp_path / "cpu", "cpu")
    carved = []
    real_carve = ring.HostRing.carve

    def carve(self, nbytes):
        got = real_carve(self, nbytes)
        carved.append((self.size, got is not None))
        return got

    monkeypatch.setattr(ring.HostRing, "carve", carve)
    cuda = _shard(bf16_src, tmp_path / "cuda", "cuda")
    assert [len(b) for b in cuda] == [len(b) for b in cpu]
    for r, (a, b) in enumerate(zip(cpu, cuda, strict=True)):
        assert a == b, f"rank {r}: cuda bytes differ from cpu"
    assert any(size == ring_bytes and ok for size, ok in carved), "the Prefetch never read into its ring"
    assert any(size == staging_bytes and ok for size, ok in carved), "no D2H copy landed in the staging ring"


def test_pinned_memory_is_the_rings_allocated_once(bf16_src, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("torch has no host_memory_stats")
    torch.cuda.init()
    stream.drop_cached_pinned()
    before = _pinned_bytes()
    _shard(bf16_src, tmp_path / "a", "cuda")
    first = _pinned_bytes()
    _shard(bf16_src, tmp_path / "b", "cuda")
    second = _pinned_bytes()
    budget = write.READ_AHEAD_BYTES + stream.STAGING_BYTES
    print(f"pinned bytes: before {before}, after one shard {first}, after two {second}; rings {budget}")
    assert first - before <= budget, (before, first, budget)
    assert second == first  # the rings are reused, nothing per block stays cached
