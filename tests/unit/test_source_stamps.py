"""store/source_stamps.py: what counts as a source shard changing within a run, and what a record across runs
keeps."""

from __future__ import annotations

import os

from dsv41_convert.store.source_stamps import changed_since, differing, record_changed, record_stamps, source_stamps


def _source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (src / name).write_bytes(os.urandom(4096))
    return src


def _put_times_back(path, st) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_rewrite_in_place_with_its_times_put_back_is_a_change(tmp_path):
    src = _source(tmp_path)
    before, shard = source_stamps(src), src / "a.safetensors"
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.write(b"\0")
    _put_times_back(shard, st)
    assert [shard.stat().st_size, shard.stat().st_mtime_ns] == [st.st_size, st.st_mtime_ns]
    assert differing(before, source_stamps(src)) == ["a.safetensors"]


def test_a_replacement_by_rename_with_the_same_size_and_times_is_a_change(tmp_path):
    src = _source(tmp_path)
    before, shard = source_stamps(src), src / "b.safetensors"
    st = shard.stat()
    new = tmp_path / "new"
    new.write_bytes(shard.read_bytes())
    _put_times_back(new, st)
    new.replace(shard)
    assert differing(before, source_stamps(src)) == ["b.safetensors"]


def test_a_mode_change_is_a_change_a_link_removed_is_none(tmp_path):
    src = _source(tmp_path)
    (tmp_path / "link").hardlink_to(src / "a.safetensors")  # a hard link in OUT, which the run replaces
    before = source_stamps(src)
    (tmp_path / "link").unlink()
    assert differing(before, source_stamps(src)) == []
    os.chmod(src / "b.safetensors", 0o400)
    assert differing(before, source_stamps(src)) == ["b.safetensors"]


def test_shards_added_or_removed_are_changes(tmp_path):
    src = _source(tmp_path)
    before = source_stamps(src)
    (src / "c.safetensors").write_bytes(b"x")
    (src / "a.safetensors").unlink()
    assert differing(before, source_stamps(src)) == ["a.safetensors", "c.safetensors"]


def test_the_record_keeps_size_and_time_so_a_cp_a_copy_matches_it(tmp_path):
    src, out = _source(tmp_path), tmp_path / "out"
    out.mkdir()
    record_stamps(out, src, source_stamps(src))
    copy = tmp_path / "copy"
    copy.mkdir()
    for shard in src.iterdir():
        (copy / shard.name).write_bytes(shard.read_bytes())
        _put_times_back(copy / shard.name, shard.stat())
    assert changed_since(out, copy, source_stamps(copy)) == ([], str(src.resolve()))
    assert changed_since(out, src, source_stamps(src)) == ([], None)


def test_shards_seen_changing_stay_changed_in_the_record_whatever_their_times_say(tmp_path):
    src, out = _source(tmp_path), tmp_path / "out"
    out.mkdir()
    stamps = source_stamps(src)
    record_stamps(out, src, stamps)
    record_changed(out, src, stamps, ["b.safetensors"])
    assert changed_since(out, src, source_stamps(src)) == (["b.safetensors"], None)
