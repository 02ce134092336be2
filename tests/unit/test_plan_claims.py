"""store/plan_claims.py: the claims of running shares, live and stale, also on a filesystem whose exclusive
locks need a descriptor open for writing (NFSv4)."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from dsv41_convert.store import plan_claims
from dsv41_convert.store.plan_claims import claimed


def test_a_live_claim_of_another_plan_is_seen_a_stale_one_removed(tmp_path):
    with claimed(tmp_path, "a") as (_, live):
        assert live == []
        with claimed(tmp_path, "b") as (_, live), claimed(tmp_path, "b") as (_, again):
            assert live == ["a"] and again == ["a"]  # a second process of plan b
    stale = tmp_path / ".dsv41-convert" / "plan-c.claim"  # a share killed: its claim held by nobody
    stale.write_bytes(b"")
    with claimed(tmp_path, "d") as (_, live):
        assert live == [] and not stale.exists()
    assert not list((tmp_path / ".dsv41-convert").iterdir())  # each claim removed by its last holder


@pytest.fixture
def nfs_like_locks(monkeypatch):
    """fcntl.flock as the Linux NFSv4 client does it: an exclusive lock on a descriptor open read-only is EBADF."""
    real = fcntl.flock

    def flock(fd, op):
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real(fd, op)

    monkeypatch.setattr(plan_claims.fcntl, "flock", flock)


def test_claims_on_a_filesystem_whose_exclusive_locks_need_write_access(tmp_path, nfs_like_locks):
    """A stale claim of another plan made every share fail with "Bad file descriptor" on NFSv4 (an audit: the
    look opened it read-only); a live one was never named."""
    stale = tmp_path / ".dsv41-convert" / "plan-c.claim"
    stale.parent.mkdir()
    stale.write_bytes(b"")
    with claimed(tmp_path, "a") as (_, live):
        assert live == [] and not stale.exists()
        with claimed(tmp_path, "b") as (_, live):
            assert live == ["a"]
