"""Manifest fragments read, imported, forgotten and merged, on folders built by hand (no conversion run): the
checks that keep a corrupt, foreign or edited fragment from vouching for a rank file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from dsv41_convert.errors import OutputError
from dsv41_convert.store.manifest import DONE_DIR, read_done, write_done
from dsv41_convert.store.manifest_merge import (
    FRAGMENT_FORMAT,
    forget_stale,
    import_fragments,
    merge,
    read_fragments,
)

RANKS_2 = ["model0-mp2.safetensors", "model1-mp2.safetensors"]


def _record(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _fragment(
    out: Path,
    name: str,
    digest: str,
    rank_files: list[str],
    files: dict[str, dict[str, Any]],
    side_files: dict[str, dict[str, Any]] | None = None,
) -> Path:
    frag = {
        "format": FRAGMENT_FORMAT,
        "complete": False,
        "plan_digest": digest,
        "source": {"path": "/src", "index_sha256": "0" * 64, "revision": None, "format": "fp8"},
        "options": {"tp": len(rank_files), "device": "cpu"},
        "rank_files": rank_files,
        "files": files,
        "side_files": side_files or {},
    }
    path = out / name
    path.write_text(json.dumps(frag))
    return path


def _gathered(tmp_path: Path) -> tuple[Path, dict[str, bytes], dict[str, dict[str, Any]]]:
    """A folder as two tp-2 shares leave it once gathered: both rank files, config.json and hf_config.json,
    and one fragment per rank (plan digest "d"), each recording the side files."""
    out = tmp_path / "out"
    (out / DONE_DIR).mkdir(parents=True)
    data = {RANKS_2[0]: b"rank zero bytes" * 7, RANKS_2[1]: b"rank one" * 11}
    for name, payload in data.items():
        (out / name).write_bytes(payload)
    side = {}
    for name, text in (("config.json", b'{"a": 1}\n'), ("hf_config.json", b'{"b": 2}\n')):
        (out / name).write_bytes(text)
        side[name] = _record(text)
    for r, name in enumerate(RANKS_2):
        _fragment(out, f"manifest-fragment-mp2-r{r}.json", "d", RANKS_2, {name: _record(data[name])}, side)
    return out, data, side


def test_read_fragments_refuses_rank_files_that_repeat_a_name(tmp_path):
    """An export's fragment (output names model-0000i-of-0000n, not rank files) whose rank_files name one file
    twice is not one conversion's output list: refused, naming the fragment. A repeated name was read as
    well formed, so a merge counted one file as two of the conversion's."""
    good = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    _fragment(tmp_path, "manifest-fragment-good.json", "d", good, {})
    assert list(read_fragments(tmp_path)) == ["manifest-fragment-good.json"]
    _fragment(tmp_path, "manifest-fragment-twice.json", "d", [good[0], good[0]], {})
    with pytest.raises(OutputError, match=r"manifest-fragment-twice\.json: rank_files .* not the output files of one"):
        read_fragments(tmp_path)


def test_import_fragments_records_only_files_that_match_their_fragment(tmp_path):
    """`shard --resume` in a gathered folder writes a done record only for a rank file whose size and sha256
    are the fragment's: a record for a corrupt copy (same size, one byte changed) makes the resume skip it,
    and the manifest then vouches for wrong bytes."""
    good, bad = b"g" * 100, b"b" * 100
    (tmp_path / RANKS_2[0]).write_bytes(good)
    (tmp_path / RANKS_2[1]).write_bytes(bad[:-1] + b"x")  # the copy differs from what its share wrote
    _fragment(tmp_path, "manifest-fragment-mp2-r0_1.json", "d", RANKS_2, {RANKS_2[0]: _record(good),
              RANKS_2[1]: _record(bad)})  # fmt: skip
    assert import_fragments(tmp_path, "d") == [RANKS_2[0]]
    rec = read_done(tmp_path, RANKS_2[0])
    assert rec is not None and (rec["size"], rec["sha256"], rec["plan_digest"]) == (
        100,
        hashlib.sha256(good).hexdigest(),
        "d",
    )
    assert read_done(tmp_path, RANKS_2[1]) is None


def test_forget_stale_removes_the_manifest_and_other_plans_fragments_only(tmp_path):
    """Before a run (re)writes rank files, manifest.json and the fragments of another plan go; this plan's
    fragments (the other shares' records) stay. Swapped, a rerun deleted the shares it needs and kept a
    foreign plan's fragment, which the merge then refused."""
    (tmp_path / "manifest.json").write_text("{}")
    ours = _fragment(tmp_path, "manifest-fragment-mp2-r0.json", "ours", RANKS_2, {})
    theirs = _fragment(tmp_path, "manifest-fragment-mp2-r1.json", "theirs", RANKS_2, {})
    assert sorted(forget_stale(tmp_path, "ours")) == sorted(["manifest.json", theirs.name])
    assert ours.is_file() and not theirs.exists() and not (tmp_path / "manifest.json").exists()


def test_forget_stale_drops_this_plans_fragment_recording_a_rewritten_file_unless_it_is_a_gathered_share(tmp_path):
    """A fragment of this plan recording a file the run rewrites holds the old bytes' record (a merge then
    called the new file corrupt): it goes where its other files have done records of this plan here (the
    folder's own shares), and stays where one has none (a share gathered from another machine: the only
    record of that file)."""
    (tmp_path / DONE_DIR).mkdir()
    old = {name: _record(b"old " + name.encode()) for name in RANKS_2}
    own = _fragment(tmp_path, "manifest-fragment-mp2-r0_1.json", "ours", RANKS_2, old)
    other = _fragment(tmp_path, "manifest-fragment-mp2-r1.json", "ours", RANKS_2, {RANKS_2[1]: old[RANKS_2[1]]})
    assert forget_stale(tmp_path, "ours", frozenset({RANKS_2[0]})) == []  # model1's only record is a fragment's
    write_done(tmp_path, RANKS_2[1], old[RANKS_2[1]]["size"], old[RANKS_2[1]]["sha256"], "ours")
    assert forget_stale(tmp_path, "ours", frozenset({RANKS_2[0]})) == [own.name]
    assert other.is_file() and not own.exists()  # r1 records no file being rewritten


def test_merge_of_two_shares_writes_their_records(tmp_path):
    """The hand-built folder the next test spoils merges: manifest.json lists both rank files and the side
    files with the sizes and sha256 hashlib gives."""
    out, data, side = _gathered(tmp_path)
    merge(out)
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert files == {name: _record(payload) for name, payload in data.items()} | side


def test_merge_refuses_a_fragment_whose_rank_files_are_another_conversions(tmp_path):
    """A fragment with this plan's digest but the rank files of another tp (edited, or mixed up while
    gathering) is from another plan: the merge names it. Comparing digests only merged the folder, exit 0."""
    out, _, side = _gathered(tmp_path)
    ranks_4 = [f"model{r}-mp4.safetensors" for r in range(4)]
    _fragment(out, "manifest-fragment-mp4-r2.json", "d", ranks_4, {}, side)
    with pytest.raises(OutputError, match=r"manifest-fragment-mp4-r2\.json: from another plan"):
        merge(out)
    assert not (out / "manifest.json").exists()


def test_read_fragments_refuses_a_side_file_record_without_its_sha256(tmp_path):
    """side_files holds a size and sha256 per file: a record without its sha256 is refused when the fragment is
    read, naming it; accepted, the merge died on a KeyError (a traceback, not an error message)."""
    _fragment(tmp_path, "manifest-fragment-mp2-r0.json", "d", RANKS_2, {}, {"config.json": {"size": 9}})
    with pytest.raises(
        OutputError, match=r"manifest-fragment-mp2-r0\.json: not a 'dsv41-convert manifest fragment v1'"
    ):
        read_fragments(tmp_path)


def test_merge_refuses_a_done_record_of_another_plan_for_an_unlisted_rank(tmp_path):
    """Rank 1's fragment missing, but an old done record for model1-mp2 (another plan's, from an earlier run
    in this folder) there: the merge names that record and the rank no fragment lists. Taking the stale record
    as rank 1's merged a rank file of another conversion into the manifest."""
    out, data, _ = _gathered(tmp_path)
    (out / "manifest-fragment-mp2-r1.json").unlink()
    write_done(out, RANKS_2[1], len(data[RANKS_2[1]]), hashlib.sha256(data[RANKS_2[1]]).hexdigest(), "old")
    with pytest.raises(OutputError, match=r"model1-mp2\.safetensors\.done\.json: from another plan") as err:
        merge(out)
    assert "model1-mp2.safetensors: no fragment lists it" in str(err.value)
    assert not (out / "manifest.json").exists()


def test_merge_names_a_stale_fragment_not_the_shares_whose_rank_files_are_there(tmp_path):
    """A tp-4 set gathered with a fragment left from an earlier tp-2 attempt, whose name sorts first: the merge took
    that one as the plan, called both shares' fragments foreign, asked for the tp-2 rank files to be gathered and
    the four rank files there removed. The plan compared against is the one whose rank files the folder holds."""
    out = tmp_path / "out"
    (out / DONE_DIR).mkdir(parents=True)
    ranks_4 = [f"model{r}-mp4.safetensors" for r in range(4)]
    side = {}
    for name, text in (("config.json", b'{"a": 1}\n'), ("hf_config.json", b'{"b": 2}\n')):
        (out / name).write_bytes(text)
        side[name] = _record(text)
    data = {name: name.encode() * 9 for name in ranks_4}
    for name, payload in data.items():
        (out / name).write_bytes(payload)
    for part in ("0_1", "2_3"):
        files = {n: _record(data[n]) for n in ranks_4 if f"model{part[0]}" in n or f"model{part[-1]}" in n}
        _fragment(out, f"manifest-fragment-mp4-r{part}.json", "tp4", ranks_4, files, side)
    _fragment(out, "manifest-fragment-mp2-r0.json", "tp2", RANKS_2, {RANKS_2[0]: _record(b"old")}, side)
    with pytest.raises(OutputError) as err:
        merge(out)
    said = str(err.value)
    assert "manifest-fragment-mp2-r0.json: from another plan (digest tp2) than manifest-fragment-mp4-r0_1.json" in said
    assert "mp4-r0_1.json: from another plan" not in said and "model0-mp4.safetensors: a .safetensors" not in said
    assert "model1-mp2.safetensors: no fragment lists it" not in said
    (out / "manifest-fragment-mp2-r0.json").unlink()
    merge(out)
    assert set(json.loads((out / "manifest.json").read_text())["files"]) == {*ranks_4, *side}
