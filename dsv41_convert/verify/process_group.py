"""A torchrun process in its launch's process group (`run_in_group`), and what an exception raised by
torch.distributed says: a peer that went away (`peer_lost`), one that did not answer within the group's timeout
(`timed_out`, `hung_peer`), or a rendezvous that cannot listen at its address (`cannot_listen`).

Used by launch.py, for its torchrun processes and its spawned ranks alike.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsv41_convert import interrupts, torchrun
from dsv41_convert.errors import ConvertError, RankFailedError, VerifyInputError, crash_line, first_words
from dsv41_convert.verify.rank_failures import HUNG_TAIL

TIMEOUT = datetime.timedelta(minutes=10)  # the group's, unless launch is given another (`--rank-timeout`)
JOIN_S = 180.0  # how long a torchrun process waits for the others to join (they start together)


def run_in_group(
    target: Callable[[Any], Any], payload: Any, backend: str, device: str, timeout: datetime.timedelta = TIMEOUT
) -> Any:
    """`target(payload)` in this torchrun process, inside the launch's group (joined by `join_group`, left
    after); -> its value on RANK 0, None elsewhere. A failure in a collective is said as what it is (a peer that
    hung or went away, RankFailedError), a crash by its crash line; a ConvertError as raised."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    join_group(backend, device, timeout)
    try:
        result = target(payload)
    except ConvertError:
        raise
    except Exception as exc:  # a peer died or left, or a crash here: said, with a document (not only a traceback)
        interrupts.check()
        if timed_out(exc):  # a peer hung: said as such, not as this process's crash (a helper's hunt)
            raise RankFailedError(f"{hung_peer(exc)}; see the other processes' errors") from None
        if peer_lost(exc):  # gloo says it as a RuntimeError (an audit: a traceback and no --json document)
            raise RankFailedError(
                f"the torchrun launch lost a peer ({first_words(exc)}); see the other processes' errors"
            ) from None
        raise RankFailedError(crash_line(exc)) from exc
    finally:
        dist.destroy_process_group()
    return result if torchrun.rank() == 0 else None


def join_group(backend: str, device: str, timeout: datetime.timedelta = TIMEOUT) -> None:
    """init_process_group of a torchrun launch, waited for where Ctrl-C and SIGTERM reach this process, and
    for at most JOIN_S: the rendezvous blocks in C++, where Python runs no signal handler, so a process whose
    peer failed before joining (rank 0 refused a locked folder) ignored torchrun's SIGTERM until SIGKILL and
    waited TIMEOUT (10 minutes) before saying anything (an audit)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:  # torch's env:// rendezvous raised a ValueError traceback (an audit)
        raise VerifyInputError(
            f"RANK and WORLD_SIZE are set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            "torchrun sets all four; unset RANK and WORLD_SIZE to run alone"
        )
    port = os.environ["MASTER_PORT"]
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):  # torch: a ValueError traceback
        raise VerifyInputError(f"MASTER_PORT={port!r}: not a port (a whole number 1-65535), as torchrun sets it")
    failed: list[BaseException] = []

    def join() -> None:
        try:
            if device == "cuda":  # the current device is per thread: the group's, as the caller's
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=timeout)
        except BaseException as exc:  # raised again in the main thread
            failed.append(exc)

    joining = threading.Thread(target=join, name="join the torchrun group", daemon=True)
    joining.start()
    deadline = time.monotonic() + JOIN_S
    while joining.is_alive():
        joining.join(0.25)
        interrupts.check()
        if joining.is_alive() and time.monotonic() > deadline:
            raise RankFailedError(
                f"the other processes of the torchrun launch (RANK {torchrun.rank()} of WORLD_SIZE {torchrun.world()}, "
                f"MASTER_ADDR {os.environ.get('MASTER_ADDR')}) did not join within {JOIN_S:.0f} s (one of them failed "
                "before it: see its error; or RANK and WORLD_SIZE are left in this environment from another launch)"
            )
    cause = cannot_listen(failed[0]) if failed else None
    if cause:
        raise VerifyInputError(
            f"MASTER_ADDR {os.environ.get('MASTER_ADDR')}, MASTER_PORT {os.environ.get('MASTER_PORT')}: the rendezvous "
            f"cannot listen there ({cause}): another program or launch holds the port, or the address is not this "
            "machine's; give the launch a free MASTER_PORT (torchrun --master-port)"
        )
    if failed:
        raise failed[0]


def cannot_listen(exc: BaseException) -> str | None:
    """Why rank 0's rendezvous server cannot listen at MASTER_ADDR:MASTER_PORT (`exc`, torch's DistNetworkError:
    "address already in use" where the port is taken), None for another failure. torch names the port and the
    cause after its first sentence, which the crash line cut off (a helper's hunt)."""
    text = str(exc)
    if not (isinstance(exc, dist.DistNetworkError) and "failed to listen" in text):
        return None
    cause = re.search(r"message: ([^.\n]+)", text)
    return cause.group(1) if cause else first_words(exc)


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc`, raised in a collective, says that a peer went away (gloo: "Connection closed by peer"
    as a RuntimeError; torch.distributed's DistError) rather than what went wrong here."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in ("Connection closed by peer", "Connection reset"))


def timed_out(exc: BaseException) -> bool:
    """Whether `exc`, raised in a collective or while the group forms, says that no peer answered within the
    group's timeout (gloo: "Timed out waiting 600000ms for recv operation", a RuntimeError; the store's
    DistStoreError "wait timeout after ...", DistNetworkError "... has timed out after ..."): a peer hung."""
    return isinstance(exc, RuntimeError) and re.search(r"timed out|timeout", str(exc), re.IGNORECASE) is not None


def hung_peer(exc: BaseException) -> str:
    """What a process whose collective timed out (`exc`, timed_out) says: a peer hung, not a crash of its own."""
    return f"no peer answered within the group's timeout ({first_words(exc)}){HUNG_TAIL}"
