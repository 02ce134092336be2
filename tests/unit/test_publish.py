"""store.publish: a finished temporary goes in place with the mode open() gives a new file."""

from __future__ import annotations

import os
import stat

import pytest

from dsv41_convert.store.publish import publish


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_a_private_temporary_is_published_with_a_new_files_mode(tmp_path, umask, mode):
    """safetensors' save_file makes its file 0600 (the reference file's temporary is one): published, it has
    0666 less the umask, as every other file the run writes, and its bytes under the final name alone."""
    tmp, final = tmp_path / "r.safetensors.1.partial", tmp_path / "r.safetensors"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"data")
    os.close(fd)
    os.chmod(tmp, 0o600)  # whatever the umask: as save_file leaves it
    old = os.umask(umask)
    try:
        publish(tmp, final)
    finally:
        os.umask(old)
    assert not tmp.exists() and final.read_bytes() == b"data"
    assert stat.S_IMODE(final.stat().st_mode) == mode
