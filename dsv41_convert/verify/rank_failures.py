"""Why the spawned ranks of a launch failed, said once one has: the rank files' errors read back, and the rank
that hung named.

Each spawned rank that fails leaves rank{rank}.error in the launch's temporary folder (launch.py's `_leave_error`):
its kind on the first line, then its message. A kind of PEER_LOST or PEER_TIMEOUT only says that a peer went away or
did not answer; any other is the rank's own error (a ConvertError's class, or RankFailedError for a crash).
`settle` waits up to SETTLE_S for the other ranks to end and leave theirs, then returns the error that says the
cause: a rank's own error, else a rank a signal ended, else the rank that hung while its peers timed out.

Used by launch.py (and process_group.py: HUNG_TAIL); imports nothing of verify.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsv41_convert import errors
from dsv41_convert.convert import die_with
from dsv41_convert.errors import ConvertError, RankFailedError

SETTLE_S = 5.0  # how long the other spawned ranks may take to end and say why, once one has failed
PEER_LOST = "PeerLost"  # the kind of a rank's error file that only says a peer went away (the cause is the peer's)
PEER_TIMEOUT = "PeerTimeout"  # ... that says no peer answered within TIMEOUT (one hung, or was stopped)
HUNG_TAIL = ": a rank hung or was stopped (SIGSTOP, a debugger, a machine swapping)"  # which, a peer cannot tell


def settle(processes: Sequence[Any], tmp: Path, tp: int, failed: int) -> ConvertError:
    """The error that says why the ranks failed, `failed` (an index) the first found ended badly. Waits up to
    SETTLE_S for the others to end by themselves, each writing its error file, unless a cause is known sooner
    (an error of its own, a rank a signal ended): the first rank to give up on a hung peer closes its connections
    before it writes its error, its peers then leave "lost a peer", and stopping them at once left no cause to
    say (at tp 4 one run in four said only "rank 0 of 4 (pid N) ended with exit code 1": a helper's hunt).

    The cause, by what is known: the lowest rank's own error (an input error, a crash); else a rank a signal
    ended (out of memory; its peers only lost it); else, where a peer timed out, the rank that hung: still
    running when its peers had all given up (stopped, where /proc says so; `_hung`); else the first failed rank's
    exit."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        codes = [p.exitcode for p in processes]
        own = rank_error(tmp, tp)
        killed = [rank for rank, code in enumerate(codes) if code is not None and code < 0]
        if own is not None or killed or None not in codes or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if own is not None:
        return own
    first = killed[0] if killed else failed
    if not killed:
        timeouts = peer_timeouts(tmp, tp)
        if timeouts:
            return _hung(processes, tp, timeouts[0])
    return RankFailedError(
        f"rank {first} of {tp} (pid {processes[first].pid}) {_how_ended(codes[first])}; the run stopped its other ranks"
    )


def _hung(processes: Sequence[Any], tp: int, timeout: str) -> RankFailedError:
    """The error of a run whose rank hung, `timeout` the message of the first peer that gave up waiting (its
    PEER_TIMEOUT file's): the rank(s) still running then, none of them having left an error, are those that
    hung, named (each peer only knows that its collective timed out, not which rank held it up)."""
    alive = [(rank, p.pid) for rank, p in enumerate(processes) if p.exitcode is None]
    waited = timeout.removesuffix(HUNG_TAIL)
    if not alive:  # every rank ended (the stopped one let go, then lost its peers): which one hung is unknown
        return RankFailedError(f"{waited}; which rank hung cannot be told (every rank has ended since)")
    said = ", ".join(f"rank {rank} of {tp} (pid {pid}) hung ({_state(pid)})" for rank, pid in alive)
    return RankFailedError(f"{said} while its peers waited: {waited}")


def _state(pid: int) -> str:
    """What /proc says of a rank that did not answer its peers: stopped (SIGSTOP, a debugger), else running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        stat = ""
    fields = stat.rpartition(")")[2].split()  # the state follows the command's name, which may hold spaces
    if fields and fields[0] in ("T", "t"):
        return "stopped: SIGSTOP, a debugger"
    return "still running, no error of its own"


def rank_error(tmp: Path, tp: int) -> ConvertError | None:
    """The error of its own that the lowest rank left in `tmp` (not one that only says a peer went away or did not
    answer), as its own kind, naming its rank; None where no rank left one."""
    for rank, kind, message in _error_files(tmp, tp):
        if kind and kind not in (PEER_LOST, PEER_TIMEOUT):  # an empty one (written before the rename was whole): none
            named = tp == 1 or errors.names_a_rank(message)  # errors the target gathered name their ranks
            return getattr(errors, kind, ConvertError)(message if named else f"rank {rank}: {message}")
    return None


def peer_timeouts(tmp: Path, tp: int) -> list[str]:
    """The messages of the PEER_TIMEOUT files in `tmp`, by rank: each a rank that gave up waiting for a peer."""
    return [message for _, kind, message in _error_files(tmp, tp) if kind == PEER_TIMEOUT]


def _error_files(tmp: Path, tp: int) -> list[tuple[int, str, str]]:
    """(rank, kind, message) of each rank{rank}.error in `tmp`, by rank."""
    left = [tmp / f"rank{rank}.error" for rank in range(tp)]
    return [
        (rank, *err.read_text(encoding="utf-8").partition("\n")[::2]) for rank, err in enumerate(left) if err.exists()
    ]


def _how_ended(exitcode: int) -> str:
    """How a rank process that ended with `exitcode` (multiprocessing's: -N for signal N) ended, in words."""
    if exitcode < 0:
        name = signal.Signals(-exitcode).name
        return f"ended by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
    if exitcode == 255 and die_with.fork_server_ended(wait_s=2.0):
        return "was lost with the fork server that started it (the server ended: killed?; each rank dies with it)"
    return f"ended with exit code {exitcode}"
