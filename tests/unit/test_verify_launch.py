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
