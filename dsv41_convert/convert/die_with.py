"""Processes that die with the run (Linux, PR_SET_PDEATHSIG), holding its lock until they do.

A worker dies with its parent, but not at the same instant: after a kill -9 of the run its workers ran on
for up to 0.3 s under load (measured 2026-12-02: one finished a file and wrote its done record after the
run was reaped). So the run hands its workers its lock descriptors (`SharedFiles`): the flock stays held
until the last of them exits, and a run that takes the lock over waits for them (store/lock.py).

A worker dies with its parent: the run (spawned) or the run's fork server (forked, execute._worker_context).
The fork server imports this module first (a preload): when RUN_ENV names its parent, the server dies with
that run too, so the kernel takes down the whole tree without a line of our code running after the kill,
and a Ctrl-C that reaches a forked process before it sets its own handler ends it quietly (exit 130).
Imported anywhere else it does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import time

RUN_ENV = "DSV41_CONVERT_FORK_SERVER_OF"  # the run's pid, set while its fork server starts


class SharedFiles:
    """Open descriptors that a process started by multiprocessing (spawn, or a fork server) receives as the same
    open files, not copies: a flock on them is the run's and the worker's together. Pickle it only into a
    process's start arguments (initargs)."""

    def __init__(self, fds: list[int]):
        self.fds = list(fds)

    def __reduce__(self):
        from multiprocessing import reduction

        return (_received, tuple(reduction.DupFd(fd) for fd in self.fds))


def _received(*dups) -> SharedFiles:
    return SharedFiles([d.detach() for d in dups])


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> None:
    """Send this process `sig` when its parent exits (Linux; elsewhere nothing). The parent is the process that
    forked this one (_forked_by) where Python's os.fork made it: one that died before this call (a fork server
    gone with its run between a rank's fork and its first line) has already handed this process to another,
    and an orphan rank waited 10 minutes for its peers, holding the run's stdout (an audit)."""
    if sys.platform != "linux":
        return
    import ctypes

    parent, pr_set_pdeathsig = _forked_by.get("pid", os.getppid()), 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, sig)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), sig)


# "pid": in a process os.fork made after this module's import, the pid of the process that forked it (noted
# there before the fork: asked in the child, it may be gone already); "forking": during a fork, in the parent
_forked_by: dict[str, int] = {}


def _before_a_fork() -> None:
    _forked_by["forking"] = os.getpid()


def _after_a_fork_in_the_parent() -> None:
    _forked_by.pop("forking", None)


def _after_a_fork_in_the_child() -> None:
    forking = _forked_by.pop("forking", None)  # None: another thread's fork cleared it (then ask getppid)
    if forking is None:
        _forked_by.pop("pid", None)
    else:
        _forked_by["pid"] = forking


os.register_at_fork(
    before=_before_a_fork, after_in_parent=_after_a_fork_in_the_parent, after_in_child=_after_a_fork_in_the_child
)


def start_fork_server() -> None:
    """Start multiprocessing's fork server now, if it is not running, telling it (RUN_ENV, for its start
    only) that it serves this process: with this module first in its preload it then dies with this
    process, and so does every process it forks that calls die_with_parent."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    # Ctrl-C reaches the server too (one process group): it starts with SIGINT blocked, a mask an exec keeps,
    # until this module, its first preload, has set its quiet handler; one that landed while its interpreter
    # started printed "Fatal Python error: init_import_site ... KeyboardInterrupt" under the run's message. The
    # resource tracker first: its start unblocks SIGINT in this thread when it ends.
    multiprocessing.resource_tracker.ensure_running()
    os.environ[RUN_ENV] = str(os.getpid())
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        del os.environ[RUN_ENV]


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts: its parent has not waited for it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def fork_server_pid() -> int | None:
    """The pid of this process's multiprocessing fork server, None where none was started."""
    import multiprocessing.forkserver

    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)  # CPython's, 3.8 to 3.14


def fork_server_ended(wait_s: float = 0.0) -> bool:
    """Whether this process's multiprocessing fork server was started and has ended (not reaped here: its
    restart, multiprocessing.forkserver.ensure_running, waits for it), asked for up to `wait_s` seconds. The
    processes it forked then read as exit code 255: the server that would tell their status is gone. A killed
    server closes its sockets before it can be waited for, so a rank seen ended by that close may be asked
    about a moment too early (a full run on the loaded dev box reported "exit code 255" so: wait_s)."""
    pid = fork_server_pid()
    if pid is None:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped already
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _exit_on_interrupt(signum, frame) -> None:
    os._exit(130)  # a SystemExit raised inside a weakref callback (an import's) was printed and dropped


_serves = os.environ.pop(RUN_ENV, None)  # for the server's start only: none of the processes it forks is one
if _serves is not None:  # the fork server of a run, started by that run
    # the run, not getppid(): a run killed while this interpreter started left it an orphan that asked nothing,
    # served the worker the run had queued, and both held the run's stdout and stderr for ever; now it dies
    _forked_by["pid"] = int(_serves)
    die_with_parent()
    _forked_by.pop("pid")
    # what Ctrl-C does in the processes the server forks (it restores this after each fork) until they set
    # their own (execute._init_worker): exit 130 at once and quietly, nothing begun; a KeyboardInterrupt
    # there printed multiprocessing's "Process ForkServerProcess-N: Traceback ..." under the run's message.
    # A SIGINT the run ignores (a script's background job; the exec kept it ignored here) stays ignored: the
    # ranks of `verify` keep this one, and ended 130 at a Ctrl-C the run itself ignored (a helper's hunt)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _exit_on_interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # start_fork_server blocked it for the start
