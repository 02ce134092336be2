"""The streaming writer: output bytes do not depend on chunk size, stash budget or worker count."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import processes_with_open
from slow_writes import slow_pwrites
from tiny_ckpt import make_tiny

from dsv41_convert.convert.execute import execute, select_files
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.convert.write import write_rank_file
from dsv41_convert.store.file_digest import sha256_file
from dsv41_convert.store.lock import FILE_LOCK_DIR, LOCK_NAME
from dsv41_convert.store.sink import THROTTLE_ENV


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("s") / "bf16", quantized=False)


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_bytes_independent_of_chunk_and_stash(bf16_src, tmp_path, expert_dtype):
    plan = build_plan(bf16_src, 2, expert_dtype)
    rf = plan.files[1]
    q = quantizer_for("cpu")
    runs = {}
    for label, chunk, stash in (("big", 64 << 20, 256 << 20), ("small", 3000, 256 << 20), ("recompute", 3000, 0)):
        out = tmp_path / label
        out.mkdir()
        size, sha = write_rank_file(rf, bf16_src, out, q, chunk_bytes=chunk, stash_bytes=stash)
        assert size == rf.nbytes == (out / rf.file).stat().st_size
        assert not list(out.glob("*.partial"))
        runs[label] = sha
    assert len(set(runs.values())) == 1, runs


def test_progress_reaches_total(bf16_src, tmp_path):
    plan = build_plan(bf16_src, 1)
    seen = []
    write_rank_file(plan.files[0], bf16_src, tmp_path, quantizer_for("cpu"), lambda *a: seen.append(a))
    assert seen[-1] == (plan.files[0].file, plan.files[0].nbytes, plan.files[0].nbytes)


def test_ranks_selection(bf16_src):
    plan = build_plan(bf16_src, 4)
    assert [f.rank for f in select_files(plan, [3, 1], {})] == [1, 3]
    with pytest.raises(Exception, match="out of range"):
        select_files(plan, [4], {})


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set, RANK is not: torchrun sets both"),
        ({"RANK": "1"}, "RANK=1 is set, WORLD_SIZE is not"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3, WORLD_SIZE=2: RANK must be in 0..WORLD_SIZE-1"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x', WORLD_SIZE='2': not whole numbers"),
    ],
)
def test_a_torchrun_environment_no_launch_sets_is_refused(bf16_src, env, said):
    """WORLD_SIZE alone made `shard` write every other rank file and exit 0; RANK 3 of 2 wrote nothing and
    exited 0; RANK=x was a ValueError traceback (an audit)."""
    from dsv41_convert.errors import ConfigError

    plan = build_plan(bf16_src, 4)
    with pytest.raises(ConfigError, match=re.escape(said)):
        select_files(plan, None, env)
    assert [f.rank for f in select_files(plan, None, {"RANK": "1", "WORLD_SIZE": "2"})] == [1, 3]


def test_direct_io_writes_the_same_files(bf16_src, tmp_path):
    """`shard --direct-io` (O_DIRECT appends, or the buffered fallback where refused) and the default
    buffered writes give the same rank files."""
    plan = build_plan(bf16_src, 2)
    on_disk = []
    for direct in (False, True):
        out = tmp_path / str(direct)
        listed = json.loads(Path(execute(plan, out, direct_io=direct)["manifest"]).read_text())["files"]
        assert all(sha256_file(out / name) == rec["sha256"] for name, rec in listed.items())  # read back
        on_disk.append(listed)
    assert on_disk[0] == on_disk[1] and {f.file for f in plan.files} <= set(on_disk[0])


def test_progress_counts_parts_written_ahead_when_written(bf16_src):
    """With no stash every later group part is written ahead: the bar counts those bytes as they are
    written, so it reaches the total before their read-back and never goes back."""
    rf = build_plan(bf16_src, 2).files[1]
    out = bf16_src.parent / "progress-ahead"
    out.mkdir(exist_ok=True)
    seen: list[int] = []
    write_rank_file(rf, bf16_src, out, quantizer_for("cpu"), lambda _f, d, _t: seen.append(d), 3000, 0)
    assert seen == sorted(seen) and seen[-1] == rf.nbytes
    assert seen.count(rf.nbytes) > 1  # the read-back of the parts written ahead adds nothing


def test_direct_io_copies_from_the_read_buffers_without_a_copy(tmp_path, monkeypatch):
    """With O_DIRECT, copied chunks go to the device from the buffers they were read into (placed at the
    file position's skew within a block); pwrites slowed to 5 ms each: a buffer refilled before its
    write finished would change the bytes."""
    from dsv41_convert.store import direct_write

    src = make_tiny(tmp_path / "pub", quantized=True)
    rf = build_plan(src, 2).files[1]
    through = []
    real_through = direct_write.DirectAppender._write_through
    monkeypatch.setattr(direct_write, "THROUGH_BYTES", 2 * direct_write.BLOCK)
    slow_pwrites(monkeypatch, 0.005)

    def counted(appender, view):
        through.append(len(view))
        real_through(appender, view)

    monkeypatch.setattr(direct_write.DirectAppender, "_write_through", counted)
    shas = {}
    for direct in (False, True):
        out = tmp_path / f"out{direct}"
        out.mkdir()
        shas[direct] = write_rank_file(rf, src, out, quantizer_for("cpu"), chunk_bytes=40000, direct_io=direct)[1]
        assert sha256_file(out / rf.file) == shas[direct]
    assert shas[True] == shas[False]
    probe = direct_write.DirectAppender(tmp_path / "probe")
    refused = probe.direct_fd < 0
    probe.abort()
    if refused:
        pytest.skip("this file system refuses O_DIRECT: the buffered path ran twice")
    assert len(through) > 10 and sum(through) > rf.nbytes // 2


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
@pytest.mark.parametrize("ranks", [None, [0, 1]])
def test_workers_hold_the_runs_locks(bf16_src, tmp_path, monkeypatch, ranks):
    """Each worker process has the run's lock files open (the same open files: die_with.SharedFiles), so a
    run killed with kill -9 keeps its locks until its last worker is gone (tests/unit/test_lock.py)."""
    # each file outlasts a worker's start: on a loaded box one worker wrote both of [0, 1] (a flake)
    monkeypatch.setenv(THROTTLE_ENV, "0.01")
    plan, out = build_plan(bf16_src, 4), tmp_path / "out"
    locks = [out / LOCK_NAME] + [out / FILE_LOCK_DIR / f"model{r}-mp4.safetensors.lock" for r in ranks or ()]
    seen: list[list[set[int]]] = []
    summary = execute(
        plan, out, workers=2, ranks=ranks, progress=lambda *a: seen.append([processes_with_open(p) for p in locks])
    )
    workers = {t["worker"] for t in summary["timeline"]}
    assert len(workers) == 2 and os.getpid() not in workers
    for i in range(len(locks)):
        assert workers <= set().union(*(s[i] for s in seen)), locks[i]


_INTERRUPTED_EARLY = """
import multiprocessing as mp, os, signal, sys, time
from dsv41_convert.convert.die_with import start_fork_server
ctx = mp.get_context("forkserver")
ctx.set_forkserver_preload(["dsv41_convert.convert.die_with"])
start_fork_server()
p = ctx.Process(target=time.sleep, args=(60,))
p.start()
time.sleep(1.0)
os.kill(p.pid, signal.SIGINT)
p.join(20)
print(p.exitcode)
"""


def test_ctrl_c_before_a_worker_sets_its_handler_ends_it_quietly():
    """A worker forked by the run's fork server that gets SIGINT before its initializer ran (the run forwards
    Ctrl-C to every worker at once) printed "Process ForkServerProcess-1: Traceback ... KeyboardInterrupt"
    under the run's own message; now it exits 130 without a word."""
    import subprocess
    import sys

    from cli_run import default_sigint

    # SIGINT at its default: the suite's own may be ignored (a background job), which the fork server keeps
    res = subprocess.run([sys.executable, "-c", _INTERRUPTED_EARLY], capture_output=True, text=True, timeout=120,
                         preexec_fn=default_sigint)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["130"] and "Traceback" not in res.stderr, (res.stdout, res.stderr)


_INTERRUPTED_IN_A_CALLBACK = """
import os, signal, time, weakref
from dsv41_convert.convert import die_with
signal.signal(signal.SIGINT, die_with._exit_on_interrupt)  # a forked worker's, before its initializer
class ModuleLock: pass
lock = ModuleLock()
def callback(ref):  # importlib's module-lock callback, where CI's worker took the run's SIGINT
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
ref = weakref.ref(lock, callback)
del lock
print("ran on")
"""


def test_ctrl_c_inside_a_weakref_callback_before_a_worker_sets_its_handler_ends_it_quietly():
    """Raised there, the SystemExit the handler used was printed ("Exception ignored in: <function
    _get_module_lock.<locals>.cb ...") under the run's message and dropped, and the worker ran on (CI)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _INTERRUPTED_IN_A_CALLBACK], capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (130, "", "")
