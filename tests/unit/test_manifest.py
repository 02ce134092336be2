"""Done records and manifest helpers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dsv41_convert.store.file_digest import sha256_file
from dsv41_convert.store.manifest import atomic_write, finished, read_done, source_revision, write_done


def test_done_record_checks_size_sha_and_plan(tmp_path):
    f = tmp_path / "model0-mp2.safetensors"
    f.write_bytes(b"abc" * 1000)
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    assert sha256_file(f, chunk=7) == sha
    write_done(tmp_path, f.name, 3000, sha, "plan-a")
    assert read_done(tmp_path, f.name)["sha256"] == sha
    assert finished(tmp_path, [f.name], "plan-a") == {f.name}
    assert finished(tmp_path, [f.name], "plan-b") == set()  # other options
    f.write_bytes(b"abd" * 1000)  # same size, other bytes
    assert finished(tmp_path, [f.name], "plan-a") == set()
    f.write_bytes(b"abc" * 999)
    assert finished(tmp_path, [f.name], "plan-a") == set()
    assert finished(tmp_path, ["missing.safetensors"], "plan-a") == set()


def test_finished_sorts_many_files_hashed_at_once(tmp_path):
    """Of several recorded files, only the intact ones of this plan count, whichever thread hashed them."""
    names = [f"model{r}-mp8.safetensors" for r in range(8)]
    for r, name in enumerate(names):
        data = bytes([r]) * (3 << 20)
        (tmp_path / name).write_bytes(data)
        write_done(tmp_path, name, len(data), hashlib.sha256(data).hexdigest(), "plan-b" if r == 5 else "plan-a")
    with open(tmp_path / names[2], "r+b") as f:  # one byte flipped, size kept
        f.seek(1 << 20)
        f.write(b"\xff")
    (tmp_path / names[6]).unlink()
    assert finished(tmp_path, names, "plan-a") == {names[r] for r in (0, 1, 3, 4, 7)}


def test_atomic_write_leaves_no_temporary(tmp_path):
    atomic_write(tmp_path / "config.json", b"{}")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_source_revision_from_hub_snapshot_path():
    rev = "dba1be0a40aa45a94ad051997016db3960a90277"
    assert source_revision(Path(f"/c/models--deepseek-ai--DeepSeek-V4.1-Flash/snapshots/{rev}")) == rev
    assert source_revision(Path("/data/ckpt")) is None


@pytest.mark.parametrize("kind", ["symbolic", "hard"])
def test_atomic_write_never_writes_through_a_link_at_its_temporarys_name(tmp_path, kind):
    """The temporary's name is predictable (NAME.PID.partial): a link planted there was opened and written
    through, into its target, before the rename moved the link itself into place (a hard link: truncated
    in place, the other name's file with it)."""
    import os

    victim = tmp_path / "precious.txt"
    victim.write_text("mine\n")
    temporary = tmp_path / f"config.json.{os.getpid()}.partial"
    temporary.symlink_to(victim) if kind == "symbolic" else os.link(victim, temporary)
    atomic_write(tmp_path / "config.json", b"{}")
    assert victim.read_text() == "mine\n" and (tmp_path / "config.json").read_bytes() == b"{}"
    assert not (tmp_path / "config.json").is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "precious.txt"]  # fmt: skip


def test_atomic_write_names_its_file_when_the_disk_is_full(tmp_path, monkeypatch):
    """A full disk while writing manifest.json said only "No space left on device" (an audit): the error
    names the file, and no temporary is left."""
    import errno
    import os

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        atomic_write(tmp_path / "manifest.json", b"{}")
    assert caught.value.filename == str(tmp_path / "manifest.json") and caught.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
