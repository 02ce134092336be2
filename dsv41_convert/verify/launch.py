"""One process per tensor-parallel rank: spawn them here, or join a torchrun launch.

`launch(target, payload, tp, device)` calls the top-level function `target(payload)` once on every
rank, inside an initialised process group (gloo on CPU, nccl on CUDA), and returns rank 0's result.

- Under torchrun (RANK and WORLD_SIZE in the environment, MASTER_ADDR/PORT set by it) this process is
  one of the ranks: it joins the group, runs `target`, and gets the result on rank 0 (None elsewhere).
  This is how verify runs across machines.
- Otherwise tp 1 runs in this process with no group at all, and tp > 1 starts tp fresh processes on
  this machine (torch.multiprocessing, start method "forkserver", torch preloaded). Each rank writes its result, or the
  ConvertError it met, to a temporary folder; rank 0's result comes back, and the first rank's input
  error is raised again here so that the CLI reports it as one. Once one rank failed, the others have
  SETTLE_S to end and say why, and the run names the cause (rank_failures.py): a rank's own error, a rank a
  signal ended, or the rank that hung while its peers timed out.

Inside `target`, `tell(label, done, total)` reports progress: rank 0's reaches the `progress` given to
launch, in the launching process.

`target` must agree with its peers on failures: a rank that raises while the others wait in a
collective would hang them until the group's timeout (`TIMEOUT`, or launch's `timeout_s`: `--rank-timeout`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dsv41_convert import errors, interrupts, torchrun
from dsv41_convert.convert import die_with
from dsv41_convert.errors import ConvertError, RankFailedError, VerifyInputError, crash_line, first_words
from dsv41_convert.progress import Progress
from dsv41_convert.verify.process_group import TIMEOUT, cannot_listen, hung_peer, peer_lost, run_in_group, timed_out
from dsv41_convert.verify.rank_failures import PEER_LOST, PEER_TIMEOUT, peer_timeouts, rank_error, settle

T = TypeVar("T")
START_METHOD = "forkserver"  # see launch()


def backend_for(device: str) -> str:
    """The process-group backend of `device`; VerifyInputError for another device, or cuda without one (the
    streamed reference, which launches no ranks, met it as a RuntimeError deep in its first stream)."""
    if device not in ("cpu", "cuda"):
        raise VerifyInputError(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise VerifyInputError("--device cuda: no CUDA device is available")
    return "nccl" if device == "cuda" else "gloo"


def check_world(tp: int, found_in: Path | None = None) -> None:
    """VerifyInputError where an enclosing torchrun launch started another number of processes than `tp`:
    --tp's, else (`found_in`) the tp of the rank files in that folder, which the message names (it said
    "--tp is 2" to a user who gave no --tp)."""
    world = torchrun.world()
    if world is None or world == tp:
        return
    if found_in is None:
        raise VerifyInputError(f"torchrun started {world} ranks but --tp is {tp}; they must be equal")
    raise VerifyInputError(
        f"torchrun started {world} ranks but {found_in} holds the rank files of tp {tp} (model*-mp{tp}.safetensors; "
        f"no --tp given): launch torchrun with {tp} processes"
    )


def check_rank_timeout(tp: int, stream_layers: bool, tp_said: str) -> None:
    """VerifyInputError for --rank-timeout given to a run that launches no ranks, where it did nothing, silently
    (a helper's hunt): --stream-layers, or tp 1 outside torchrun (`tp_said`: where that tp 1 comes from)."""
    if stream_layers:
        raise VerifyInputError(
            "--rank-timeout: --stream-layers runs every unit in this one process and launches no ranks, so no rank "
            "waits for a peer: drop --rank-timeout"
        )
    if tp == 1 and torchrun.world() is None:
        raise VerifyInputError(
            f"--rank-timeout: at tp 1 ({tp_said}) this process runs the model alone and launches no ranks, so no rank "
            "waits for a peer: drop --rank-timeout (it is the ranks' group timeout, at tp > 1 or under torchrun)"
        )


def launch(
    target: Callable[[Any], Any],
    payload: Any,
    tp: int,
    device: str,
    threads: int | None = None,
    progress: Progress | None = None,
    timeout_s: int | None = None,
) -> Any:
    """Run `target(payload)` on tp ranks; -> rank 0's return value (None on other torchrun ranks).

    threads:   torch intra-op threads per spawned rank (default: CPU cores / tp, at least 1); under torchrun this
               process's own (default: left as they are)
    progress:  what rank 0's target `tell`s, reported in this process (from a spawned rank 0 through a file
               in the launch's folder, read while the ranks run)
    timeout_s: the group's timeout, how long a rank waits in a collective for a peer that does not answer
               (a hung one) before the run fails (default TIMEOUT, 10 minutes)
    """
    interrupts.check()  # a Ctrl-C or SIGTERM postponed by an import stops the run before its ranks start
    backend = backend_for(device)
    check_world(tp)
    timeout = TIMEOUT if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if torchrun.world() is not None:  # this process is the rank: the threads asked are its own
        if threads is not None and device == "cpu":  # dropped, a reference's recorded threads FAILED a correct set
            torch.set_num_threads(threads)
        with _telling(progress if torchrun.rank() == 0 else None):
            return run_in_group(target, payload, backend, device, timeout)
    if tp == 1:
        if device == "cuda":
            torch.cuda.set_device(0)
        with _telling(progress):
            return target(payload)
    if device == "cuda" and torch.cuda.device_count() < tp:
        raise VerifyInputError(f"--tp {tp} on cuda needs {tp} GPUs, found {torch.cuda.device_count()}")
    import multiprocessing

    import torch.multiprocessing as mp

    # forkserver: one helper process imports torch and the target's module once, and every rank is
    # forked from it; with "spawn" each rank imports torch itself (seconds of CPU each, 8 ranks on 2 cores)
    # die_with first: the server, and each rank (_spawned), die with this process, however it ends
    multiprocessing.set_forkserver_preload([die_with.__name__, "torch", __name__, target.__module__])
    # torch's join logs each rank it stops after a failure ("Terminating process N via signal SIGTERM"): the
    # run's own error says what failed
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    die_with.start_fork_server()
    with tempfile.TemporaryDirectory(prefix="dsv41-verify-") as tmp:
        # the payload travels as a file: passed as an argument, every tensor in it would become a
        # shared-memory file descriptor, and a forkserver hands a child at most a few hundred
        _save_in_tmp(payload, Path(tmp) / "payload.pt", "the ranks' payload")
        port = _free_port()
        ranks = mp.start_processes(
            _spawned,
            args=(tp, port, backend, device, target, tmp, threads or default_threads(tp), timeout),
            nprocs=tp,
            join=False,
            start_method=START_METHOD,
        )
        told = _ToldFile(Path(tmp) / TOLD, progress)
        try:
            failed = _wait_for_ranks(ranks.processes, told)
            if failed is not None:  # a rank failed (its error file), or was killed (none)
                said = settle(ranks.processes, Path(tmp), tp, failed)
                _stop(ranks.processes)
                interrupts.check()  # this run was interrupted: the ranks died of its signal
                raise said
        except BaseException:  # Ctrl-C: none may outlive this process
            _stop(ranks.processes)
            raise
        _raise_rank_error(Path(tmp), tp)
        return torch.load(Path(tmp) / "rank0.pt", weights_only=False)


def _wait_for_ranks(processes: Sequence[Any], told: _ToldFile) -> int | None:
    """Wait for the spawned ranks, relaying rank 0's progress: None once every one ended well, else the index
    of the first found failed (its exit code not 0), the others left as they are (torch's join stopped them at
    once, so a peer's error was not yet written: `settle`)."""
    from multiprocessing.connection import wait

    while True:
        running = [p.sentinel for p in processes if p.exitcode is None]
        if running:
            wait(running, timeout=TOLD_EVERY_S)
        told.relay()
        codes = [p.exitcode for p in processes]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return failed[0]
        if not running:
            return None


def _raise_rank_error(tmp: Path, tp: int) -> None:
    """The error a rank left in `tmp` that says what went wrong, raised here (the first rank's); else the first
    PEER_TIMEOUT (a rank that waited the group's timeout for a hung peer: RankFailedError); nothing where none
    did (a rank killed: out of memory, a signal; its peers' PEER_LOST files only say they lost it)."""
    own = rank_error(tmp, tp)
    if own is not None:
        raise own
    for message in peer_timeouts(tmp, tp):
        raise RankFailedError(message)


def _stop(processes: list, grace_s: float = 5.0) -> None:
    """SIGTERM (and SIGCONT) to every rank still running, SIGKILL to those alive `grace_s` later. (A SIGINT to
    this process alone left the ranks running, and the exit then waited for them forever.)"""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
        with contextlib.suppress(ProcessLookupError):  # a stopped rank (SIGSTOP) takes the SIGTERM once continued
            os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _spawned(
    rank: int,
    tp: int,
    port: int,
    backend: str,
    device: str,
    target,
    tmp: str,
    threads: int,
    timeout: datetime.timedelta = TIMEOUT,
) -> None:
    """Body of a spawned rank: join the group, run target, leave the result or the error it met in tmp.

    A rank that fails leaves its error file and exits (1) at once, without meeting its peers again: they may
    be inside another collective, where a barrier of the failed rank hung them all until TIMEOUT (an audit:
    one rank's file truncated between two loads; 5 minutes, then killed). Its peers' collectives then fail
    ("connection closed"; unless torch's join has stopped them first): each leaves a PEER_LOST file, and the
    parent reports the failed rank's error."""
    die_with.die_with_parent()  # the fork server, which dies with the verify process
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(tp))  # every rank on this host (fits.py)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=tp, timeout=timeout)  # its port taken: an error
        dist.barrier()  # every pair connected before any rank can finish and tear the group down
        with _telling(_ToldFile(Path(tmp) / TOLD).write if rank == 0 else None):
            # mapped, not read: verify --reference SRC's payload holds the whole tp-1 twin, which each rank
            # cuts its piece from; read, every rank held a private copy of it all
            result = target(torch.load(Path(tmp) / "payload.pt", weights_only=False, mmap=True))
        dist.barrier()  # nobody leaves while a peer still talks to it
        if rank == 0:
            _save_in_tmp(result, Path(tmp) / "rank0.pt", "its result")
    except Exception as exc:  # every failure is the run's; KeyboardInterrupt (a signal) is not one
        _leave_error(exc, rank, tp, Path(tmp))
        sys.stderr.flush()
        os._exit(1)  # no teardown that waits on the peers
    dist.destroy_process_group()


def _save_in_tmp(obj: Any, path: Path, what: str) -> None:
    """torch.save of `obj` (a payload: with verify --reference SRC's twin the whole tp-1 model; rank 0's logits)
    into `path` in the launch's temporary folder, through a file this function opens and closes (not a copy in
    memory first: the twin's doubled the parent's peak); OutputError naming it and TMPDIR where that fails. A
    full TMPDIR said "EOFError from a process the run depends on" with tracebacks (an audit), and a file torch's
    writer held open kept its blocks after it was removed, so the error file after it could not be written
    either (a re-check)."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except (OSError, RuntimeError) as exc:  # torch's writer raises a RuntimeError in the file's OSError's place
        failed = exc if isinstance(exc, OSError) else exc.__context__
        if not isinstance(failed, OSError):
            raise
        path.unlink(missing_ok=True)
        raise errors.OutputError(
            f"cannot write {what} to {path}: {failed.strerror or failed}; free space in the temporary folder (TMPDIR), "
            "or point TMPDIR at one with room"
        ) from None


def _leave_error(exc: Exception, rank: int, tp: int, tmp: Path) -> None:
    """rank{rank}.error in `tmp`: the error's kind (a ConvertError's class, else RankFailedError; PEER_LOST for
    a peer gone, PEER_TIMEOUT for one that did not answer), then its message. A crash (not a ConvertError)
    prints its traceback on stderr first."""
    if timed_out(exc):  # before peer_lost: the store's timeouts are DistErrors
        kind, message = PEER_TIMEOUT, f"rank {rank} of {tp}: {hung_peer(exc)}"
    elif cause := cannot_listen(exc):  # a DistError too: "rank 0 of 2 (pid N) ended with exit code 1", no cause
        kind = RankFailedError.__name__
        message = (
            f"rank {rank} of {tp}: the rendezvous cannot listen at 127.0.0.1:{os.environ.get('MASTER_PORT')} "
            f"({cause}): another program took the free port the run picked, in the moment before its ranks "
            "started; run it again"
        )
    elif peer_lost(exc):
        kind, message = PEER_LOST, f"rank {rank} of {tp}: lost a peer ({first_words(exc)})"
    elif isinstance(exc, ConvertError):
        kind, message = type(exc).__name__, str(exc)
    else:
        kind, message = RankFailedError.__name__, f"rank {rank} of {tp}: {crash_line(exc)}"
    part = tmp / f"rank{rank}.error.partial"  # whole or not there: a rank stopped mid-write left it empty
    try:
        part.write_text(f"{kind}\n{message}", encoding="utf-8")
        os.replace(part, tmp / f"rank{rank}.error")
    except OSError:
        pass  # the parent says how the rank ended


TOLD = "told.jsonl"  # what a spawned rank 0 tells, a JSON line per call, in the launch's folder
TOLD_EVERY_S = 0.25  # how often the launching process reads it
_told: list[Progress] = []  # the progress of the target running in this process, while it runs


def tell(label: str, done: int, total: int) -> None:
    """Progress of a target run by `launch`: rank 0's reaches the `progress` given to launch; elsewhere, and
    outside a launch, nothing."""
    if _told:
        _told[-1](label, done, total)


def told_each(label: str, items: Sequence[T]) -> Iterator[T]:
    """`items` one by one, `tell`ing how many are done under `label` before each and after the last."""
    for i, item in enumerate(items):
        tell(label, i, len(items))
        yield item
    tell(label, len(items), len(items))


@contextmanager
def _telling(progress: Progress | None) -> Iterator[None]:
    if progress is None:
        yield
        return
    _told.append(progress)
    try:
        yield
    finally:
        _told.pop()


class _ToldFile:
    """`tell`'s calls on a spawned rank 0, as JSON lines in a file (`write`), relayed to `progress` in the
    launching process (`relay`, reading what was added since)."""

    def __init__(self, path: Path, progress: Progress | None = None):
        self.path, self.progress, self.offset = path, progress, 0

    def write(self, label: str, done: int, total: int) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps([label, done, total]) + "\n")

    def relay(self) -> None:
        if self.progress is None or not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self.offset)
            added = f.read()
        whole = added[: added.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(whole)
        for line in whole.splitlines():
            self.progress(*json.loads(line))


def default_threads(tp: int) -> int:
    """Intra-op threads per rank so that tp ranks share the cores without oversubscribing them
    (oversubscribed torch threads spin and can slow a CPU run down tenfold)."""
    return max(1, (os.cpu_count() or 1) // tp)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
