"""The Sink hashes a large chunk in its hasher thread while it writes the same chunk (store/hasher.py), and
the file and its sha256 are those of the bytes handed over. Planted faults it catches: the hash run before
or after the write instead of beside it (the barrier below times out), a chunk hashed twice or not at all
(the digest differs)."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from dsv41_convert.store import sink as sink_module
from dsv41_convert.store.sink import Sink

CHUNK = 2 << 20


class _MeetingSha:
    """A sha256 whose large updates wait at `meet` (with the writer's pwrite): both must run at once."""

    def __init__(self, meet: threading.Barrier):
        self.inner, self.meet, self.threads = hashlib.sha256(), meet, set()

    def update(self, data) -> None:
        if len(data) >= sink_module.HASH_APART_BYTES:
            self.threads.add(threading.current_thread().name)
            self.meet.wait()
        self.inner.update(data)

    def copy(self):
        return self.inner.copy()

    def hexdigest(self) -> str:
        return self.inner.hexdigest()


@pytest.fixture(autouse=True)
def _hasher_on_any_machine(monkeypatch):
    monkeypatch.setattr(sink_module, "HASH_THREAD_CORES", 1)


def test_a_chunk_is_hashed_while_it_is_written(tmp_path, monkeypatch):
    meet = threading.Barrier(2, timeout=10)
    real = os.pwrite

    def pwrite(fd, data, pos):
        if len(data) >= sink_module.HASH_APART_BYTES:
            meet.wait()
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)
    chunks = [os.urandom(CHUNK) for _ in range(3)] + [b"tail"]
    total = sum(map(len, chunks))
    path = tmp_path / "f.partial"
    sink = Sink(path, "f", total, lambda label, done, n: None, direct=False)  # pwrite in the writer thread
    sink.sha = sha = _MeetingSha(meet)
    for c in chunks:
        sink.write(memoryview(c))
    sink.finish()
    os.close(sink.fd)
    data = b"".join(chunks)
    assert path.read_bytes() == data
    assert sha.hexdigest() == hashlib.sha256(data).hexdigest()
    assert sha.threads == {"sha256 f"}, sha.threads
    assert sink.done == total
    assert {"hash", "write", "wait_hash"} <= set(sink.stages)


def test_no_hasher_thread_below_the_core_count(tmp_path, monkeypatch):
    """With fewer usable cores than HASH_THREAD_CORES the writer thread hashes (and nothing else changes)."""
    monkeypatch.setattr(sink_module, "HASH_THREAD_CORES", 1 << 20)
    threads: set[str] = set()
    real = hashlib.sha256

    class Spy:
        def __init__(self):
            self.inner = real()

        def update(self, data):
            threads.add(threading.current_thread().name)
            self.inner.update(data)

    data = os.urandom(3 * CHUNK)
    sink = Sink(tmp_path / "f.partial", "f", len(data), lambda label, done, n: None)
    sink.sha = spy = Spy()
    for i in range(3):
        sink.write(memoryview(data)[i * CHUNK : (i + 1) * CHUNK])
    sink.finish()
    os.close(sink.fd)
    assert threads == {"write f"} and spy.inner.hexdigest() == hashlib.sha256(data).hexdigest()
    assert (tmp_path / "f.partial").read_bytes() == data


def test_a_hash_error_reaches_the_caller(tmp_path):
    class Broken:
        def update(self, data):
            raise ValueError("broken hash")

    sink = Sink(tmp_path / "f.partial", "f", CHUNK, lambda label, done, n: None)
    sink.sha = Broken()
    sink.write(memoryview(bytes(CHUNK)))
    try:
        sink.finish()
    except ValueError as exc:
        assert "broken hash" in str(exc)
    else:
        raise AssertionError("the hasher's error was lost")
    finally:
        os.close(sink.fd)


def test_padding_is_exactly_the_count_asked_for(tmp_path):
    """fill() of a count that is no multiple of its chunk: the last piece is cut to what is left, so the file
    and its sha256 hold `count` padding bytes and no more."""
    path = tmp_path / "f.partial"
    sink = Sink(path, "f", 4 + 10, lambda label, done, n: None, direct=False)
    sink.write(memoryview(b"head"))
    sink.fill(0xAB, 10, 4, "layers.0.attn.wq_a.weight")
    sink.finish()
    os.close(sink.fd)
    want = b"head" + b"\xab" * 10
    assert path.read_bytes() == want and sink.sha.hexdigest() == hashlib.sha256(want).hexdigest()
