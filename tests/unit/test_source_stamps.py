"""store/source_stamps.py: what counts as a source shard changing, and what a record across runs matches."""

from __future__ import annotations

import os

from dsv41_convert.store.source_stamps import changed_since, differing, record_stamps, source_stamps


def _source(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (src / name).write_bytes(os.urandom(4096))
    return src


def test_a_later_time_or_another_size_is_a_change(tmp_path):
    src = _source(tmp_path)
    before = source_stamps(src)
    st = (src / "a.safetensors").stat()
    os.utime(src / "a.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    with open(src / "b.safetensors", "ab") as f:
        f.write(b"x")
    assert differing(before, source_stamps(src)) == ["a.safetensors", "b.safetensors"]


def test_shards_added_or_removed_are_changes(tmp_path):
    src = _source(tmp_path)
    before = source_stamps(src)
    (src / "c.safetensors").write_bytes(b"x")
    (src / "a.safetensors").unlink()
    assert differing(before, source_stamps(src)) == ["a.safetensors", "c.safetensors"]


def test_a_copy_keeping_the_times_matches_the_record_and_names_where_it_was_made(tmp_path):
    """A folder copied with `cp -a` (or moved) resumes; the record says which folder it was made from."""
    src, out = _source(tmp_path), tmp_path / "out"
    out.mkdir()
    record_stamps(out, src, source_stamps(src))
    copy = tmp_path / "copy"
    copy.mkdir()
    for shard in src.iterdir():
        (copy / shard.name).write_bytes(shard.read_bytes())
        st = shard.stat()
        os.utime(copy / shard.name, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert changed_since(out, copy, source_stamps(copy)) == ([], str(src.resolve()))
    assert changed_since(out, src, source_stamps(src)) == ([], None)
    (copy / "b.safetensors").write_bytes(os.urandom(4096))  # a second fine-tune of the layout
    assert changed_since(out, copy, source_stamps(copy)) == (["b.safetensors"], str(src.resolve()))


def test_another_size_with_the_same_time_is_a_change(tmp_path):
    """A shard cut short or replaced whose time was set back (touch -r, rsync -t of another copy, a restore
    from backup): its size alone tells."""
    src = _source(tmp_path)
    before = source_stamps(src)
    st = (src / "a.safetensors").stat()
    os.truncate(src / "a.safetensors", st.st_size - 1)
    os.utime(src / "a.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert differing(before, source_stamps(src)) == ["a.safetensors"]


def test_a_link_that_leads_to_no_file_is_stamped_as_the_link(tmp_path):
    """A shard link whose blob is gone, or a link in a loop: the stamps followed it and raised "No such file or
    directory" (check, verify, reference-logits), before the reader could name it as a link to no file."""
    src = _source(tmp_path)
    (src / "gone.safetensors").symlink_to(tmp_path / "deleted-blob")
    (src / "loop.safetensors").symlink_to("loop.safetensors")
    stamps = source_stamps(src)
    assert sorted(stamps) == ["a.safetensors", "b.safetensors", "gone.safetensors", "loop.safetensors"]
    assert stamps["gone.safetensors"][1] == (src / "gone.safetensors").lstat().st_mtime_ns
