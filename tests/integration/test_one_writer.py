"""One writer per output folder, through the command line (store/lock.py): a second `shard` into a busy OUT
exits 2 naming the holder while the first finishes; shares of the ranks (--ranks, torchrun processes) write
one folder together, but never one rank file twice; `manifest` and `reference-logits` wait for nobody.
(kill -9 of the holder then --resume: test_faults.py::test_kill_9_then_resume_is_byte_identical.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import partial_sizes, run_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.store.lock import FILE_LOCK_DIR, LOCK_NAME, hold, read_holders

CLI = [sys.executable, "-m", "dsv41_convert.cli"]
SLOW = {**os.environ, "DSV41_CONVERT_TEST_THROTTLE_S": "0.01"}  # ~7 s of writing per tp-2 rank file


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("src") / "src")


@pytest.fixture(scope="module")
def clean(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "out"
    execute(build_plan(src, 2), out)
    return out


def _wait_for(cond, procs, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a run ended before {what}: {[p.communicate() for p in procs]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _holders(path: Path) -> list[int]:
    return [h.pid for h in read_holders(path.read_bytes())] if path.exists() else []


def _same_as_clean(out: Path, clean: Path) -> None:
    for f in sorted(clean.glob("model*-mp2.safetensors")):
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.slow
def test_second_shard_into_a_busy_out_exits_2_and_the_first_finishes(src, clean, tmp_path, monkeypatch, capsys):
    """The issue's case: a retried job starts `shard --resume` into the OUT a first run is still writing."""
    out = tmp_path / "out"
    first = subprocess.Popen([*CLI, "shard", str(src), str(out), "--tp", "2", "--json"], env=SLOW,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    _wait_for(lambda: first.pid in _holders(out / LOCK_NAME), [first], "the first run holds OUT")
    code, stdout, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--resume")
    assert code == 2 and stdout == ""
    assert f"error: {out.resolve()}: in use by pid {first.pid} on " in err and " since " in err
    assert f"shard {src} {out} --tp 2 --json)" in err  # the holder's command line
    assert first.poll() is None, "the refused run must not have disturbed the first"
    result, errors = first.communicate(timeout=300)
    assert first.returncode == 0, errors
    assert json.loads(result)["manifest"] and not (out / LOCK_NAME).exists()
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0
    _same_as_clean(out, clean)


@pytest.mark.slow
@pytest.mark.parametrize("launch", ["ranks", "torchrun"])
def test_disjoint_shares_write_one_folder_together(src, clean, tmp_path, monkeypatch, capsys, launch):
    """Two shares at once into one fresh OUT (no --resume): both finish. Meanwhile a third process that would
    write a rank file already being written, and a `manifest` merge, exit 2 naming the holders."""
    out = tmp_path / "out"
    shard = [*CLI, "shard", str(src), str(out), "--tp", "2", "--json"]
    if launch == "ranks":
        runs = [subprocess.Popen([*shard, "--ranks", str(r)], env=SLOW, stdout=subprocess.PIPE, text=True)
                for r in (0, 1)]  # fmt: skip
    else:  # what torchrun gives each process; select_files shares the rank files out by RANK
        runs = [subprocess.Popen(shard, env={**SLOW, "WORLD_SIZE": "2", "RANK": str(r)}, stdout=subprocess.PIPE,
                                 text=True) for r in (0, 1)]  # fmt: skip
    rank_locks = [out / FILE_LOCK_DIR / f"model{r}-mp2.safetensors.lock" for r in (0, 1)]
    _wait_for(lambda: all(_holders(p) for p in rank_locks), runs, "both shares hold their rank file")
    writer0 = _holders(rank_locks[0])[0]
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--ranks", "0", "--resume")
    assert code == 2 and f"{out.resolve()}/model0-mp2.safetensors: in use by pid {writer0} on " in err, err
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(out))
    assert code == 2 and f"{out.resolve()}: in use by pid " in err
    assert all(f"pid {p.pid} on" in err for p in runs), err  # both shares named
    summaries = []
    for p in runs:
        stdout, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        summaries.append(json.loads(stdout))
    assert sorted(w for s in summaries for w in s["written"]) == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    # each share leaves its record: a fragment, or the manifest when it saw every rank done (if both
    # finish within the same moment, both see that and both write the same manifest.json atomically)
    assert all(s["fragment"] or s["manifest"] for s in summaries), summaries
    assert any(s["fragment"] for s in summaries) or all(s["manifest"] for s in summaries), summaries
    code, stdout, err = run_cli(monkeypatch, capsys, "manifest", str(out))
    assert code == 0, err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0
    _same_as_clean(out, clean)
    assert not list((out / FILE_LOCK_DIR).glob("*.lock"))


@pytest.mark.slow
def test_share_refuses_a_folder_with_foreign_files(src, tmp_path, monkeypatch, capsys):
    """A share tolerates the other shares' files, nothing else: a user's file still needs --overwrite."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--ranks", "0")
    assert code == 2 and "files other than the other ranks' files (notes.txt)" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # the locks are gone, and their folder


def test_dry_run_refuses_what_the_run_would_find_held(src, tmp_path, monkeypatch, capsys):
    """`shard --dry-run` / `export --dry-run` into an OUT another process is writing said the run would go
    ahead, and the run itself was then refused (exit 2, "in use by"). The dry run now says so too, for a whole
    run and for a share whose rank file is held; a share of other rank files beside a running share is no
    conflict, and nothing is left locked or written."""
    out = tmp_path / "out"
    out.mkdir()
    dry = ["--tp", "2", "--dry-run", "--json"]
    with hold(out):
        for command in (["shard", str(src), str(out), *dry], ["export", str(src), str(out), "--format", "bf16",
                        "--dry-run", "--json"]):  # fmt: skip
            code, stdout, err = run_cli(monkeypatch, capsys, *command)
            assert code == 2 and f"error: {out.resolve()}: in use by pid {os.getpid()} on " in err, (command, err)
            assert json.loads(stdout)["exit_code"] == 2
    assert sorted(p.name for p in out.iterdir()) == []
    with hold(out, shared=True, files=["model0-mp2.safetensors"]):
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), *dry, "--ranks", "0")
        assert code == 2 and f"{out.resolve()}/model0-mp2.safetensors: in use by pid {os.getpid()}" in err
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), *dry)  # every rank: alone
        assert code == 2 and f"error: {out.resolve()}: in use by pid {os.getpid()}" in err
        code, stdout, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), *dry, "--ranks", "1")
        assert code == 0, err
        assert [r["file"] for r in json.loads(stdout)["files"]] == ["model1-mp2.safetensors"]
    assert [p.name for p in out.iterdir()] == []  # the share's lock folder went with its last lock
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), *dry)
    assert code == 0, err


def test_reference_logits_waits_for_nobody(src, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "refs"
    folder.mkdir()
    with hold(folder):
        code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(folder / "ref.safetensors"))
    assert code == 2 and f"error: {folder.resolve()}: in use by pid {os.getpid()}" in err
    assert [p.name for p in folder.iterdir()] == []


def _workers_of(pid: int) -> list[int]:
    """The multiprocessing workers of run `pid` (Linux /proc): its spawned children and the children of its
    fork server."""
    spawned = [k for k in _children(pid) if b"spawn_main" in _cmdline(k)]
    return spawned + [w for s in _fork_servers(pid) for w in _children(s)]


def _fork_servers(pid: int) -> list[int]:
    return [k for k in _children(pid) if b"multiprocessing.forkserver" in _cmdline(k)]


def _children(pid: int) -> list[int]:
    return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_killed_parent(src, clean, tmp_path, monkeypatch, capsys):
    """kill -9 of the run (not of its process group): the lock dies with it, so its worker processes must die
    too, or they would go on writing partial files beside the run that takes the lock over."""
    out = tmp_path / "out"
    run = subprocess.Popen([*CLI, "shard", str(src), str(out), "--tp", "2", "--workers", "2", "--json"], env=SLOW,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    _wait_for(lambda: len(list(out.glob("*.partial"))) == 2, [run], "both workers write")
    workers, servers = _workers_of(run.pid), _fork_servers(run.pid)
    assert len(workers) == 2
    run.kill()
    run.wait()
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers + servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers), "orphaned workers still running"
    assert not any(_alive(s) for s in servers), "orphaned fork server still running"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--resume")
    assert code == 0 and f"took over the lock of a run that ended without releasing it: pid {run.pid}" in err
    assert run_cli(monkeypatch, capsys, "check", str(out))[0] == 0
    _same_as_clean(out, clean)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_every_process_of_a_run_dies_with_it_while_the_run_is_not_yet_reaped(src, tmp_path):
    """kill -9 of a run as its first file starts, its parent not waiting for it at once (a shell, a
    scheduler): a worker that started while its fork server was dying was reparented and ran on, idle,
    holding the run's lock and output pipes (2 of 4 rounds before: the run's zombie passed `alive(run)`)."""
    for round_ in range(3):
        out = tmp_path / f"out{round_}"
        cmd = [*CLI, "shard", str(src), str(out), "--tp", "4", "--workers", "2", "--buffered-io"]
        run = subprocess.Popen(cmd, env=SLOW, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _wait_for(lambda out=out: any(partial_sizes(out)), [run], "a file starts")
        tree = [run.pid]  # the run, its resource tracker, its fork server and the workers forked from it
        for pid in tree:
            tree += _children(pid)
        run.kill()  # and not reaped: a zombie for now
        time.sleep(2)
        assert not [p for p in tree[1:] if _alive(p)], (round_, tree)
        run.communicate(timeout=10)  # no process of the run holds its pipes


@pytest.mark.slow
@pytest.mark.dist
def test_reference_logits_under_torchrun_holds_the_folder_on_rank_0_only(tmp_path):
    """torchrun's ranks all run the command: rank 0 holds OUT's folder from the start, the others take no
    lock (were they to, the launch would refuse itself); a held folder still refuses the launch."""
    from dsv41_convert.synth.presets import TINY
    from dsv41_convert.synth.write import write_checkpoint

    src = write_checkpoint(tmp_path / "src", TINY)["out"]  # with a vision tower: no prompt runs it, a warning
    folder = tmp_path / "refs"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
              "-m", "dsv41_convert.cli", "reference-logits", str(src), str(folder / "ref.safetensors"),
              "--tp", "2", "--decode-steps", "1", "--json"]  # fmt: skip
    res = subprocess.run(launch, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == ["ref.safetensors"]
    # the ranks share stdout and stderr: one JSON line, rank 0's (it saves); rank 0 alone warns and tells
    assert [json.loads(line)["rank"] for line in res.stdout.splitlines()] == [0]
    assert res.stderr.count("no prompt runs it") == 1 and res.stderr.count("reference: ") == 1
    (folder / "ref.safetensors").unlink()
    with hold(folder):
        res = subprocess.run(launch, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and f"{folder.resolve()}: in use by pid {os.getpid()}" in res.stderr
    assert [p.name for p in folder.iterdir()] == []
    # every rank that failed says so, as one line each that names it (indented documents interleaved): rank 0
    # refused the folder; rank 1, waiting for it to join, is stopped by torchrun's SIGTERM and says so (it
    # ignored the SIGTERM inside the backend's rendezvous until torchrun's SIGKILL 30 s later: an audit)
    documents = {d["rank"]: d for d in map(json.loads, res.stdout.splitlines())}
    assert sorted(documents) == [0, 1] and all(d["ok"] is False for d in documents.values())
    assert documents[0]["exit_code"] == 2 and documents[1]["exit_code"] == 143, documents
    assert all(f"error: rank {r}: " in res.stderr for r in documents)


@pytest.mark.slow
@pytest.mark.dist
def test_shard_under_torchrun_prints_one_json_line_per_process(tmp_path):
    """Each torchrun process writes its share and says so: one compact document per line, with its rank."""
    from dsv41_convert.synth.presets import TINY
    from dsv41_convert.synth.write import write_checkpoint

    src = write_checkpoint(tmp_path / "src", TINY, vision=False)["out"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29518",
              "-m", "dsv41_convert.cli", "shard", str(src), str(tmp_path / "mp2"), "--tp", "2", "--json"]  # fmt: skip
    res = subprocess.run(launch, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    documents = sorted((json.loads(line) for line in res.stdout.splitlines()), key=lambda d: d["rank"])
    assert [(d["rank"], d["written"]) for d in documents] == [(0, ["model0-mp2.safetensors"]),
                                                              (1, ["model1-mp2.safetensors"])]  # fmt: skip


_CRASHES_IN = """
import sys
from dsv41_convert import cli
from dsv41_convert.convert import execute

def crash(*args, **kwargs):
    raise RuntimeError("planted. Advice after the first sentence")

report_run = cli._report_run

def crash_after(*args, **kwargs):
    report_run(*args, **kwargs)
    crash()

if sys.argv.pop(1) == "before":
    execute.select_files = crash  # shard's and export's engine, before any byte
else:
    cli._report_run = crash_after  # once the result's document is out
sys.argv = ["dsv41-convert", *sys.argv[1:]]
cli.entry()
"""


@pytest.mark.parametrize("command", ["shard", "export"])
def test_a_crash_of_a_torchrun_process_is_a_document_too(src, tmp_path, command):
    """A shard or export process of a torchrun launch that crashed (a bug) left only its traceback: no document
    with its rank and `exit_code`, so a pipeline reading the documents saw no failure (an audit). Now the
    traceback, then `error: rank 1: RuntimeError: planted` and its document, exit 1, as verify's."""
    args = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
    run = subprocess.run([sys.executable, "-c", _CRASHES_IN, "before", command, str(src), str(tmp_path / "o"), *args,
                          "--json"], env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert json.loads(run.stdout) == {"rank": 1, "ok": False, "exit_code": 1, "error": "RuntimeError: planted"}
    assert "Traceback" in run.stderr and "error: rank 1: RuntimeError: planted" in run.stderr


def test_a_crash_after_the_result_adds_no_second_document(src, tmp_path):
    """One document per process: a crash once the result's is out is said on stderr alone (a review)."""
    run = subprocess.run([sys.executable, "-c", _CRASHES_IN, "after", "shard", str(src), str(tmp_path / "o"), "--tp",
                          "2", "--json"], env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"}, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 1 and "error: rank 1: RuntimeError: planted" in run.stderr, run.stderr
    (document,) = [json.loads(line) for line in run.stdout.splitlines()]
    assert document["rank"] == 1 and document["written"] == ["model1-mp2.safetensors"]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
@pytest.mark.parametrize("victim", ["worker", "fork server"])
def test_a_killed_worker_or_fork_server_is_a_failed_run_named(src, clean, tmp_path, monkeypatch, capsys, victim):
    """A worker killed (the OOM killer) ended the run with a BrokenProcessPool traceback; its fork server
    killed, with "aborted" and exit 130 as for a Ctrl-C nobody sent (an audit). Both are now a failed run,
    exit 1, named, a document with --json; what is on disk is kept and --resume finishes it."""
    import signal as signals

    out = tmp_path / "out"
    run = subprocess.Popen([*CLI, "shard", str(src), str(out), "--tp", "2", "--workers", "2", "--json"], env=SLOW,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    _wait_for(lambda: len(list(out.glob("*.partial"))) == 2, [run], "both workers write")
    pid = (_workers_of(run.pid) if victim == "worker" else _fork_servers(run.pid))[0]
    os.kill(pid, signals.SIGKILL)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 1 and "Traceback" not in stderr and "aborted" not in stderr, stderr
    # the server's workers die with it: the pool breaks ("worker"); killed as it starts them, its pipe ends
    assert "a worker process of the run died" in stderr or "from a process the run depends on" in stderr, stderr
    if "a worker process of the run died" in stderr:  # which files were not finished (none named: an audit)
        assert "not finished then: model0-mp2.safetensors, model1-mp2.safetensors)" in stderr, stderr
    assert json.loads(stdout)["exit_code"] == 1
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--resume")
    assert code == 0, err
    _same_as_clean(out, clean)


@pytest.mark.dist
@pytest.mark.skipif(sys.platform != "linux", reason="/proc")
def test_the_processes_of_a_torchrun_launch_end_with_its_agent(src, tmp_path):
    """After a kill -9 of torchrun, its processes ran on as orphans until they finished (an audit): each now
    takes SIGTERM when the agent is gone, and ends as torchrun's own stop ends it (143; partials kept)."""
    import signal as signals

    out = tmp_path / "mp2"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29519",
              "-m", "dsv41_convert.cli", "shard", str(src), str(out), "--tp", "2"]  # fmt: skip
    run = subprocess.Popen(launch, env=SLOW, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(list(out.glob("*.partial"))) == 2, [run], "both ranks write")
    ranks = _children(run.pid)
    assert len(ranks) == 2, ranks
    os.kill(run.pid, signals.SIGKILL)
    run.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{r}").exists() and b"dsv41_convert" in _cmdline(r) for r in ranks):
        assert time.monotonic() < deadline, "the ranks outlived their torchrun agent"
        time.sleep(0.1)
    assert not (out / "manifest.json").exists()


def test_a_share_without_torchrun_rendezvous_says_it_writes_one_share(src, tmp_path, monkeypatch, capsys):
    """RANK and WORLD_SIZE left in a shell, no torchrun (README): the run writes its share only, and says so on
    stderr, naming the variables torchrun would have set; stdout keeps its one document."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "out"
    code, stdout, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--json")
    assert code == 0, err
    assert (
        "warning: rank 1: RANK=1 and WORLD_SIZE=2 are set without MASTER_ADDR and MASTER_PORT (torchrun sets all "
        "of them): this process writes share 1 of 2 of the rank files only" in err
    ), err
    summary = json.loads(stdout)
    assert summary["rank"] == 1 and summary["written"] == ["model1-mp2.safetensors"]
    assert not (out / "model0-mp2.safetensors").exists()
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29500")
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "launched"), "--tp", "2")
    assert code == 0 and "warning" not in err, err
