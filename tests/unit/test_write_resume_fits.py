"""write._fits: a journal checkpoint is resumed from only where it names a place in this file's tensors (and
_Reader.rows, through which every dim-1 split is read: whole rows or one rank's columns).

A checkpoint line carries a digest of its own fields (journal.py `check`), so a flipped digit is a corrupt line;
these lines are well formed, with a valid `check`, and cover bytes whose sha256 matches, but name a tensor and
offset that do not agree with the plan (a journal written by a writer with another tensor order, or edited):
resumed from, the writer would go on in the wrong tensor, and the file would be stitched from mismatched bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert.plan import RankFile, build_plan
from dsv41_convert.convert.transform import quantizer_for
from dsv41_convert.convert.write import _Reader, write_partial, write_rank_file
from dsv41_convert.store.journal import journal_path
from dsv41_convert.store.sink import Sink

CHUNK, JOURNAL = 1 << 12, 1 << 13


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("fits") / "bf16", quantized=False, vision=False)


@pytest.fixture(scope="module")
def rf(src) -> RankFile:
    return build_plan(src, 2).files[1]


@pytest.fixture(scope="module")
def clean(src, rf, tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("fits-clean")
    write_rank_file(rf, src, out, quantizer_for("cpu"))
    return (out / rf.file).read_bytes()


def _stopped_at(src: Path, rf: RankFile, out: Path, fraction: float) -> None:
    """Ctrl-C once the writer has been handed `fraction` of the file: a partial file and its journal."""
    after_chunk = Sink._after_chunk

    def stop(sink: Sink) -> None:
        after_chunk(sink)
        if sink.queued > fraction * rf.nbytes:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), mock.patch.object(Sink, "_after_chunk", stop):
        write_partial(rf, src, out, quantizer_for("cpu"), chunk_bytes=CHUNK, plan_digest="d", journal_bytes=JOURNAL)


def _with_check(rec: dict) -> str:
    """A checkpoint line as journal.py writes it: `check` is the first 16 hex digits of the sha256 of the
    line's other fields as sorted-key JSON."""
    body = {k: v for k, v in rec.items() if k != "check"}
    check = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return json.dumps(body | {"check": check})


def _resumed(src: Path, rf: RankFile, out: Path) -> dict:
    stats: dict = {}
    write_rank_file(rf, src, out, quantizer_for("cpu"), chunk_bytes=CHUNK, plan_digest="d", resume=True,
                    journal_bytes=JOURNAL, stats=stats)  # fmt: skip
    return stats


def test_a_checkpoint_naming_an_earlier_tensor_restarts_the_file(src, rf, clean, tmp_path):
    """The last checkpoint moved onto the tensor before the one it was in, with `skip` set so that the tensor's
    begin + skip is still the checkpoint's end: that end lies past the earlier tensor's data, so it does not
    fit, and the file is written again from byte 0 (byte-identical to an uninterrupted run)."""
    _stopped_at(src, rf, tmp_path, 0.5)
    jpath = journal_path(tmp_path, rf.file)
    lines = jpath.read_text().splitlines()
    last = json.loads(lines[-1])
    i = last["tensor"]
    assert i >= 1 and rf.tensors[i].begin <= last["end"], last
    earlier = rf.tensors[i - 1]
    moved = last | {"tensor": i - 1, "skip": last["end"] - earlier.begin, "chunk": 0}
    assert earlier.begin + moved["skip"] == last["end"] > earlier.end
    jpath.write_text("\n".join([*lines[:-1], _with_check(moved)]) + "\n")
    stats = _resumed(src, rf, tmp_path)
    assert stats["resumed_from"] == 0 and "does not fit" in stats["resume"], stats
    assert (tmp_path / rf.file).read_bytes() == clean


def test_reader_rows_gives_whole_rows_or_the_columns_of_a_dim1_split(tmp_path):
    """_Reader.rows on a read of a dim-1 split (one rank's columns of every row): by default the rank's columns
    of each row, with `whole` the full source rows (the CUDA path gathers the columns on the device). Columns
    where whole rows were asked for gave the device a [rows, cols] buffer it then sliced again: the wrong bytes."""
    src = make_tiny(tmp_path / "pub", quantized=True, vision=False)
    reads = [rd for f in build_plan(src, 2).files for t in f.tensors for rd in t.reads if rd.c1 > rd.c0 > 0]
    rd = max(reads, key=lambda rd: rd.r1 - rd.r0)
    esz = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}[rd.dtype]
    rb = esz
    for n in rd.shape[1:]:
        rb *= n
    a, b = 1, min(3, rd.r1 - rd.r0)
    with open(src / rd.file, "rb") as f:
        f.seek(rd.offset + (rd.r0 + a) * rb)
        raw = f.read((b - a) * rb)
    reader = _Reader(src, 1 << 16)
    try:
        whole, width = reader.rows(rd, a, b, bytearray, whole=True)
        assert (bytes(whole), width) == (raw, rb)
        cols, width = reader.rows(rd, a, b, bytearray)
        want = np.frombuffer(raw, np.uint8).reshape(b - a, rb)[:, rd.c0 * esz : rd.c1 * esz]
        assert (bytes(cols), width) == (want.tobytes(), (rd.c1 - rd.c0) * esz)
    finally:
        reader.close()
