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


def test_a_look_at_the_claims_leaves_the_other_records_of_the_folder_alone(tmp_path):
    """The claims live in the done records' folder: a look that took every file there for a claim removed the
    done records and source stamps (no process holds them) and named the file locks a share holds as plans
    running now, refusing that share."""
    records = tmp_path / ".dsv41-convert"
    records.mkdir()
    kept = {
        "model0-mp2.safetensors.done.json": b'{"size": 1}',
        "source-host1.json": b"{}",
        "model1-mp2.safetensors.replacing": b"",
    }
    for name, data in kept.items():
        (records / name).write_bytes(data)
    lock = os.open(records / "model1-mp2.safetensors.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_SH)  # a share writing model1 holds its file lock
        with claimed(tmp_path, "a") as (_, live):
            assert live == []
    finally:
        os.close(lock)
    for name, data in kept.items():
        assert (records / name).read_bytes() == data, name


def test_a_claim_stays_while_another_share_of_its_plan_holds_it(tmp_path):
    """Two shares of plan b: the first to finish must leave the claim to the other (only the last holder removes
    it); removed under the running share, a share of another plan started then saw no claim of b and wrote its
    files into the same folder."""
    claim = tmp_path / ".dsv41-convert" / "plan-b.claim"
    with claimed(tmp_path, "b"):
        with claimed(tmp_path, "b"):
            pass
        assert claim.is_file()
        with claimed(tmp_path, "c") as (_, live):
            assert live == ["b"]
    assert not claim.exists()


def test_a_claim_removed_between_its_open_and_its_lock_is_made_again(tmp_path, monkeypatch):
    """The last holder of a claim (or a look that found it stale) may remove the file between a share's open and
    its shared lock: the share must open the claim again, not hold a descriptor of a file no longer in the folder
    (which no other share's look can see)."""
    real = fcntl.flock
    removed = []

    def flock(fd, op):
        if op == fcntl.LOCK_SH and not removed:  # the first shared lock: the file goes just before it
            path = tmp_path / ".dsv41-convert" / "plan-a.claim"
            path.unlink()
            removed.append(path)
        return real(fd, op)

    monkeypatch.setattr(plan_claims.fcntl, "flock", flock)
    with claimed(tmp_path, "a") as (fd, _):
        path = removed[0]
        assert path.is_file() and os.stat(path).st_ino == os.fstat(fd).st_ino
        monkeypatch.setattr(plan_claims.fcntl, "flock", real)
        with claimed(tmp_path, "b") as (_, live):
            assert live == ["a"]


def test_links_named_as_claims_are_neither_followed_nor_taken_for_claims(tmp_path):
    """A symbolic link at a share's own claim name is removed and a claim file made in its place (opened through
    O_NOFOLLOW it was an OSError ending the share); a link named as another plan's claim is no claim: a look that
    followed it took a lock some other program holds on the target for a running plan. Targets stay as they were."""
    records = tmp_path / ".dsv41-convert"
    records.mkdir()
    victim = tmp_path / "notes.txt"
    victim.write_text("mine")
    (records / "plan-a.claim").symlink_to(victim)
    (records / "plan-x.claim").symlink_to(victim)
    held = os.open(victim, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_SH)  # another program's lock on the target
        with claimed(tmp_path, "a") as (fd, live):
            claim = records / "plan-a.claim"
            assert not claim.is_symlink() and os.stat(claim).st_ino == os.fstat(fd).st_ino
            assert live == []
    finally:
        os.close(held)
    assert victim.read_text() == "mine"
