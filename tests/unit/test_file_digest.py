"""store/file_digest.py: whole files against their records, several at once."""

import hashlib
import os
import threading

import numpy as np
import pytest

from dsv41_convert.store import file_digest
from dsv41_convert.store.file_digest import (
    Problem,
    Recorded,
    difference,
    differences,
    mismatch,
    mismatches,
    sha256_file,
)


def _record(path, where="manifest", if_missing=""):
    data = path.read_bytes()
    return Recorded(len(data), hashlib.sha256(data).hexdigest(), where, if_missing)


@pytest.mark.parametrize("size", [0, 1, 6, 7, 8, 4096 * 7 + 3])
def test_sha256_file_matches_hashlib_across_chunk_edges(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    seen = []
    assert sha256_file(tmp_path / "f", chunk=7, on_bytes=seen.append) == hashlib.sha256(data).hexdigest()
    assert seen == list(range(7, size, 7)) + ([size] if size else [])  # every chunk, the last one partial


def test_mismatch_names_the_file_and_what_differs(tmp_path):
    f = tmp_path / "model3-mp8.safetensors"
    f.write_bytes(b"a" * 1000)
    rec = _record(f, "fragment r3", "; copy it")
    assert mismatch(f, f.name, rec) is None
    f.write_bytes(b"a" * 999 + b"b")
    assert mismatch(f, f.name, rec) == f"{f.name}: sha256 {hashlib.sha256(f.read_bytes()).hexdigest()[:16]}..., " + (
        f"fragment r3 says {rec.sha256[:16]}...; corrupt?"
    )
    f.write_bytes(b"a" * 999)
    assert mismatch(f, f.name, rec) == f"{f.name}: 999 bytes, fragment r3 says 1000; truncated or replaced?"
    f.unlink()
    assert mismatch(f, f.name, rec) == f"{f.name}: missing (fragment r3 lists 1000 bytes); copy it"
    f.mkdir()  # not a plain file: named for what it is (it was "missing")
    assert mismatch(f, f.name, rec) == f"{f.name}: a folder where fragment r3 lists a file of 1000 bytes"
    f.rmdir()
    f.symlink_to(tmp_path / "gone")
    assert mismatch(f, f.name, rec) == f"{f.name}: a broken link where fragment r3 lists a file of 1000 bytes"


def test_a_fifo_at_a_listed_name_is_named_for_what_it_is(tmp_path):
    """A FIFO (socket, device) where the record lists a file was reported as "missing (manifest lists N
    bytes)", by `check`, `manifest` and `--resume` alike, though something is there: named for what it is,
    as a folder and a broken link are."""
    f = tmp_path / "tokenizer.json"
    rec = Recorded(21513, "0" * 64, "manifest")
    os.mkfifo(f)
    assert (
        mismatch(f, f.name, rec) == f"{f.name}: a FIFO, a socket or a device where manifest lists a file of 21513 bytes"
    )


def test_difference_compares_the_digest_the_record_has(tmp_path):
    """sha256 when recorded; else the git blob id; neither: the size only. A planted change is caught by each."""
    f = tmp_path / "config.json"
    f.write_bytes(b'{"a": 1}\n')
    git_id = hashlib.sha1(b"blob 9\0" + f.read_bytes()).hexdigest()
    by_sha256 = _record(f, "download record")
    by_git = Recorded(9, None, "download record", git_sha1=git_id)
    by_size = Recorded(9, None, "download record")
    assert [difference(f, f.name, rec) for rec in (by_sha256, by_git, by_size)] == [None, None, None]
    f.write_bytes(b'{"a": 2}\n')
    changed = hashlib.sha1(b"blob 9\0" + f.read_bytes()).hexdigest()
    assert difference(f, f.name, by_git) == Problem(f.name, "git-sha1", changed, git_id)
    assert difference(f, f.name, by_sha256).kind == "sha256"
    assert difference(f, f.name, by_size) is None  # what a size-only record cannot see
    assert (
        mismatch(f, f.name, by_git)
        == f"{f.name}: git-sha1 {changed[:16]}..., download record says {git_id[:16]}...; corrupt?"
    )
    f.write_bytes(b"{}")
    assert difference(f, f.name, by_size) == Problem(f.name, "size", "2 bytes", "9 bytes")
    f.unlink()
    assert str(difference(f, f.name, by_git)) == f"{f.name}: missing: found no file, expected 9 bytes"


def _planted(tmp_path, n=6, size=(1 << 20) + 5):
    """n files with records; file 1 gets a flipped byte; of n > 4, file 3 is truncated and file 4 removed."""
    files = {}
    for i in range(n):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes())
        files[path.name] = (path, _record(path))
    with open(tmp_path / "f1.bin", "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 1]))
    if n > 4:
        with open(tmp_path / "f3.bin", "r+b") as f:
            f.truncate(size - 1)
        (tmp_path / "f4.bin").unlink()
    return files


@pytest.mark.parametrize("threads", [1, 2, 4, None])
def test_mismatches_finds_each_planted_fault_in_order(tmp_path, threads):
    files = _planted(tmp_path)
    got = mismatches(files, threads)
    assert list(got) == list(files)  # the caller's order, whichever thread finished first
    assert [name for name, problem in got.items() if problem is None] == ["f0.bin", "f2.bin", "f5.bin"]
    assert "sha256" in got["f1.bin"] and "truncated" in got["f3.bin"] and "missing" in got["f4.bin"]
    kinds = {name: p.kind for name, p in differences(files, threads).items() if p is not None}
    assert kinds == {"f1.bin": "sha256", "f3.bin": "size", "f4.bin": "missing"}


def test_files_are_hashed_at_the_same_time(tmp_path):
    """With two threads, two files are in progress at once: each first progress call waits for the other."""
    files = _planted(tmp_path, n=2)
    both = threading.Barrier(2, timeout=20)
    progress_seen = {}

    def progress(name, done, total):
        if done == 0:
            both.wait()  # BrokenBarrierError (so the test fails) unless the other file has started too
        progress_seen.setdefault(name, []).append((done, total))

    got = mismatches(files, threads=2, progress=progress)
    assert got == {"f0.bin": None, "f1.bin": got["f1.bin"]} and "sha256" in got["f1.bin"]
    size = files["f0.bin"][1].size
    for name in files:
        counts = [done for done, _ in progress_seen[name]]
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == size  # bytes hashed, up to the size


def test_hash_threads_bounded_by_files_cores_and_cap(monkeypatch):
    monkeypatch.setattr(file_digest, "usable_cores", lambda: 16)
    assert [file_digest.hash_threads(n) for n in (0, 1, 3, 8, 64)] == [1, 1, 3, 8, file_digest.MAX_THREADS]
    monkeypatch.setattr(file_digest, "usable_cores", lambda: 2)
    assert file_digest.hash_threads(64) == 2


@pytest.mark.parametrize("stopped_by", ["KeyboardInterrupt", "OSError"])
def test_a_stop_ends_every_hashing_thread_at_its_next_chunk(tmp_path, stopped_by):
    """Ctrl-C (or one file's read error) while big files are hashed: the other threads used to finish
    their whole files (a 10 GB shard: tens of seconds), then every file still queued; now each stops at its
    next chunk and no queued file is begun."""
    files = {}
    for i in range(4):
        path = tmp_path / f"f{i}"
        with open(path, "wb") as f:
            f.truncate(64 * file_digest.CHUNK)  # sparse: reads as zeros, fast
        files[path.name] = (path, Recorded(path.stat().st_size, "0" * 64, "test"))
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def progress(name: str, done: int, size: int) -> None:
        with lock:
            seen[name] = seen.get(name, 0) + 1
        if name == "f0" and done == 3 * file_digest.CHUNK:  # raised in f0's thread, re-raised in the caller's
            raise KeyboardInterrupt if stopped_by == "KeyboardInterrupt" else OSError(5, "Input/output error")

    error = KeyboardInterrupt if stopped_by == "KeyboardInterrupt" else OSError
    with pytest.raises(error):
        differences(files, threads=2, progress=progress)
    assert seen["f0"] == 4 and all(n < 40 for n in seen.values()), seen  # old: f1, f2, f3 to their ends (65)
    assert "f3" not in seen, seen  # queued behind the stop: never begun (f2 may take f0's thread before it)


def test_sampled_sha256_tells_a_copy_from_another_file_of_its_size(tmp_path):
    """provenance's copy check: a copy gives the same digest; a byte changed inside a sampled block, or a
    file of another size, another; a file smaller than the samples is hashed whole."""
    data = bytearray(np.random.default_rng(0).integers(0, 256, 40 << 20, dtype=np.uint8).tobytes())
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "copy").write_bytes(data)
    assert file_digest.sampled_sha256(tmp_path / "a") == file_digest.sampled_sha256(tmp_path / "copy")
    data[-1] ^= 1  # the last block is sampled
    (tmp_path / "b").write_bytes(data)
    assert file_digest.sampled_sha256(tmp_path / "b") != file_digest.sampled_sha256(tmp_path / "a")
    (tmp_path / "short").write_bytes(data[:-1])
    assert file_digest.sampled_sha256(tmp_path / "short") != file_digest.sampled_sha256(tmp_path / "a")
    (tmp_path / "small").write_bytes(b"abc")
    whole = hashlib.sha256((3).to_bytes(8, "little") + b"abc").hexdigest()
    assert file_digest.sampled_sha256(tmp_path / "small") == whole


def test_a_longer_file_is_a_size_problem_found_without_reading_it(tmp_path):
    """A file with bytes past its record's size (an append, another file put at its name) is a size problem,
    told before a byte is hashed: with a digest recorded (else the whole file was hashed to call it corrupt),
    and with the size alone (else it passed)."""
    f = tmp_path / "model0-mp8.safetensors"
    data = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    f.write_bytes(data + b"\0")
    hashed = []
    by_sha256 = Recorded(1000, hashlib.sha256(data).hexdigest(), "manifest")
    assert difference(f, f.name, by_sha256, on_bytes=hashed.append) == Problem(
        f.name, "size", "1001 bytes", "1000 bytes"
    )
    assert hashed == []
    assert difference(f, f.name, Recorded(1000, None, "manifest")) == Problem(
        f.name, "size", "1001 bytes", "1000 bytes"
    )
