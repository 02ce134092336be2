"""One writer per output folder: advisory locks that die with the process holding them.

A command that writes into a folder holds `FOLDER/.dsv41-convert.lock` from before its first byte to its
end (`hold`). The lock is the operating system's (`flock` on an open descriptor), not the file's
existence: when the holder exits, is killed (kill -9) or the machine loses power, the kernel drops it and
the next run takes it at once, so `--resume` needs nothing cleared by hand. The file only carries who
holds it, one JSON line per holder (pid, host, command line, start time), for the message a second writer
gets: `LockedError` (exit 2) naming the folder and the holder.

Two modes:
- exclusive (`shard` of every rank, `manifest`, `download --local-dir`, `reference-logits`' folder, `make-tiny`,
  `export`): nobody else may hold the folder.
- shared, with an exclusive lock per file (`shard --ranks`, each torchrun process): shares of one
  conversion that write different rank files run together in one folder; two processes that would
  write the same rank file collide, and an exclusive holder (a `manifest` merge) excludes them all.
  File locks live in `FOLDER/.dsv41-convert/<file>.lock`.

A run that writes through worker processes hands them its lock descriptors (`FolderLock.descriptors`,
passed as the same open files: die_with.SharedFiles), so the lock is held until the last of them exits:
after a kill -9 of the run its workers die a moment later (die_with.py), and until then a new run that
finds the lock busy and its named holders gone waits for them (up to ORPHANS_WAIT_S; after
ORPHANS_NOTICE_S it says so on stderr), instead of writing beside them.

The last holder removes the lock file when it is done: an exclusive one always, a shared one when it can
turn its lock exclusive for a moment (no other share holds it). Removing is safe because every taker
checks, after locking, that the descriptor it locked is still the file at the path (else it locked a
file its last holder just removed, and it tries again); a lock found busy is tried a few times over
60 ms before it is reported, so a share's brief exclusive moment is not taken for a writer. The lines
of shares that ended while others went on stay in the file; readers skip those of processes of this
host that are gone.

Network file systems: on Linux >= 2.6.12 an NFS client emulates flock with POSIX byte-range locks over
NLM (NFSv3) or the NFSv4 lock state, so processes on different hosts exclude each other when the server
supports locking; a lock of a host that died is released when the server's lease or NLM grace period ends
(NFSv4: about 90 s), until then a new run is refused. A mount without lock support either fails the lock
(ENOLCK: `hold` refuses to write, naming the folder) or, with `-o nolock` / `local_lock=all`, keeps locks
local to each host: then only processes on the same host exclude each other.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from dsv41_convert import torchrun
from dsv41_convert.errors import LockedError, OutputError
from dsv41_convert.store.own_files import NEW_FILE, linked

LOCK_NAME = ".dsv41-convert.lock"
FILE_LOCK_DIR = ".dsv41-convert"  # the done records' folder (manifest.DONE_DIR)
BUSY_TRIES, BUSY_WAIT_S = 4, 0.02  # a busy lock is reported after this many tries (60 ms), not at the first
ORPHANS_WAIT_S = 60.0  # how long a lock whose named holders are gone may stay held by the processes they started
ORPHANS_NOTICE_S = 1.0  # after this long such a wait says so on stderr (it is usually over in milliseconds)


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: what the lock file says about its process."""

    pid: int
    host: str
    command: str
    started: str  # UTC, ISO 8601
    mode: str  # exclusive | shared

    @classmethod
    def me(cls, mode: str) -> Holder:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        return cls(os.getpid(), socket.gethostname(), shlex.join(sys.argv), started, mode)

    def line(self) -> bytes:
        return (json.dumps(vars(self)) + "\n").encode()

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.started} ({self.command})"

    def gone(self) -> bool:
        """A process of this host that no longer exists (a line left by a finished shared holder)."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


def read_holders(data: bytes) -> list[Holder]:
    """The holders a lock file names, in order; lines that do not parse (a write cut short) are skipped."""
    holders = []
    for line in data.decode(errors="replace").splitlines():
        try:
            holders.append(Holder(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return holders


class Lock:
    """One held lock: an open descriptor of `path` carrying a flock."""

    def __init__(self, path: Path, fd: int, exclusive: bool, stale: list[Holder]):
        self.path, self.fd, self.exclusive = path, fd, exclusive
        self.stale = stale  # exclusive holders named in the file when this lock was taken: they died holding it

    def release(self) -> None:
        """Drop the lock; the last holder (an exclusive one, or a shared one found alone) removes the file."""
        if self.fd < 0:
            return
        alone = self.exclusive
        if not alone:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except OSError:
                pass
        # a taker between its open and flock finds the path gone and retries (see `take`). Only our file: a folder
        # renamed meanwhile may hold another run's at this path. A folder made read-only (or gone) keeps it, held
        # by no one (the next taker uses it), and the run's own error, or its success, stands
        if alone and _is_at(self.fd, self.path):
            with suppress(OSError):
                self.path.unlink()
        os.close(self.fd)  # drops the flock
        self.fd = -1


def take(path: Path, exclusive: bool, what: str) -> Lock:
    """Lock `path` (created if absent) without waiting, and write this process into it.

    what: the thing protected, for the message (a folder or a file).
    Raises LockedError naming `what` and its holder(s) if another process holds a conflicting lock.
    """
    holder = Holder.me("exclusive" if exclusive else "shared")
    busy, orphans_since, told = 0, None, False
    while True:
        try:
            # a link planted at its name is not followed (an exclusive taker truncates what it opened: an audit),
            # nor removed (between a check and the removal another taker may have put its lock file there)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, NEW_FILE)
        except OSError as exc:
            if exc.errno == errno.ENOENT and path.parent.name == FILE_LOCK_DIR and path.parent.parent.is_dir():
                path.parent.mkdir(exist_ok=True)  # the last share to leave removed the file locks' folder
                continue
            if exc.errno == errno.ELOOP:
                raise _not_ours(what, path, "is a link") from exc
            raise OutputError(f"{what}: cannot create the lock file {path.name} ({exc.strerror})") from exc
        if linked(os.fstat(fd)):  # a hard link: an exclusive taker truncates it, and with it the other name's file
            if _unheld_name_removed(fd, path):  # a killed run's, copied with `cp -al` (an audit): a new one
                continue
            raise _not_ours(what, path, "has another name (a hard link)")
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            data = _read_all(fd)
            os.close(fd)
            busy += 1
            if busy < BUSY_TRIES:  # a last shared holder checks it is alone for a moment while it releases
                time.sleep(BUSY_WAIT_S)
                continue
            if _orphaned(data):  # a killed run's workers hold it until they die with it
                orphans_since = orphans_since or time.monotonic()
                waited = time.monotonic() - orphans_since
                if waited < ORPHANS_WAIT_S:
                    if not told and waited > ORPHANS_NOTICE_S:
                        told = True
                        said = f"{what}: {_named(data)} ended; waiting for processes it started to exit"
                        sys.stderr.write(f"{torchrun.by_rank(said)} (up to {ORPHANS_WAIT_S:.0f} s)\n")
                    time.sleep(BUSY_WAIT_S)
                    continue
                raise LockedError(
                    f"{what}: {_named(data)} ended, but processes it started still hold the lock after "
                    f"{ORPHANS_WAIT_S:.0f} s (its workers, a write stuck on the device?); stop them or wait"
                ) from None
            raise LockedError(f"{what}: in use by {_who(data)}; wait for it to end or stop it") from None
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise OutputError(
                    f"{what}: the file system does not support locks ({exc.strerror}), so nothing could stop a "
                    "second writer; write to a local disk or mount with lock support"
                ) from exc
            raise
        if _is_at(fd, path):
            break
        os.close(fd)  # its last holder removed it between our open and flock: take the new one
    stale: list[Holder] = []
    if exclusive:
        stale = [h for h in read_holders(_read_all(fd)) if h.mode == "exclusive"]
        os.ftruncate(fd, 0)
    try:
        os.write(fd, holder.line())  # O_APPEND: shared holders' lines do not overwrite each other
    except OSError as exc:  # a full disk: said with no path at all (an audit)
        os.close(fd)
        raise OutputError(f"{what}: cannot write the lock file {path.name} ({exc.strerror})") from exc
    return Lock(path, fd, exclusive, stale)


def _not_ours(what: str, path: Path, found: str) -> OutputError:
    """The refusal of a lock file `take` may not use: a link planted at its name, or one with another name that a
    process holds. found: what it is ("is a link")."""
    return OutputError(f"{what}: {path} {found}, not a lock file of ours; remove it")


def _unheld_name_removed(fd: int, path: Path) -> bool:
    """For a lock file with another name: where no process holds it, remove this name (under an exclusive
    flock, so a taker that opened it finds it gone and retries) -> True; else False. Closes `fd` either way."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    if _is_at(fd, path):
        path.unlink()
    os.close(fd)
    return True


def _is_at(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, min(size, 1 << 20), 0)


def _orphaned(data: bytes) -> bool:
    """Whether the lock file names holders and all of them are gone from this host: what still holds the lock
    are processes they started, sharing its descriptor."""
    holders = read_holders(data)
    return bool(holders) and all(h.gone() for h in holders)


def _named(data: bytes) -> str:
    return "; ".join(h.describe() for h in read_holders(data))


def _who(data: bytes) -> str:
    holders = [h for h in read_holders(data) if not h.gone()]
    if not holders:
        return "another process (it has not written its name yet, or its file system hides it)"
    return "; ".join(h.describe() for h in holders)


class FolderLock:
    """The locks `hold` took: the folder's and, in shared mode, one per file."""

    def __init__(self, folder: Path, folder_lock: Lock, file_locks: dict[str, Lock]):
        self.folder, self.lock, self.files = folder, folder_lock, file_locks

    @property
    def stale(self) -> list[Holder]:
        """Exclusive holders that died holding the folder or one of the files (kill -9, power loss) and whose
        locks were taken over."""
        return self.lock.stale + [h for lock in self.files.values() for h in lock.stale]

    def descriptors(self) -> list[int]:
        """The open lock files (the folder's, then the files'): a worker process given these (as the same open
        files) holds the locks with the run until it exits."""
        return [self.lock.fd, *(lock.fd for lock in self.files.values())]


@contextmanager
def hold(folder: Path, *, shared: bool = False, files: Iterable[str] = ()) -> Iterator[FolderLock]:
    """Hold `folder` (which must exist) until the block ends: exclusively, or shared with an exclusive lock on
    each of `files` (names inside `folder`). Raises LockedError at once if another process holds it.

    The one call every command that writes into a folder makes before its first write:
        with hold(out):
            ...write...
    """
    folder = Path(folder)
    files = list(files)
    if files and not shared:
        raise ValueError("file locks are for shared holders; an exclusive holder has the whole folder")
    with ExitStack() as stack:
        where = str(folder.resolve())
        folder_lock = take(folder / LOCK_NAME, not shared, where)
        stack.callback(folder_lock.release)
        file_locks: dict[str, Lock] = {}
        if files:
            (folder / FILE_LOCK_DIR).mkdir(exist_ok=True)
            # after the file locks (released first): the folder goes with the last of them, unless it holds more
            # (the done records), so a share refused at its start leaves OUT as it found it
            stack.callback(_remove_if_empty, folder / FILE_LOCK_DIR)
        for name in sorted(files):
            lock = take(folder / FILE_LOCK_DIR / f"{name}.lock", True, f"{where}/{name}")
            stack.callback(lock.release)
            file_locks[name] = lock
        yield FolderLock(folder, folder_lock, file_locks)


def _remove_if_empty(folder: Path) -> None:
    with suppress(OSError):
        folder.rmdir()


def refuse_held(folder: Path, *, shared: bool = False, files: Iterable[str] = ()) -> None:
    """For a --dry-run: the LockedError `hold(folder, shared=shared, files=files)` would raise now, where another
    process holds the folder or one of the files; nothing is created or written, and no lock is kept. A lock
    whose named holders are all gone (their workers end with them) is not a refusal: the run waits for it.
    For a reader (`check`, `verify`, `reference-logits` of rank files), `refuse_held(folder)`: any run writing
    into the folder, a share too, is named (its files may be half-written, removed or replaced meanwhile)."""
    folder = Path(folder)
    where = str(folder.resolve())
    _probe(folder / LOCK_NAME, not shared, where)
    for name in sorted(files):
        _probe(folder / FILE_LOCK_DIR / f"{name}.lock", True, f"{where}/{name}")


def _probe(path: Path, exclusive: bool, what: str) -> None:
    """LockedError where another process holds `path` against a lock of this kind (see `take`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:  # no lock file: nobody holds it; a link is refused here, as `take` refuses it
        if exc.errno == errno.ELOOP:  # (before a progress display: after its title it read as a run begun)
            raise _not_ours(what, path, "is a link") from exc
        return
    try:
        if linked(os.fstat(fd)):  # as `take` finds it: replaced where nobody holds it, else refused
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return  # dropped with the descriptor
            except BlockingIOError:
                raise _not_ours(what, path, "has another name (a hard link)") from None
            except OSError:  # no locks on this file system: the run says so
                return
        for _ in range(BUSY_TRIES):
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                return  # dropped with the descriptor
            except BlockingIOError:
                time.sleep(BUSY_WAIT_S)
            except OSError:  # no locks on this file system: the run says so
                return
        data = _read_all(fd)
        if not _orphaned(data):
            raise LockedError(f"{what}: in use by {_who(data)}; wait for it to end or stop it")
    finally:
        os.close(fd)


def is_lock_entry(name: str) -> bool:
    """A name in a folder that belongs to the locks, not to the data (for "is the folder empty" checks)."""
    return name == LOCK_NAME
