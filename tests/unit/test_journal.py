"""journal.load: a checkpoint is trusted only when the partial file still hashes to it; asides accumulate."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from dsv41_convert import interrupts
from dsv41_convert.errors import OutputError
from dsv41_convert.store.journal import JournalWriter, header, load

HEAD = header("model0-mp2.safetensors", 4096, "digest", 1024)


def _setup(tmp_path, data: bytes, marks: list[dict]):
    partial, jpath = tmp_path / "f.partial", tmp_path / "j" / "f.journal"
    partial.write_bytes(data)
    fd = os.open(partial, os.O_RDONLY)
    try:
        w = JournalWriter(jpath, [HEAD], fd)
        for m in marks:
            w.put(m)
        w.close()
    finally:
        os.close(fd)
    return partial, jpath


def _mark(data: bytes, end: int, tensor: int = 1, asides=()) -> dict:
    sha = hashlib.sha256(data[:end]).hexdigest()
    return {"end": end, "sha256": sha, "tensor": tensor, "chunk": 2, "skip": 10, "asides": list(asides)}


def _aside(data: bytes, tensor: int, begin: int, end: int) -> dict:
    return {"tensor": tensor, "begin": begin, "end": end, "sha256": hashlib.sha256(data[begin:end]).hexdigest()}


def test_resume_point_carries_the_prefix_hash(tmp_path):
    data = os.urandom(3000)
    partial, jpath = _setup(tmp_path, data, [_mark(data, 1000), _mark(data, 2000, tensor=3)])
    point, why = load(jpath, partial, HEAD)
    assert point is not None and why == "resumed at byte 2000"
    assert (point.end, point.tensor, point.chunk, point.skip) == (2000, 3, 2, 10)
    assert point.sha.hexdigest() == hashlib.sha256(data[:2000]).hexdigest()


def test_the_check_of_a_partial_file_stops_at_an_interrupt(tmp_path, monkeypatch):
    """A writer worker takes Ctrl-C only at interrupts.check() (execute._interrupt_worker), and --resume hashes
    a partial file of tens of GB before its first chunk: the hash checks at every read (a stop waited for the
    whole file, and the CLI's watchdog cut it at 30 s: an audit)."""
    data = os.urandom(3000)
    partial, jpath = _setup(tmp_path, data, [_mark(data, 1000), _mark(data, 2000, tensor=3)])
    monkeypatch.setitem(interrupts._state, "interrupted", True)
    with pytest.raises(KeyboardInterrupt):
        load(jpath, partial, HEAD)


def test_journal_ahead_of_the_data_restarts(tmp_path):
    data = os.urandom(3000)
    partial, jpath = _setup(tmp_path, data, [_mark(data, 2000)])
    os.truncate(partial, 1500)  # the data never reached the disk, the journal did: must not happen, but
    assert load(jpath, partial, HEAD) == (None, "partial file shorter than its journal")


@pytest.mark.parametrize("field", ["chunk", "skip", "tensor"])
@pytest.mark.parametrize("last", [False, True])
def test_a_checkpoint_changed_since_it_was_written_is_not_gone_on_from(tmp_path, field, last):
    """The partial file's digests cover its bytes, not where the writer goes on: a journal whose `chunk` was
    edited was gone on from (an audit; write._fits checks `tensor` and `skip` against the plan, nothing checked
    `chunk`, which picks the next compute chunk). Each line carries a check of its fields: a changed line is
    corrupt (the last one, as if torn: the one before it is gone on from)."""
    data = os.urandom(3000)
    partial, jpath = _setup(tmp_path, data, [_mark(data, 1000), _mark(data, 2000, tensor=3)])
    lines = jpath.read_text().splitlines()
    at = 2 if last else 1
    rec = json.loads(lines[at])
    rec[field] += 1
    lines[at] = json.dumps(rec)
    jpath.write_text("\n".join(lines) + "\n")
    point, why = load(jpath, partial, HEAD)
    if last:
        assert point is not None and point.end == 1000, why
    else:
        assert point is None and why == "journal line 2 is corrupt"


def test_changed_byte_restarts(tmp_path):
    data = bytearray(os.urandom(3000))
    partial, jpath = _setup(tmp_path, bytes(data), [_mark(bytes(data), 1000), _mark(bytes(data), 2000)])
    data[1500] ^= 1
    partial.write_bytes(bytes(data))
    point, why = load(jpath, partial, HEAD)
    assert point is None and why == "bytes [0, 2000) differ from the journal"


def test_asides_accumulate_until_their_tensor_is_passed(tmp_path):
    data = os.urandom(4096)
    first = _mark(data, 1000, tensor=1, asides=[_aside(data, 7, 3000, 3500), _aside(data, 2, 2500, 2600)])
    second = _mark(data, 1200, tensor=4, asides=[_aside(data, 7, 3000, 3900)])  # tensor 7 grew
    partial, jpath = _setup(tmp_path, data, [first, second])
    point, _ = load(jpath, partial, HEAD)
    assert [(a.tensor, a.begin, a.end) for a in point.asides] == [(7, 3000, 3900)]  # tensor 2 is done
    assert point.asides[0].sha.hexdigest() == hashlib.sha256(data[3000:3900]).hexdigest()
    with open(partial, "r+b") as f:
        f.seek(3800)
        f.write(bytes([data[3800] ^ 1]))  # a zero byte failed 1 run in 256: the random byte may be zero
    assert load(jpath, partial, HEAD)[1] == "bytes [3000, 3900) written ahead differ from the journal"


def test_other_plan_is_an_error_other_file_a_restart(tmp_path):
    data = os.urandom(3000)
    partial, jpath = _setup(tmp_path, data, [_mark(data, 1000)])
    with pytest.raises(OutputError, match=r"f\.partial: started by a run with other options"):
        load(jpath, partial, HEAD | {"plan_digest": "other"})
    assert load(jpath, partial, HEAD | {"size": 5000})[0] is None
    lines = jpath.read_text().splitlines()
    assert json.loads(lines[0]) == HEAD and len(lines) == 2
