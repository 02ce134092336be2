"""store/lock.py: one writer per folder. flock is per open file description on Linux, so two `hold`s in this
process conflict exactly as two processes would; dead holders are real processes killed with SIGKILL."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dsv41_convert.errors import LockedError, OutputError
from dsv41_convert.store import lock as lock_mod
from dsv41_convert.store.lock import FILE_LOCK_DIR, LOCK_NAME, hold, read_holders, refuse_held, take


def test_second_exclusive_holder_is_refused_with_the_holder_named(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", "shard", "src", "out", "--tp", "2"])
    with hold(tmp_path):
        with pytest.raises(LockedError) as info:
            with hold(tmp_path):
                pass
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path.resolve()}: in use by pid {os.getpid()} on {socket.gethostname()}, since ")
    assert "UTC (dsv41-convert shard src out --tp 2)" in msg


def test_a_lock_file_a_full_disk_cannot_take_is_named_and_left_unheld(tmp_path, monkeypatch):
    """A folder on a full disk: every writing command said `error: No space left on device`, no path (an
    audit: the holder's line written into the lock file failed unwrapped). Now the folder and the lock file
    are named, and the lock is not held after it."""
    real = os.write

    def full(fd, data):
        if data.startswith(b"{"):  # the holder's line
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(lock_mod.os, "write", full)
    with pytest.raises(OutputError) as info:
        with hold(tmp_path):
            pass
    assert str(info.value) == f"{tmp_path.resolve()}: cannot write the lock file {LOCK_NAME} (No space left on device)"
    monkeypatch.setattr(lock_mod.os, "write", real)
    with hold(tmp_path):
        pass


def test_exclusive_release_removes_the_file_and_frees_the_folder(tmp_path):
    with hold(tmp_path):
        (holder,) = read_holders((tmp_path / LOCK_NAME).read_bytes())
        assert (holder.pid, holder.mode) == (os.getpid(), "exclusive")
    assert not (tmp_path / LOCK_NAME).exists()
    with hold(tmp_path) as again:
        assert again.stale == []


def test_shares_with_disjoint_files_run_together_and_the_same_file_collides(tmp_path):
    with hold(tmp_path, shared=True, files=["model0-mp2.safetensors"]):
        with hold(tmp_path, shared=True, files=["model1-mp2.safetensors"]) as second:
            assert set(second.files) == {"model1-mp2.safetensors"}
            with pytest.raises(LockedError, match=rf"{tmp_path.resolve()}/model0-mp2.safetensors: in use by pid"):
                with hold(tmp_path, shared=True, files=["model1-mp2.safetensors", "model0-mp2.safetensors"]):
                    pass
            with pytest.raises(LockedError, match=rf"{tmp_path.resolve()}: in use by pid {os.getpid()}"):
                with hold(tmp_path):  # a manifest merge needs the folder alone
                    pass
        # the refused holder released what it had taken: model1's lock is free again
        with hold(tmp_path, shared=True, files=["model1-mp2.safetensors"]):
            pass
    assert not list((tmp_path / FILE_LOCK_DIR).glob("*.lock"))
    assert not (tmp_path / LOCK_NAME).exists()  # the last share removed it


def test_share_is_refused_while_an_exclusive_holder_writes(tmp_path):
    with hold(tmp_path):
        with pytest.raises(LockedError, match="in use by"):
            with hold(tmp_path, shared=True, files=["model0-mp2.safetensors"]):
                pass


def test_a_finished_share_is_not_named_as_a_holder(tmp_path):
    """Shared holders leave their line; a line of a process that is gone is skipped in the message."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    line = {"pid": dead.pid, "host": socket.gethostname(), "command": "gone", "started": "x", "mode": "shared"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(line) + "\n")
    with hold(tmp_path, shared=True):
        with pytest.raises(LockedError) as info:
            with hold(tmp_path):
                pass
    assert f"pid {os.getpid()}" in str(info.value) and "gone" not in str(info.value)


_HOLD_AND_WAIT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dsv41_convert.store.lock import hold
    with hold(Path(sys.argv[1]), shared=sys.argv[2] == "shared", files=sys.argv[3:]):
        print("held", flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("mode", ["exclusive", "shared"])
def test_lock_of_a_killed_holder_is_taken_over(tmp_path, mode):
    """kill -9 leaves the lock file and its holder's line; the kernel dropped the lock, so the next run takes it."""
    files = ["model0-mp2.safetensors"] if mode == "shared" else []
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_AND_WAIT, str(tmp_path), mode, *files], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"held\n"
        with pytest.raises(LockedError, match=f"in use by pid {proc.pid} on"):
            with hold(tmp_path, shared=True, files=["model0-mp2.safetensors"]):
                pass
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (tmp_path / LOCK_NAME).exists()
    with hold(tmp_path, shared=mode == "shared", files=files) as taken:
        # the dead run's exclusive lock (the folder, or its rank file) is reported as taken over
        assert [h.pid for h in taken.stale] == [proc.pid]


def test_a_lock_file_removed_between_open_and_flock_is_not_trusted(tmp_path, monkeypatch):
    """The previous holder releasing (unlink, close) between our open and flock: we would hold a lock on a file
    nobody else can find. take() must notice and lock the file at the path instead."""
    real_flock = lock_mod.fcntl.flock
    calls = []

    def flock_after_release(fd, op):
        if not calls:
            (tmp_path / LOCK_NAME).unlink()  # what the previous holder's release does
        calls.append(op)
        return real_flock(fd, op)

    (tmp_path / LOCK_NAME).write_text("")
    monkeypatch.setattr(lock_mod.fcntl, "flock", flock_after_release)
    with hold(tmp_path) as held:
        st, own = os.stat(tmp_path / LOCK_NAME), os.fstat(held.lock.fd)
        assert (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
        assert len(calls) == 2
        monkeypatch.setattr(lock_mod.fcntl, "flock", real_flock)
        with pytest.raises(LockedError):
            with hold(tmp_path):
                pass


def test_file_system_without_locks_is_refused(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(lock_mod.fcntl, "flock", no_locks)
    with pytest.raises(OutputError, match=rf"{tmp_path.resolve()}: the file system does not support locks"):
        with hold(tmp_path):
            pass


_RUN_WITH_A_WORKER = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from pathlib import Path
    from dsv41_convert.convert.die_with import SharedFiles
    from dsv41_convert.store.lock import hold

    def linger(locks, seconds):  # a worker that outlives its run (it does not die with it)
        print("worker", flush=True)
        time.sleep(seconds)

    if __name__ == "__main__":
        folder, method, seconds, mode, *files = sys.argv[1:]
        with hold(Path(folder), shared=mode == "shared", files=files) as held:
            locks = SharedFiles(held.descriptors())
            worker = mp.get_context(method).Process(target=linger, args=(locks, float(seconds)))
            worker.start()
            print(worker.pid, flush=True)
            time.sleep(600)
    """
)


def _killed_run_with_a_lingering_worker(tmp_path, method: str, seconds: float, mode: str = "exclusive",
                                        files: tuple[str, ...] = ()) -> tuple[int, int]:  # fmt: skip
    """A run holding tmp_path/out that started a worker (sharing its lock), killed with kill -9; the worker
    lives on for `seconds`. -> (run pid, worker pid)"""
    script = tmp_path / "run.py"
    script.write_text(_RUN_WITH_A_WORKER)
    (tmp_path / "out").mkdir()
    args = [sys.executable, str(script), str(tmp_path / "out"), method, str(seconds), mode, *files]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE)
    lines = {proc.stdout.readline().strip(), proc.stdout.readline().strip()}
    assert b"worker" in lines
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc.pid, int((lines - {b"worker"}).pop())


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a zombie holds no descriptors)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _exited(pid: int, grace_s: float = 0.2) -> bool:
    """Whether `pid` is gone or a zombie within `grace_s`: an exiting process drops its locks when it closes
    its files, a moment before it becomes a zombie (on a busy machine, milliseconds), so a lock can be free
    while /proc still shows the process running."""
    deadline = time.monotonic() + grace_s
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
@pytest.mark.parametrize(
    ("method", "mode"), [("spawn", "exclusive"), ("forkserver", "exclusive"), ("forkserver", "shared")]
)
def test_a_killed_runs_worker_holds_its_lock_until_it_exits(tmp_path, capfd, monkeypatch, method, mode):
    """A run's workers die a moment after a kill -9 of the run: until they have, the next run must not write
    beside them. It waits for them (saying so once the wait passes ORPHANS_NOTICE_S), then takes the lock
    over."""
    files = ("model0-mp2.safetensors",) if mode == "shared" else ()
    monkeypatch.setattr(lock_mod, "ORPHANS_NOTICE_S", 0.1)  # the worker's 1.5 s may be half over by the take
    run, worker = _killed_run_with_a_lingering_worker(tmp_path, method, 1.5, mode, files)
    assert _running(worker)
    capfd.readouterr()
    t0 = time.monotonic()
    with hold(tmp_path / "out", shared=mode == "shared", files=files) as taken:
        assert _exited(worker)  # the worker sleeps 1.5 s: a take before its exit leaves it running far longer
        assert [h.pid for h in taken.stale] == [run]
    assert time.monotonic() - t0 > 0.5
    told = [line for line in capfd.readouterr().err.splitlines() if "waiting for processes it started" in line]
    assert len(told) == 1 and f"pid {run} on" in told[0], told


def test_a_dead_runs_processes_holding_the_lock_too_long_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_mod, "ORPHANS_WAIT_S", 0.3)
    run, worker = _killed_run_with_a_lingering_worker(tmp_path, "spawn", 60)
    try:
        with pytest.raises(LockedError, match=rf"pid {run} on .* ended, but processes it started still hold the lock"):
            with hold(tmp_path / "out"):
                pass
    finally:
        os.kill(worker, signal.SIGKILL)


def test_the_file_locks_folder_goes_with_the_last_share(tmp_path):
    """A share refused at its start (another share's rank file, foreign files in OUT) left an empty
    `.dsv41-convert` behind, and the next plain run was refused as "not empty (.dsv41-convert)". The folder
    goes with the last file lock now, unless it holds more (a done record); a share whose folder another
    share's exit removed between its making it and its lock makes it again."""
    with hold(tmp_path, shared=True, files=["model0-mp2.safetensors"]):
        with hold(tmp_path, shared=True, files=["model1-mp2.safetensors"]):
            pass
        assert (tmp_path / FILE_LOCK_DIR / "model0-mp2.safetensors.lock").is_file()  # the first share's stays
    assert list(tmp_path.iterdir()) == []
    with hold(tmp_path, shared=True, files=["model0-mp2.safetensors"]):
        (tmp_path / FILE_LOCK_DIR / "model0-mp2.safetensors.done.json").write_text("{}")
    assert [p.name for p in (tmp_path / FILE_LOCK_DIR).iterdir()] == ["model0-mp2.safetensors.done.json"]
    (tmp_path / "other").mkdir()
    lock = take(tmp_path / "other" / FILE_LOCK_DIR / "x.lock", True, "x")  # its folder gone meanwhile
    lock.release()
    assert (tmp_path / "other" / FILE_LOCK_DIR).is_dir()
    with pytest.raises(OutputError, match="cannot create the lock file"):  # a lock file of a missing folder
        take(tmp_path / "missing" / "x.lock", True, "x")


def test_refuse_held_says_what_hold_would_without_holding(tmp_path):
    """A --dry-run's probe: LockedError where `hold` would raise it, and nothing created or kept locked."""
    refuse_held(tmp_path)
    refuse_held(tmp_path, shared=True, files=["model0-mp2.safetensors"])
    assert list(tmp_path.iterdir()) == []
    with hold(tmp_path, shared=True, files=["model0-mp2.safetensors"]):
        refuse_held(tmp_path, shared=True, files=["model1-mp2.safetensors"])  # a share beside it: no conflict
        with pytest.raises(LockedError, match=rf"{tmp_path.resolve()}/model0-mp2.safetensors: in use by pid"):
            refuse_held(tmp_path, shared=True, files=["model0-mp2.safetensors"])
        with pytest.raises(LockedError, match=rf"{tmp_path.resolve()}: in use by pid {os.getpid()}"):
            refuse_held(tmp_path)
        with hold(tmp_path, shared=True, files=["model1-mp2.safetensors"]):  # the probes kept nothing locked
            pass
    with hold(tmp_path):
        with pytest.raises(LockedError, match=rf"{tmp_path.resolve()}: in use by pid {os.getpid()}"):
            refuse_held(tmp_path, shared=True, files=["model1-mp2.safetensors"])
    with hold(tmp_path):  # free again
        pass


def test_refuse_held_lets_a_lock_of_a_dead_runs_workers_be(tmp_path):
    """A lock whose named holders are all gone is held only by their workers, which end with them: the run waits
    for it (up to ORPHANS_WAIT_S) and goes ahead, so its dry run does not refuse it; a live holder is refused."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    line = {"pid": dead.pid, "host": socket.gethostname(), "command": "gone", "started": "x", "mode": "exclusive"}
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
        fcntl.flock(fd, fcntl.LOCK_EX)  # the dead run's worker, sharing its descriptor
        refuse_held(tmp_path)
        os.write(fd, (json.dumps(line | {"pid": os.getpid()}) + "\n").encode())
        with pytest.raises(LockedError, match=rf"in use by pid {os.getpid()} on "):
            refuse_held(tmp_path)
    finally:
        os.close(fd)


def test_a_lock_file_that_cannot_be_removed_leaves_the_runs_own_error(tmp_path, monkeypatch):
    """OUT made read-only while a shard ran (chmod a-w): the release's unlink of the lock file failed too, and its
    PermissionError replaced the run's own (`error: OUT/.dsv41-convert.lock: Permission denied` where a rank
    file could not be written: a black-box hunt). The lock file stays, held by no one: the next run takes it."""
    real = lock_mod.Path.unlink

    def refused(self, missing_ok=False):
        if self.name == LOCK_NAME:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, missing_ok=missing_ok)

    monkeypatch.setattr(lock_mod.Path, "unlink", refused)
    with pytest.raises(OutputError, match="the run's own error"):
        with hold(tmp_path):
            raise OutputError("the run's own error")
    with hold(tmp_path):  # a run that ends well ends so, the lock file left behind
        pass
    monkeypatch.setattr(lock_mod.Path, "unlink", real)
    with hold(tmp_path) as again:
        assert again.lock.fd >= 0


def test_a_folder_renamed_meanwhile_keeps_the_lock_of_the_run_now_at_its_path(tmp_path):
    """OUT renamed while a run held it and a new run started at the old path: the first run's release removed
    the lock file at the path, the second run's, and a third writer could then join the second."""
    out, moved = tmp_path / "out", tmp_path / "moved"
    out.mkdir()
    first = hold(out)
    first.__enter__()
    out.rename(moved)
    out.mkdir()
    with hold(out):
        first.__exit__(None, None, None)
        assert (out / LOCK_NAME).exists()
        with pytest.raises(LockedError):
            with hold(out):
                pass
