"""Done records and manifest helpers."""

from __future__ import annotations

import hashlib
from pathlib import Path

from dsv41_convert.store.manifest import atomic_write, is_done, read_done, sha256_file, source_revision, write_done


def test_done_record_checks_size_sha_and_plan(tmp_path):
    f = tmp_path / "model0-mp2.safetensors"
    f.write_bytes(b"abc" * 1000)
    sha = hashlib.sha256(f.read_bytes()).hexdigest()
    assert sha256_file(f, chunk=7) == sha
    write_done(tmp_path, f.name, 3000, sha, "plan-a")
    assert read_done(tmp_path, f.name)["sha256"] == sha
    assert is_done(tmp_path, f.name, "plan-a")
    assert not is_done(tmp_path, f.name, "plan-b")  # other options
    f.write_bytes(b"abd" * 1000)  # same size, other bytes
    assert not is_done(tmp_path, f.name, "plan-a")
    f.write_bytes(b"abc" * 999)
    assert not is_done(tmp_path, f.name, "plan-a")
    assert not is_done(tmp_path, "missing.safetensors", "plan-a")


def test_atomic_write_leaves_no_temporary(tmp_path):
    atomic_write(tmp_path / "config.json", b"{}")
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_source_revision_from_hub_snapshot_path():
    rev = "dba1be0a40aa45a94ad051997016db3960a90277"
    assert source_revision(Path(f"/c/models--deepseek-ai--DeepSeek-V4.1-Flash/snapshots/{rev}")) == rev
    assert source_revision(Path("/data/ckpt")) is None
