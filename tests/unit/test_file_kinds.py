"""file_kinds.nearest_existing: the one walk up to the nearest existing path that the space, permission and
"cannot be made" checks share."""

from pathlib import Path

import pytest

from dsv41_convert.file_kinds import SPECIAL, nearest_existing, refuse_non_file, refuse_unmakeable, special_kind


def test_the_walk_stops_at_the_path_itself_or_the_nearest_folder_above(tmp_path: Path):
    (tmp_path / "a").mkdir()
    assert nearest_existing(tmp_path / "a") == tmp_path / "a"
    assert nearest_existing(tmp_path / "a" / "b" / "c") == tmp_path / "a"
    assert nearest_existing(Path("/no-such-folder-here/x")) == Path("/")


def test_a_dangling_link_stops_the_walk_only_where_asked(tmp_path: Path):
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    below = tmp_path / "link" / "x" / "y"
    assert nearest_existing(below) == tmp_path  # disk_usage and access need a path that exists
    assert nearest_existing(below, links=True) == tmp_path / "link"
    with pytest.raises(ValueError, match=r"link: a link to .*nowhere, which does not exist, so .*y cannot be made"):
        refuse_unmakeable(below, ValueError)


def test_a_file_on_the_way_is_named(tmp_path: Path):
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(ValueError, match=r"afile: Not a directory, so .*afile/r cannot be made in it"):
        refuse_unmakeable(tmp_path / "afile" / "r", ValueError)
    refuse_unmakeable(tmp_path / "new" / "r", ValueError)  # a folder to be made under an existing one is fine


def test_a_link_to_an_existing_folder_is_a_place_to_make_things_in(tmp_path: Path):
    """An output folder under a link to a folder (a scratch disk linked into the home folder) can be made.
    Catches refuse_unmakeable refusing every link on the way, not only a dangling one."""
    (tmp_path / "disk").mkdir()
    (tmp_path / "scratch").symlink_to(tmp_path / "disk")
    refuse_unmakeable(tmp_path / "scratch" / "out" / "r", ValueError)
    refuse_unmakeable(tmp_path / "scratch" / "r", ValueError)


def test_special_kind_names_only_fifos_sockets_and_devices(tmp_path: Path):
    """A folder, a regular file, a dangling link and nothing at all are no FIFO: each is said where it is read.
    Catches a folder named "a FIFO, a socket or a device" (a checkpoint folder holding a folder called
    model-00001-of-00002.safetensors)."""
    import os

    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "file.safetensors").write_bytes(b"")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(tmp_path / "pipe.safetensors")
    for name in ["folder.safetensors", "file.safetensors", "dangling", "missing"]:
        assert special_kind(tmp_path / name) is None, name
    assert special_kind(tmp_path / "pipe.safetensors") == SPECIAL == "a FIFO, a socket or a device"


def test_refuse_non_file_names_a_link_to_no_file_and_leaves_nothing_to_the_caller(tmp_path: Path):
    """A link to a deleted file was left to the caller, which said "missing" or "No such file" of a name `ls`
    lists (verify of a rank file linked to a moved file: an audit); nothing at all is still the caller's."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"dangling: not a regular file \(a link that leads to no file"):
        refuse_non_file(tmp_path / "dangling", ValueError)
    (tmp_path / "file").write_bytes(b"")
    (tmp_path / "good").symlink_to(tmp_path / "file")
    for name in ["missing", "file", "good"]:
        refuse_non_file(tmp_path / name, ValueError)
