"""store.machine.memory_backed: whether a folder's files take the host's memory (tmpfs), from /proc/self/mountinfo."""

from __future__ import annotations

from dsv41_convert.store.machine import memory_backed

MOUNTINFO = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1k
40 27 0:30 / /srv/ram\\040disk rw,relatime shared:5 - ramfs ramfs rw
41 27 0:31 / /data rw,relatime - tmpfs tmpfs rw
42 41 254:1 / /data rw,relatime - xfs /dev/vdb rw
43 27 0:32 / /scratch rw - tmpfs tmpfs rw
"""


def test_the_file_system_of_the_nearest_mount_point_above_decides(tmp_path):
    table = tmp_path / "mountinfo"
    table.write_text(MOUNTINFO)
    assert memory_backed(tmp_path / "x", table) is False  # whatever holds pytest's tmp folder here: the ext4 root
    assert memory_backed(tmp_path.root + "dev/shm/dsv41-verify-1", table) is True
    assert memory_backed("/srv/ram disk/tmp", table) is True  # a space, written \\040, and optional fields
    assert memory_backed("/data/tmp", table) is False  # xfs mounted over a tmpfs: the last mount counts
    assert memory_backed("/scratchpad", table) is False  # /scratch is no folder above it
    assert memory_backed("/scratch", table) is True
    assert memory_backed("/x", tmp_path / "none") is False  # no table (not Linux): not known to be memory
