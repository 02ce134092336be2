"""Mid-file resume and compute-once groups: an interrupted rank file goes on from its last verified
checkpoint (journal.py) and ends byte-identical to an uninterrupted run; a bad partial or journal restarts
the file; a two-output action whose later part does not fit the stash is computed once (written ahead)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
from quant_testing import CountingQuantizer

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.write import _chunk_rows, write_partial, write_rank_file
from dsv41_convert.errors import OutputError
from dsv41_convert.store import sink as sink_module
from dsv41_convert.store.journal import journal_path
from dsv41_convert.store.sink import Sink

CHUNK, JOURNAL = 1 << 12, 1 << 13  # many chunks and checkpoints in a 7.5 MB rank file


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory) -> Path:
    """`dsv41-convert make-tiny OUT --source-dtype bf16 --seed 3`: Engram tables of 6229 / 6708 rows at tp 2."""
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import write_checkpoint

    out = tmp_path_factory.mktemp("src") / "bf16"
    write_checkpoint(out, PRESETS["tiny"], seed=3, quantized=False)
    return out


@pytest.fixture(scope="module")
def clean(bf16_src, tmp_path_factory) -> Path:
    """An uninterrupted tp-2 run with the default chunk, stash and journal sizes."""
    out = tmp_path_factory.mktemp("clean") / "out"
    execute(build_plan(bf16_src, 2), out)
    return out


def _interrupt(rf, src, out, stop: int | float, stash: int = 256 << 20, digest: str = "d") -> None:
    """Ctrl-C at quantizer call `stop` (an int), or once the writer has been handed that fraction of the
    file in file order (a float: parts written ahead do not count until they are read back)."""
    after_chunk = Sink._after_chunk

    def stop_at_fraction(sink):
        after_chunk(sink)
        if isinstance(stop, float) and sink.queued > stop * rf.nbytes:
            raise KeyboardInterrupt

    q = CountingQuantizer(stop if isinstance(stop, int) else None)
    with pytest.raises(KeyboardInterrupt), mock.patch.object(Sink, "_after_chunk", stop_at_fraction):
        write_partial(rf, src, out, q, chunk_bytes=CHUNK, stash_bytes=stash, plan_digest=digest,
                      journal_bytes=JOURNAL)  # fmt: skip
    assert (out / (rf.file + ".partial")).exists() and journal_path(out, rf.file).exists()


def _resume(rf, src, out, stash: int = 256 << 20, digest: str = "d") -> tuple[dict, CountingQuantizer]:
    stats, q = {}, CountingQuantizer()
    write_rank_file(rf, src, out, q, chunk_bytes=CHUNK, stash_bytes=stash, plan_digest=digest, resume=True,
                    journal_bytes=JOURNAL, stats=stats)  # fmt: skip
    assert not journal_path(out, rf.file).exists() and not (out / (rf.file + ".partial")).exists()
    return stats, q


STOPS = [  # (stash bytes, quantizer call of 457 or fraction of the file's bytes); the quick subset has two
    pytest.param(0, 250, id="write-ahead-in-scales"),
    pytest.param(0, 0.6, id="write-ahead-in-weights"),
    pytest.param(0, 60, id="write-ahead-early", marks=pytest.mark.slow),
    pytest.param(0, 0.9, id="write-ahead-late", marks=pytest.mark.slow),
    *(pytest.param(256 << 20, stop, id=f"stash-{stop}", marks=pytest.mark.slow) for stop in (60, 250, 0.6, 0.9)),
]


@pytest.mark.parametrize(("stash", "stop"), STOPS)
def test_ctrl_c_then_resume_goes_on_mid_file(bf16_src, clean, tmp_path, stash, stop):
    """Interrupted at several points (inside the scales, where the groups are computed, and inside the
    weights, where written-ahead parts are read back), with the later group parts stashed or written
    ahead: the resumed file is byte-identical and, written ahead, only the rest is computed."""
    rf = build_plan(bf16_src, 2).files[1]
    _interrupt(rf, bf16_src, tmp_path, stop, stash)
    stats, q = _resume(rf, bf16_src, tmp_path, stash)
    assert 0 < stats["resumed_from"] < rf.nbytes, stats
    assert (tmp_path / rf.file).read_bytes() == (clean / rf.file).read_bytes()
    if stash == 0:  # a stash dies with the process; parts written ahead are kept and verified
        assert sum(q.calls.values()) < _total_calls(rf), "resume recomputed everything"
        if isinstance(stop, float):  # stopped in the weights: everything was computed before
            assert not q.calls, q.calls
    else:
        assert sum(q.calls.values()) <= _total_calls(rf)


@pytest.mark.parametrize("stop", [250, 0.6])
def test_resume_with_every_chunk_hashed_beside_its_write(bf16_src, clean, tmp_path, monkeypatch, stop):
    """The same, with every chunk (not only those of 1 MiB and more) hashed in the Sink's hasher thread
    while it is written: each checkpoint still records exactly the bytes hashed and written before it."""
    monkeypatch.setattr(sink_module, "HASH_APART_BYTES", 0)
    monkeypatch.setattr(sink_module, "HASH_THREAD_CORES", 1)
    rf = build_plan(bf16_src, 2).files[1]
    _interrupt(rf, bf16_src, tmp_path, stop, 0)
    stats, q = _resume(rf, bf16_src, tmp_path, 0)
    assert 0 < stats["resumed_from"] < rf.nbytes, stats
    assert (tmp_path / rf.file).read_bytes() == (clean / rf.file).read_bytes()
    assert sum(q.calls.values()) < _total_calls(rf), "resume recomputed everything"


def test_resume_inside_a_column_split_copy(tmp_path_factory, tmp_path):
    """A published (fp8) source at tp 2: wo_b is copied by columns (each rank's half of every row). Interrupted
    with a checkpoint inside it, the resumed file goes on from the journal's row, not from the tensor's first row
    again, and ends byte-identical to an uninterrupted run."""
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import write_checkpoint

    src = tmp_path_factory.mktemp("src") / "fp8"
    write_checkpoint(src, PRESETS["tiny"], seed=3, quantized=True)
    clean = tmp_path_factory.mktemp("clean") / "out"
    execute(build_plan(src, 2), clean)
    rf = build_plan(src, 2).files[1]
    columns = [t for t in rf.tensors if t.action == "copy" and t.reads[0].c1 >= 0]
    t = max(columns, key=lambda t: t.end - t.begin)
    assert t.end - t.begin >= 4 * JOURNAL, (t.name, t.end - t.begin)
    _interrupt(rf, src, tmp_path, (t.begin + t.end) / 2 / rf.nbytes)
    stats, _ = _resume(rf, src, tmp_path)
    assert t.begin < stats["resumed_from"] < t.end, (stats, t.name, t.begin, t.end)
    assert (tmp_path / rf.file).read_bytes() == (clean / rf.file).read_bytes()


def _total_calls(rf) -> int:
    return sum(math.ceil((t.reads[0].r1 - t.reads[0].r0) / _chunk_rows(t, CHUNK)) for t in rf.tensors
               if t.action.startswith("quant") and t.part == 0)  # fmt: skip


def test_tampered_partial_restarts_the_file(bf16_src, clean, tmp_path):
    rf = build_plan(bf16_src, 2).files[0]
    _interrupt(rf, bf16_src, tmp_path, 250)
    partial = tmp_path / (rf.file + ".partial")
    kept = [json.loads(x) for x in journal_path(tmp_path, rf.file).read_text().splitlines()][-1]["end"]
    with open(partial, "r+b") as f:  # one flipped byte inside the checkpointed prefix
        f.seek(kept // 2)
        byte = f.read(1)[0]
        f.seek(kept // 2)
        f.write(bytes([byte ^ 0x40]))
    stats, _ = _resume(rf, bf16_src, tmp_path)
    assert stats["resumed_from"] == 0 and "differ" in stats["resume"], stats
    assert (tmp_path / rf.file).read_bytes() == (clean / rf.file).read_bytes()


@pytest.mark.parametrize(
    "damage", ["middle-line", "torn-last-line", pytest.param("other-chunk-size", marks=pytest.mark.slow)]
)
def test_damaged_journal(bf16_src, clean, tmp_path, damage):
    """A corrupt line or another chunk size restarts the file; a torn last line (power loss while
    appending) only loses that checkpoint."""
    rf = build_plan(bf16_src, 2).files[0]
    _interrupt(rf, bf16_src, tmp_path, 250)
    jpath = journal_path(tmp_path, rf.file)
    lines = jpath.read_text().splitlines()
    assert len(lines) > 3
    if damage == "middle-line":
        lines[2] = lines[2][:-7]
    elif damage == "torn-last-line":
        lines[-1] = lines[-1][:20]
    else:
        lines[0] = lines[0].replace(f'"chunk_bytes": {CHUNK}', '"chunk_bytes": 1')
    jpath.write_text("\n".join(lines) + "\n")
    stats, _ = _resume(rf, bf16_src, tmp_path)
    assert (stats["resumed_from"] > 0) == (damage == "torn-last-line"), stats
    assert (tmp_path / rf.file).read_bytes() == (clean / rf.file).read_bytes()


def test_resume_with_other_options_is_refused_before_writing(bf16_src, tmp_path):
    plan = build_plan(bf16_src, 2)
    rf = plan.files[1]
    _interrupt(rf, bf16_src, tmp_path, 250, digest=plan.digest())
    with pytest.raises(OutputError, match=rf"{rf.file}\.partial: started by a run with other options"):
        execute(build_plan(bf16_src, 2, "fp8"), tmp_path, resume=True)
    assert not (tmp_path / plan.files[0].file).exists() and not (tmp_path / "config.json").exists()


def test_group_written_ahead_is_computed_once(bf16_src, clean, tmp_path):
    """A stash too small for any later part: each chunk of every quantizing action is computed once,
    and the file is byte-identical to the stashing run."""
    rf = build_plan(bf16_src, 2).files[0]
    q = CountingQuantizer()
    write_rank_file(rf, bf16_src, tmp_path, q, chunk_bytes=CHUNK, stash_bytes=0)
    assert (tmp_path / rf.file).read_bytes() == (clean / rf.file).read_bytes()
    engram = "layers.0.engram.embed.weight"
    for t in rf.tensors:
        if t.action.startswith("quant") and t.part == 0:
            want = math.ceil((t.reads[0].r1 - t.reads[0].r0) / _chunk_rows(t, CHUNK))
            assert q.calls[t.name] == want, (t.name, q.calls[t.name], want)
    assert q.calls[engram] == 49  # 6229 rows in chunks of 128


_KILLABLE = """
import sys
from pathlib import Path
from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
src, out, workers = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
execute(build_plan(src, 2), out, workers=workers, resume=True, chunk_bytes=1 << 12, journal_bytes=1 << 13)
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_kill_9_mid_file_then_resume(bf16_src, clean, tmp_path, workers):
    """kill -9 while rank files are half written: --resume keeps their verified prefixes, writes fewer
    bytes than the files hold, and ends byte-identical to the uninterrupted run. With 2 workers, one
    partial file is also tampered with inside its checkpointed prefix: that file alone starts again."""
    out = tmp_path / "out"
    env = {**os.environ, "DSV41_CONVERT_TEST_THROTTLE_S": "0.002"}
    args = [sys.executable, "-c", _KILLABLE, str(bf16_src), str(out), str(workers)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    journals = out / ".dsv41-convert"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        lines = [len(p.read_text().splitlines()) for p in journals.glob("*.journal")] if journals.exists() else []
        if len(lines) >= workers and min(lines) > 20:
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the parent and its worker processes, as a power cut would
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    partials = sorted(out.glob("*.partial"))
    assert len(partials) >= workers and not (out / "manifest.json").exists()
    tampered = None
    if workers == 2:
        tampered = partials[0].name.removesuffix(".partial")
        with open(partials[0], "r+b") as f:
            f.seek(1000)  # inside the header, written and checkpointed first
            byte = f.read(1)[0]
            f.seek(1000)
            f.write(bytes([byte ^ 0x01]))
    summary = execute(build_plan(bf16_src, 2), out, resume=True, workers=workers, chunk_bytes=CHUNK,
                      journal_bytes=JOURNAL)  # fmt: skip
    sizes = {p.name: p.stat().st_size for p in clean.glob("model*")}
    untouched = {p.name.removesuffix(".partial") for p in partials} - {tampered}
    assert set(summary["resumed"]) == untouched and all(v > 0 for v in summary["resumed"].values()), summary
    assert summary["bytes"] < sum(sizes[n] for n in summary["written"]), summary
    if tampered:
        assert summary["bytes"] >= sizes[tampered] and tampered in summary["written"]
    for name in sizes:
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name
    assert (
        json.loads((out / "manifest.json").read_text())["files"]
        == json.loads((clean / "manifest.json").read_text())["files"]
    )


def test_resume_with_other_compute_chunks_restarts_the_file(bf16_src, clean, tmp_path, monkeypatch):
    """A partial file begun on one device and resumed on another (CUDA computes rows in larger chunks, so
    a checkpoint's chunk index means other rows): the journal names its compute chunk size, so the file
    restarts from byte 0 instead of going on at the wrong rows."""
    from dsv41_convert.convert import write

    rf = build_plan(bf16_src, 2).files[1]
    _interrupt(rf, bf16_src, tmp_path, 0.6)
    other = 2 * write.COMPUTE_CHUNKS  # twice the CPU's compute chunk, as CUDA's larger one
    monkeypatch.setattr(write, "compute_chunk_bytes", lambda chunk_bytes, device: other * chunk_bytes)
    stats, _ = _resume(rf, bf16_src, tmp_path)
    assert stats["resumed_from"] == 0 and "chunk size" in stats["resume"], stats
    assert (tmp_path / rf.file).read_bytes() == (clean / rf.file).read_bytes()
