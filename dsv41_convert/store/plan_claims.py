"""Which plans the shares writing into one folder convert right now. A share (--ranks, a torchrun process)
holds a shared flock on `.dsv41-convert/plan-<digest>.claim` while it runs, and looks for the claims of
other plans that a live process holds: fragments and done records tell only of shares that finished, so
two shares of two plans started at once into a fresh folder both wrote their files and exited 0, the
folder's config.json the last one's (an audit).

A share claims first and looks second, so of two shares of two plans started together at least the one
that looks last sees the other's claim. The last holder of a claim removes it; one no process holds (its
run was killed) is removed by the next share that looks.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsv41_convert.store.own_files import NEW_FILE, remove_link

CLAIMS_DIR = ".dsv41-convert"  # the done records' folder (manifest.DONE_DIR)
_PREFIX, _SUFFIX = "plan-", ".claim"


@contextmanager
def claimed(folder: Path, digest: str) -> Iterator[tuple[int, list[str]]]:
    """Claim `folder` for plan `digest` until the block ends -> (the claim's descriptor, for worker processes
    to hold with the run; the digests of the other plans whose claims live processes hold)."""
    where = Path(folder) / CLAIMS_DIR
    where.mkdir(exist_ok=True)
    path = where / f"{_PREFIX}{digest}{_SUFFIX}"
    fd = _hold_shared(path)
    try:
        yield fd, _live_others(where, digest)
    finally:
        try:  # the last holder removes it (a refused share leaves its folder as it was)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)


def _hold_shared(path: Path) -> int:
    """A descriptor of the claim file at `path` holding a shared flock, the file still under that name (one
    removed between the open and the lock, by its last holder or a look that found it stale, is opened
    again). -> the descriptor"""
    while True:
        remove_link(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, NEW_FILE)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for a look or a removal (an exclusive try, let go at once)
        try:
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def live_claims(folder: Path, digest: str) -> list[str]:
    """For a dry run: the digests of other plans whose claims in `folder` a process holds, as a share sees
    them (claimed); no claim is made and none removed."""
    where = Path(folder) / CLAIMS_DIR
    return _live_others(where, digest, remove=False) if where.is_dir() else []


def _live_others(where: Path, digest: str, remove: bool = True) -> list[str]:
    """The digests of other plans' claims in `where` that a process holds; the others are removed (`remove`)."""
    live = []
    for path in where.iterdir():
        name = path.name
        if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)) or name == f"{_PREFIX}{digest}{_SUFFIX}":
            continue
        try:  # read-write: NFSv4 refuses an exclusive flock on a read-only descriptor (EBADF: an audit)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # gone meanwhile, or a link: no claim of a share's
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.append(name[len(_PREFIX) : -len(_SUFFIX)])
        else:
            if remove:
                path.unlink(missing_ok=True)  # its run ended without letting it go (killed)
        finally:
            os.close(fd)
    return sorted(live)
