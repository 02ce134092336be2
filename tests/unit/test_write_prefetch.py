"""Source prefetch: while tensor i is written, the kernel is asked for the next tensors' source bytes,
never more than the budget ahead, and the output does not depend on it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert import write
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.store.safetensors_header import DTYPE_BITS, nbytes


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("s") / "fp8", quantized=True)


def _region(rd) -> tuple[str, int, int]:
    """(file, start, end) of the whole rows a read covers."""
    row = nbytes(rd.dtype, rd.shape[1:]) if rd.shape else DTYPE_BITS[rd.dtype] // 8
    return rd.file, rd.offset + rd.r0 * row, rd.offset + rd.r1 * row


def _record(monkeypatch, events: list) -> None:
    """Note every WILLNEED hint and every source read, in order, by file name."""
    real_fadvise, real_pread = os.posix_fadvise, write.pread_exact

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            events.append(("hint", Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset, offset + length))
        return real_fadvise(fd, offset, length, advice)

    def pread(fd, buf, offset, label):
        events.append(("read", Path(label).name, offset, offset + len(buf)))
        return real_pread(fd, buf, offset, label)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(write, "pread_exact", pread)


@pytest.mark.parametrize("budget", [1 << 12, 1 << 20, 0])
def test_hints_come_before_the_reads_and_stay_within_budget(src, tmp_path, monkeypatch, budget):
    rf = build_plan(src, 2).files[0]
    events: list = []
    _record(monkeypatch, events)
    monkeypatch.setattr(write, "PREFETCH_BYTES", budget)
    size, sha = write.write_rank_file(rf, src, tmp_path, quantizer_for("cpu"))
    hints = [e[1:] for e in events if e[0] == "hint"]
    reads = [e for e in events if e[0] == "read"]
    assert reads
    if not budget:  # only the copy loop's own next-chunk hints, inside a tensor
        assert all(any(h[0] == r[1] and h[1] == r[2] for r in reads) for h in hints)
        return
    first_regions = {_region(rd) for rd in rf.tensors[0].reads}
    for k, (_, file, start, _) in enumerate(reads):
        before = [h for e in events[: events.index(reads[k])] if e[0] == "hint" for h in [e[1:]]]
        owner = next(rd for t in rf.tensors for rd in t.reads if _region(rd)[0] == file and
                     _region(rd)[1] <= start < _region(rd)[2])  # fmt: skip
        if _region(owner) in first_regions:
            continue  # tensor 0 is read before anything could be hinted
        assert any(f == file and a <= start < b for f, a, b in before), (file, start)
    # hinted and not yet read: never more than the budget plus one tensor's regions (each capped at it)
    per_tensor = max(len(t.reads) for t in rf.tensors)
    started: set[tuple[str, int, int]] = set()
    outstanding: dict[tuple[str, int, int], int] = {}
    most = 0
    for kind, file, a, b in events:
        if kind == "read":
            started |= {r for r in outstanding if r[0] == file and r[1] <= a < r[2]}
            most = max(most, sum(n for r, n in outstanding.items() if r not in started))
        else:
            region = next((r for t in rf.tensors for rd in t.reads for r in [_region(rd)] if r[:2] == (file, a)), None)
            if region is not None and region not in started:
                outstanding[region] = b - a
    assert 0 < most <= budget + per_tensor * budget
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.setattr(write, "PREFETCH_BYTES", 0)
    assert write.write_rank_file(rf, src, plain, quantizer_for("cpu")) == (size, sha)
