"""torchrun.py: the launch as its environment tells it (README: RANK and WORLD_SIZE are read only together, as
torchrun sets them; a RANK outside 0..WORLD_SIZE-1 is refused; MASTER_ADDR and MASTER_PORT are the rendezvous)."""

from __future__ import annotations

import pytest

from dsv41_convert import torchrun
from dsv41_convert.errors import ConfigError


@pytest.mark.parametrize(
    ("env", "world", "rank"),
    [
        ({}, None, 0),
        ({"RANK": "0", "WORLD_SIZE": "1"}, 1, 0),
        ({"RANK": "2", "WORLD_SIZE": "8"}, 8, 2),
        ({"RANK": "7", "WORLD_SIZE": "8"}, 8, 7),
    ],
)
def test_a_launch_is_read_from_rank_and_world_size(env, world, rank):
    assert torchrun.world(env) == world
    assert torchrun.rank(env) == rank


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "1"}, r"RANK=1 is set, WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, r"WORLD_SIZE=2 is set, RANK is not"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2, WORLD_SIZE=2: RANK must be in 0\.\.WORLD_SIZE-1"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK must be in 0\.\.WORLD_SIZE-1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"RANK must be in 0\.\.WORLD_SIZE-1"),
        ({"RANK": "a", "WORLD_SIZE": "2"}, r"not whole numbers"),
    ],
)
def test_what_no_launch_sets_is_refused_by_world_and_rank(env, match):
    with pytest.raises(ConfigError, match=match):
        torchrun.world(env)
    with pytest.raises(ConfigError, match=match):  # rank() reads a RANK only where world() takes the pair
        torchrun.rank(env)


@pytest.mark.parametrize(
    ("env", "shared"),
    [
        ({}, None),
        ({"RANK": "0", "WORLD_SIZE": "1"}, None),  # one process: its stdout is its own
        ({"RANK": "1", "WORLD_SIZE": "2"}, 1),
        ({"RANK": "0", "WORLD_SIZE": "4"}, 0),
        ({"RANK": "3", "WORLD_SIZE": "2"}, None),  # refused by world(): not a launch that shares output
    ],
)
def test_shared_rank_only_where_several_processes_share_the_output(monkeypatch, env, shared):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert torchrun.shared_rank() == shared


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({}, []),  # no launch: nothing is missing
        ({"RANK": "0", "WORLD_SIZE": "1"}, []),  # a launch of one process: its share is everything
        ({"RANK": "1", "WORLD_SIZE": "2"}, ["MASTER_ADDR", "MASTER_PORT"]),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, ["MASTER_PORT"]),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, []),
    ],
)
def test_lacks_rendezvous_names_what_torchrun_would_have_set(env, missing):
    assert torchrun.lacks_rendezvous(env) == missing


def test_by_rank_names_the_process_once(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert torchrun.by_rank("disk full") == "rank 1: disk full"
    assert torchrun.by_rank("rank 3: disk full") == "rank 3: disk full"  # gathered from another rank
    assert torchrun.by_rank("rank 3 of 4: RuntimeError: x") == "rank 3 of 4: RuntimeError: x"
    assert torchrun.by_rank("ranks 0 and 1 disagree") == "rank 1: ranks 0 and 1 disagree"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun.by_rank("disk full") == "disk full"


_LAUNCH = {"WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, True),  # no launch
        ({"RANK": "0", "WORLD_SIZE": "1"}, True),  # a launch of one process
        ({"RANK": "3", "WORLD_SIZE": "4"}, True),  # variables left in a shell: no launch shares its output
        ({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h"}, True),
        ({**_LAUNCH, "RANK": "0", "LOCAL_RANK": "0"}, True),
        ({**_LAUNCH, "RANK": "1", "LOCAL_RANK": "1"}, False),
        ({**_LAUNCH, "RANK": "2", "LOCAL_RANK": "0"}, True),  # the first process of the second host
        ({**_LAUNCH, "RANK": "0"}, True),  # a launcher that sets no LOCAL_RANK: RANK 0 speaks
        ({**_LAUNCH, "RANK": "2"}, False),
        ({"RANK": "5", "WORLD_SIZE": "4"}, True),  # refused where it matters, not here
    ],
)
def test_one_process_of_each_host_says_the_common_lines(env, says):
    assert torchrun.says_the_common_lines(env) is says
