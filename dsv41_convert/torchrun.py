"""The enclosing torchrun launch, as its environment tells it (no torch import): one process of several
that run the same command line."""

from __future__ import annotations

import os
from collections.abc import Mapping

from dsv41_convert.errors import ConfigError, names_a_rank


def world(env: Mapping[str, str] | None = None) -> int | None:
    """WORLD_SIZE of an enclosing torchrun launch (RANK and WORLD_SIZE both set), or None where neither is.
    ConfigError for one without the other, or values no launch sets: a WORLD_SIZE left in the environment
    alone made `shard` write every other file and exit 0 (an audit)."""
    env = os.environ if env is None else env
    rank, size = env.get("RANK"), env.get("WORLD_SIZE")
    if rank is None and size is None:
        return None
    if rank is None or size is None:
        have, lacks = ("WORLD_SIZE", "RANK") if rank is None else ("RANK", "WORLD_SIZE")
        raise ConfigError(f"{have}={env[have]} is set, {lacks} is not: torchrun sets both; unset {have} to run alone")
    try:
        r, n = int(rank), int(size)
    except ValueError:
        raise ConfigError(f"RANK={rank!r}, WORLD_SIZE={size!r}: not whole numbers, as torchrun sets them") from None
    if not 0 <= r < n:
        raise ConfigError(f"RANK={r}, WORLD_SIZE={n}: RANK must be in 0..WORLD_SIZE-1, as torchrun sets them")
    return n


def rank(env: Mapping[str, str] | None = None) -> int:
    """RANK of this process in an enclosing torchrun launch, 0 outside one."""
    env = os.environ if env is None else env
    return int(env["RANK"]) if world(env) is not None else 0


def shared_rank() -> int | None:
    """This process's RANK where a torchrun launch runs the command in more than one process (their
    stdout and stderr are one stream), else None (also for an environment world() refuses: this decides
    how output is written, also the error that says so)."""
    try:
        size = world()
    except ConfigError:
        return None
    return int(os.environ["RANK"]) if size is not None and size > 1 else None


def says_the_common_lines(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process says what a run says once (shard's and export's result line, OUT, and their
    warnings about SRC): True outside a launch of several processes and where RANK and WORLD_SIZE are set
    without a rendezvous (no launch: lacks_rendezvous); in a launch, for its first process on each host
    (LOCAL_RANK 0, which torchrun sets; RANK 0 without it): a host's processes share one stdout and stderr,
    and each printed them, N times under --nproc-per-node N. Not the process that finishes OUT: two that end
    at once both write manifest.json."""
    env = os.environ if env is None else env
    try:
        if (world(env) or 1) <= 1 or lacks_rendezvous(env):
            return True
    except ConfigError:  # not a launch's environment: refused where it matters (world())
        return True
    return env.get("LOCAL_RANK", str(rank(env))) == "0"


def on_one_host(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is one of several of a torchrun launch that all run on this host (LOCAL_WORLD_SIZE,
    which torchrun sets, equals WORLD_SIZE): they write into one OUT, and the last to finish completes it."""
    env = os.environ if env is None else env
    size = world(env)
    return size is not None and size > 1 and env.get("LOCAL_WORLD_SIZE") == str(size)


def lacks_rendezvous(env: Mapping[str, str] | None = None) -> list[str]:
    """Of MASTER_ADDR and MASTER_PORT, which torchrun sets beside RANK and WORLD_SIZE, those missing in a
    launch of several processes ([] outside one): RANK and WORLD_SIZE left in a shell or a job script
    without torchrun would have this process convert one share and end well."""
    env = os.environ if env is None else env
    if (world(env) or 1) <= 1:
        return []
    return [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]


def by_rank(message: str) -> str:
    """`message` said by one process of a torchrun launch (they share stderr): which one says it."""
    rank = shared_rank()  # a message that names a rank (its own, or one gathered from all) says it
    return message if rank is None or names_a_rank(message) else f"rank {rank}: {message}"
