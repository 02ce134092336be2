"""verify.launch: ranks in a gloo group, rank 0's result back, an input error raised again."""

import pytest
import torch
import torch.distributed as dist

from dsv41_convert.errors import PlanError
from dsv41_convert.verify.launch import launch


def sum_of_ranks(payload: int) -> dict:
    x = torch.tensor([float(dist.get_rank() + payload)])
    dist.all_reduce(x)
    return {"sum": x.item(), "world": dist.get_world_size(), "rank": dist.get_rank()}


def fail_on_rank_1(_payload) -> None:
    if dist.get_rank() == 1:
        raise PlanError("layers.0.attn.wq_b.weight: planted")


def killed_on_rank_1(_payload) -> None:
    import os
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer ends a rank
    dist.barrier()


def fork_server_killed_by_rank_1(_payload) -> None:
    import os
    import signal

    if dist.get_rank() == 1:
        os.kill(os.getppid(), signal.SIGKILL)  # a forked rank's parent is the run's fork server
    dist.barrier()


def gathered_error_of_rank_1(_payload) -> None:
    """As reference_rank reports: every rank raises the errors gathered from all, each named by its rank."""
    if dist.get_rank() == 0:
        raise PlanError("rank 1: layers.1.ffn.experts.12.w1.weight: found nan")


def no_group(payload):
    return payload, dist.is_initialized()


def test_tp1_runs_in_process_without_a_group():
    assert launch(no_group, 7, 1, "cpu") == (7, False)


@pytest.mark.dist
def test_spawned_ranks_return_rank0_result():
    assert launch(sum_of_ranks, 10, 3, "cpu", threads=1) == {"sum": 33.0, "world": 3, "rank": 0}


@pytest.mark.dist
def test_input_error_on_one_rank_comes_back_as_its_type():
    with pytest.raises(PlanError, match=r"rank 1: layers.0.attn.wq_b.weight: planted"):
        launch(fail_on_rank_1, None, 2, "cpu", threads=1)


@pytest.mark.dist
def test_a_rank_that_dies_is_a_failed_run_named_not_a_traceback():
    """A rank killed by a signal (the OOM killer) gave torch's ProcessExitedException traceback, exit 1 and no
    --json document (an audit): now RankFailedError names the rank and the signal (the CLI: exit 1, a
    document), the other ranks stopped."""
    from dsv41_convert.errors import RankFailedError

    with pytest.raises(RankFailedError, match=r"rank 1 of 2 \(pid \d+\) ended by SIGKILL \(out of memory\?\)"):
        launch(killed_on_rank_1, None, 2, "cpu", threads=1)


@pytest.mark.dist
def test_ranks_lost_with_their_fork_server_say_so():
    """A killed fork server takes its ranks with it (die_with), and multiprocessing reads their end as exit
    code 255, which the run reported as the rank's own ("ended with exit code 255")."""
    from dsv41_convert.errors import RankFailedError

    lost = r"rank \d of 2 \(pid \d+\) was lost with the fork server that started it "
    with pytest.raises(RankFailedError, match=lost):
        launch(fork_server_killed_by_rank_1, None, 2, "cpu", threads=1)


@pytest.mark.dist
def test_an_error_naming_its_rank_is_not_named_twice():
    """Errors the target gathers from every rank name their rank: "rank 0: rank 1: ..." said the wrong one
    first (an audit)."""
    with pytest.raises(PlanError, match=r"^rank 1: layers.1.ffn.experts.12.w1.weight: found nan$"):
        launch(gathered_error_of_rank_1, None, 2, "cpu", threads=1)


def test_bad_device():
    from dsv41_convert.errors import VerifyInputError

    with pytest.raises(VerifyInputError, match="--device 'tpu'"):
        launch(no_group, None, 1, "tpu")


@pytest.mark.parametrize("tp", [1, 2])
def test_a_signal_postponed_by_an_import_stops_the_run_before_any_rank_starts(tp, monkeypatch):
    """A SIGTERM during the command's imports is postponed to the next check (interrupts.py); the first
    check was in the model's layer loop, after the fork server and every rank had started: verify stopped
    6-14 s after the signal (an audit)."""
    from dsv41_convert import interrupts
    from dsv41_convert.verify import launch as launch_module

    monkeypatch.setitem(interrupts._state, "interrupted", True)
    monkeypatch.setattr(launch_module.die_with, "start_fork_server", lambda: pytest.fail("a rank was started"))
    with pytest.raises(KeyboardInterrupt):
        launch_module.launch(lambda payload: pytest.fail("the target ran"), None, tp, "cpu")


def telling(payload: int) -> str:
    """Tells `payload` steps under a label naming its rank, sleeping between them so that the launching
    process reads them while the ranks run."""
    import time

    from dsv41_convert.verify.launch import tell

    rank = dist.get_rank() if dist.is_initialized() else 0
    for i in range(payload + 1):
        tell(f"rank {rank}", i, payload)
        time.sleep(0.1)
    return "done"


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.dist)])
def test_rank_0_tells_its_progress_to_the_launching_process(tp):
    """Long reference and verify runs showed nothing between their start and their end: rank 0's target
    tells its progress, which reaches the launch's callback in this process (read from a file while a
    spawned rank runs); the other ranks' is dropped."""
    import time

    told: list[tuple[str, int, int]] = []
    seen_at: list[float] = []

    def progress(*event) -> None:
        told.append(event)
        seen_at.append(time.monotonic())

    assert launch(telling, 8, tp, "cpu", threads=1, progress=progress) == "done"
    assert told == [("rank 0", i, 8) for i in range(9)]
    assert seen_at[-1] - seen_at[0] > 0.4  # while the rank ran (0.9 s), not all at its end


def test_tell_outside_a_launch_does_nothing():
    assert telling(1) == "done"  # no launch, no progress: tell goes nowhere, raises nothing


_ALONE_IN_A_TORCHRUN_LAUNCH = """
import os, socket, sys, threading
from dsv41_convert import interrupts
from dsv41_convert.verify import launch as launch_module

s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
launch_module.JOIN_S = 3.0
if sys.argv[1] == "signal":  # what the CLI's SIGTERM handler does, 1 s into the wait
    threading.Timer(1.0, lambda: interrupts._state.update(interrupted=True)).start()
try:
    launch_module.launch(lambda payload: payload, 1, 2, "cpu")
except BaseException as exc:
    print(type(exc).__name__, exc)
    os._exit(0)  # the joining thread still waits in the backend
"""


@pytest.mark.dist
@pytest.mark.parametrize("how", ["signal", "timeout"])
def test_a_torchrun_process_whose_peers_never_join_stops(how):
    """A torchrun rank whose peer failed before joining waited in the backend's rendezvous, where no Python
    signal handler runs: it ignored torchrun's SIGTERM and said nothing for 10 minutes (an audit). The wait
    now takes Ctrl-C and SIGTERM at once, and ends after JOIN_S naming why."""
    import subprocess
    import sys
    import time

    t = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _ALONE_IN_A_TORCHRUN_LAUNCH, how], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    took = time.monotonic() - t
    if how == "signal":
        assert done.stdout.startswith("KeyboardInterrupt"), done.stdout + done.stderr
    else:
        assert done.stdout.startswith(
            "RankFailedError rank 0: the other processes of the torchrun launch did not join"
        ), done.stdout + done.stderr
    assert took < 30, took
