"""Processes that die with the run (Linux, PR_SET_PDEATHSIG). The run's lock dies with the run (kill -9, OOM
kill); its writers must stop with it, or they would write beside the run that takes the lock over.

A worker dies with its parent: the run (spawned) or the run's fork server (forked, execute._worker_context).
The fork server imports this module first (a preload): when RUN_ENV names its parent, the server dies with
that run too, so the kernel takes down the whole tree without a line of our code running after the kill.
Imported anywhere else it does nothing.
"""

from __future__ import annotations

import os
import signal
import sys

RUN_ENV = "DSV41_CONVERT_FORK_SERVER_OF"  # the run's pid, set while its fork server starts


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux; elsewhere nothing)."""
    if sys.platform != "linux":
        return
    import ctypes

    parent, pr_set_pdeathsig = os.getppid(), 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts: its parent has not waited for it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


if os.environ.get(RUN_ENV) == str(os.getppid()):  # the fork server of a run, started by that run
    die_with_parent()
