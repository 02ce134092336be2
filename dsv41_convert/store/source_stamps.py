"""The source a run reads from, as it was: the size and modification time of each weight shard, kept in OUT
so that --resume on the same machine refuses to continue from a source that changed in between (a shard
fetched again after `download` found it bad, an edited file) or from another folder of the same layout (a
second fine-tune): the rank files finished or started before may hold the old bytes, and their done
records cannot tell (they describe the output).

Per machine and source path (`OUT/.dsv41-convert/source-HOST.json`): the times of another machine's copy
say nothing about this one's, so a folder gathered from several machines compares each record only where
it was made. The plan digest stays free of them (shares on several machines must agree on it).
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Collection
from pathlib import Path

from dsv41_convert.errors import VerifyInputError, first_few
from dsv41_convert.store.manifest import DONE_DIR, atomic_write

Stamps = dict[str, list[int]]  # file name -> [size, mtime in ns]
PREFIX = "source-"  # the records' names in OUT/.dsv41-convert: source-HOST.json


def source_stamps(src: Path, names: Collection[str] | None = None) -> Stamps:
    """Size and modification time of every weight shard (*.safetensors) of `src`; with `names`, of those of them."""
    stamps = {}
    for p in sorted(Path(src).glob("*.safetensors")):
        if names is None or p.name in names:
            stamp = _stamp(p)
            if stamp is not None:
                stamps[p.name] = stamp
    return stamps


def _stamp(path: Path) -> list[int] | None:
    """[size, mtime in ns] of `path`; of the link itself where it leads to no file (its target gone, a loop), for
    the reader to name it (check: a problem, exit 1; a plan: refused, naming it): followed, it ended check, verify
    and reference-logits in "No such file or directory" of a name `ls` shows (an audit). None where nothing is
    there any more (removed since the folder was listed)."""
    try:
        st = path.stat()
    except OSError:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return None
    return [st.st_size, st.st_mtime_ns]


def stamps_digest(stamps: Stamps) -> str:
    """One name for a source as `stamps` saw it, kept in each done record a run writes: a record of another
    digest was written from another folder of the layout (or the same one changed since), one of this digest
    from these very files (or a copy keeping their times)."""
    return hashlib.sha256(json.dumps(stamps, sort_keys=True).encode()).hexdigest()


def differing(before: Stamps, now: Stamps) -> list[str]:
    """The shards whose size or time differ between two stamps of one source, added and removed ones too."""
    return sorted(n for n in set(before) | set(now) if before.get(n) != now.get(n))


def require_unchanged(folder: Path, stamps: Stamps, then: str, names: Collection[str] | None = None) -> None:
    """VerifyInputError where a *.safetensors file of `folder` changed (size or modification time, as `differing`)
    since `stamps` (source_stamps(folder)) were taken before a reader's first header; `then`: what it does not do
    now and the way out, for the message. The readers that compare what they read with something read at
    another time (reference-logits and `verify --reference SRC` of SRC; verify and check of CONVERTED) call it
    once their last read is done: a file rewritten meanwhile (a download fetching a shard again, `shard
    --overwrite` into CONVERTED, which the lock refuses only while it is held when the reader starts) gave
    exit 0 and a reference of two versions, or a verdict on files some of the checks never read (a helper's
    hunt). names: the files `stamps` were taken of (source_stamps' `names`), None for every shard."""
    changed = differing(stamps, source_stamps(folder, names))
    if changed:
        raise VerifyInputError(
            f"{folder}: {first_few(changed)} changed (size or modification time) while this run read it, so what it "
            f"read may be of two versions: {then}"
        )


def _record_path(out: Path) -> Path:
    return Path(out) / DONE_DIR / f"{PREFIX}{socket.gethostname()}.json"


def record_stamps(out: Path, src: Path, stamps: Stamps) -> None:
    """Keep `stamps` of `src` in OUT for this machine."""
    (Path(out) / DONE_DIR).mkdir(exist_ok=True)
    doc = {"src": str(Path(src).resolve()), "files": stamps}
    atomic_write(_record_path(out), json.dumps(doc, indent=1).encode())


def changed_since(out: Path, src: Path, stamps: Stamps) -> tuple[list[str], str | None]:
    """The shards of `src` whose size or time differ from this machine's record in OUT (added and removed ones
    included), and the source folder that record was made from where it is not `src` (else None). ([], None)
    without a record (a first run, an older version). A record of another folder counts too: two folders of
    one layout (two fine-tunes of the model) have the same plan, and only the files' stamps tell them
    apart; a folder moved, or copied keeping the times (cp -a), matches its record."""
    try:
        doc = json.loads(_record_path(out).read_bytes())
    except (FileNotFoundError, ValueError):
        return [], None
    if not isinstance(doc, dict) or not isinstance(before := doc.get("files"), dict):
        return [], None
    changed = differing(before, stamps)
    elsewhere = None if doc.get("src") == str(Path(src).resolve()) else str(doc.get("src"))
    return changed, elsewhere
