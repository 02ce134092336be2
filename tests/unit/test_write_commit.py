"""write.commit and write_partial's error path: a rank file takes its final name only once its bytes are on
disk, its done record comes before its journal goes, and a write or flush error leaves neither the partial
file nor its journal."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert import write
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.errors import OutputError
from dsv41_convert.store.journal import journal_path

FILE = "model0-mp2.safetensors"


def _partial_with_journal(out: Path, data: bytes = b"rank file bytes") -> tuple[Path, Path]:
    partial, jpath = out / (FILE + ".partial"), journal_path(out, FILE)
    partial.write_bytes(data)
    jpath.parent.mkdir(parents=True, exist_ok=True)
    jpath.write_text("{}\n")
    return partial, jpath


def _record_steps(monkeypatch: pytest.MonkeyPatch, out: Path, steps: list[tuple[str, str]]) -> None:
    """Log write.commit's fsyncs and renames (as (what, name relative to OUT)), doing them as well."""
    real_fsync, real_replace = write.fsync_path, os.replace

    def fsync(path: Path) -> None:
        steps.append(("fsync", str(Path(path).relative_to(out))))
        real_fsync(path)

    def replace(a, b) -> None:
        steps.append(("replace", str(Path(a).relative_to(out))))
        real_replace(a, b)

    monkeypatch.setattr(write, "fsync_path", fsync)
    monkeypatch.setattr(write.os, "replace", replace)


def test_commit_fsyncs_the_data_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """Without the fsync of the partial file before its rename, a power loss can leave a rank file under its
    final name with zeros or old blocks inside (the rename reached the disk, the data did not), which
    --resume then takes for finished by its size; without the folder's fsync after it, the rename (and so
    the file) can be lost while its done record survives."""
    partial, _ = _partial_with_journal(tmp_path)
    steps: list[tuple[str, str]] = []
    _record_steps(monkeypatch, tmp_path, steps)
    write.commit(tmp_path, FILE, lambda: steps.append(("record", FILE)))
    assert steps[:4] == [("fsync", FILE + ".partial"), ("replace", FILE + ".partial"), ("fsync", "."), ("record", FILE)]
    assert (tmp_path / FILE).read_bytes() == b"rank file bytes" and not partial.exists()


def test_commit_keeps_the_journal_until_the_done_record_is_written(tmp_path):
    """A run killed between the rename and the done record must leave a record of ours for the file (its
    journal): with the journal removed first, the next run found a rank file with neither and took it
    for a user's file. Here the record fails: the journal is still there."""
    _, jpath = _partial_with_journal(tmp_path)

    def record() -> None:
        assert jpath.exists(), "the journal went before the done record"
        raise RuntimeError("killed before the record")

    with pytest.raises(RuntimeError, match="killed before the record"):
        write.commit(tmp_path, FILE, record)
    assert (tmp_path / FILE).exists() and jpath.exists()


def test_commit_drops_the_journal_once_recorded(tmp_path):
    """Once the done record is written the journal goes: a journal left beside a finished file made the
    file look unfinished to the next run's checks."""
    _, jpath = _partial_with_journal(tmp_path)
    write.commit(tmp_path, FILE, lambda: None)
    assert (tmp_path / FILE).exists() and not jpath.exists()


@pytest.mark.parametrize(("code", "raised"), [(errno.ENOSPC, OutputError), (errno.EIO, OSError)], ids=["ENOSPC", "EIO"])
def test_a_flush_error_removes_the_partial_file_and_its_journal(tmp_path, monkeypatch, code, raised):
    """A full disk found at writeback (the fsync before the rename) or an I/O error: the partial file and its
    journal are removed and the error raised (ENOSPC as an OutputError naming the file); a partial file left
    behind held bytes the disk never took, and no final name appears."""
    partial, jpath = _partial_with_journal(tmp_path)

    def fsync(path: Path) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(write, "fsync_path", fsync)
    with pytest.raises(raised) as info:
        write.commit(tmp_path, FILE, lambda: pytest.fail("recorded a file that is not on disk"))
    if raised is OutputError:
        assert FILE in str(info.value) and "no space left" in str(info.value)
    assert not partial.exists() and not jpath.exists() and not (tmp_path / FILE).exists()


@pytest.mark.parametrize(("code", "raised"), [(errno.ENOSPC, OutputError), (errno.EIO, OSError)], ids=["ENOSPC", "EIO"])
def test_a_write_error_removes_the_partial_file_and_its_journal(tmp_path, monkeypatch, code, raised):
    """A full disk (or an I/O error) while a rank file is written: the error says which file (ENOSPC as an
    OutputError that says the partial file was removed), and the partial file and its journal are gone, as
    said; kept, they held bytes the disk may not have taken, and the space stayed used."""
    src = make_tiny(tmp_path / "src", quantized=False, vision=False)
    rf = build_plan(src, 2).files[0]
    out = tmp_path / "out"
    out.mkdir()
    seen: list[bool] = []

    def fails_after_the_header(rf_, reader, sink, *args) -> None:
        sink.write(rf_.header)
        seen.append((out / (rf.file + ".partial")).exists() and journal_path(out, rf.file).exists())
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(write, "_write_tensors", fails_after_the_header)
    with pytest.raises(raised) as info:
        write.write_rank_file(rf, src, out, quantizer_for("cpu"), plan_digest="d")
    assert seen == [True]  # the partial file and its journal were there when the error came
    if raised is OutputError:
        assert rf.file in str(info.value) and "the partial file was removed" in str(info.value)
    assert not (out / (rf.file + ".partial")).exists() and not journal_path(out, rf.file).exists()


@pytest.mark.parametrize("at", ["write", "flush"])
def test_a_file_too_large_is_not_called_a_full_disk(tmp_path, monkeypatch, at):
    """EFBIG (a file system's largest file, FAT32's 4 GiB; a file-size limit, `ulimit -f` under a scheduler) said
    `no space left on the device ...; free space and run again with --resume`: false, and a resume fails at the
    same byte (a black-box hunt under ulimit -f). Now it names the file-size limit; ENOSPC is still a full disk."""
    efbig = OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    if at == "flush":
        _partial_with_journal(tmp_path)

        def fsync(path: Path) -> None:
            raise efbig

        monkeypatch.setattr(write, "fsync_path", fsync)
        with pytest.raises(OutputError) as info:
            write.commit(tmp_path, FILE, None)
        name = FILE
    else:
        src = make_tiny(tmp_path / "src", quantized=False, vision=False)
        rf = build_plan(src, 2).files[0]
        (tmp_path / "out").mkdir()

        def too_large(rf_, reader, sink, *args) -> None:
            sink.write(rf_.header)
            raise efbig

        monkeypatch.setattr(write, "_write_tensors", too_large)
        with pytest.raises(OutputError) as info:
            write.write_rank_file(rf, src, tmp_path / "out", quantizer_for("cpu"), plan_digest="d")
        name = rf.file
    msg = str(info.value)
    assert name in msg and "no space left" not in msg and "free space" not in msg, msg
    assert "larger than the file system or the file-size limit (ulimit -f) allows" in msg, msg
    assert "the partial file was removed" in msg and "--resume" in msg
