"""An index may only name shards beside it (store/index.py): paths out of the checkpoint folder, absolute
paths and names with folders are refused by `plan` and by the download checks, with a message that says so,
and the file they point at is never opened; symbolic links inside the folder (the HF cache) still work."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import INDEX, build_plan
from dsv41_convert.errors import PlanError
from dsv41_convert.hub.integrity import check_checkpoint
from dsv41_convert.hub.local import verify_local
from dsv41_convert.store import safetensors_header
from dsv41_convert.store.index import bad_shard_names, shard_name_problem
from dsv41_convert.store.manifest_check import check_folder

SHARD = "model-00002-of-00003.safetensors"


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../elsewhere/x.safetensors", "points outside"),
        ("..", "points outside"),
        ("sub/../../x.safetensors", "points outside"),
        ("/data/x.safetensors", "absolute path"),
        ("C:\\x.safetensors", "absolute path"),
        ("C:x.safetensors", "absolute path"),  # drive-relative: a file on drive C, not beside the index
        ("sub/x.safetensors", "path with folders"),
        ("sub\\x.safetensors", "path with folders"),
        (".", "folder itself"),
        ("", "not a file name"),
        (7, "not a file name"),
        ("x\0.safetensors", "NUL"),
        ("tokenizer.json", "not a .safetensors file"),  # there, and "missing ... download it" was said of it
        ("model-00001-of-00003.bin", "not a .safetensors file"),
    ],
)
def test_names_that_leave_the_folder_are_refused(name, why):
    assert why in shard_name_problem(name)


@pytest.mark.parametrize("name", [SHARD, "model.safetensors", "..model.safetensors", "a..b.safetensors"])
def test_plain_file_names_pass(name):
    assert shard_name_problem(name) is None


def _point_index_at(src: Path, target: str) -> None:
    index = json.loads((src / INDEX).read_text())
    index["weight_map"] = {k: (target if v == SHARD else v) for k, v in index["weight_map"].items()}
    (src / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("where", ["parent", "absolute", "subfolder"])
def test_plan_refuses_an_index_that_names_a_file_outside(tmp_path, monkeypatch, where):
    """The shard really is there (moved out of the folder): the index must still be refused, not followed,
    and the message must not say "missing ... download it"."""
    src = make_tiny(tmp_path / "src")
    outside = {"parent": tmp_path / "elsewhere", "absolute": tmp_path / "abs", "subfolder": src / "sub"}[where]
    outside.mkdir()
    shutil.move(src / SHARD, outside / SHARD)
    target = {"parent": f"../elsewhere/{SHARD}", "absolute": str(outside / SHARD), "subfolder": f"sub/{SHARD}"}
    _point_index_at(src, target[where])
    opened = []
    real = safetensors_header.read_header
    monkeypatch.setattr("dsv41_convert.convert.validate.read_header", lambda p: opened.append(p) or real(p))
    with pytest.raises(PlanError) as info:
        build_plan(src, 2)
    msg = str(info.value)
    why = {"parent": "points outside the checkpoint folder", "absolute": "is an absolute path",
           "subfolder": "is a path with folders"}[where]  # fmt: skip
    assert f"{INDEX}: weight_map names {target[where]!r} for " in msg and why in msg, msg
    assert "a shard must be a file beside the index" in msg and "download it" not in msg
    assert opened == [], "no header may be read before the index is found bad"


def test_download_checks_refuse_an_index_that_names_a_file_outside(tmp_path):
    src = make_tiny(tmp_path / "src")
    (tmp_path / "elsewhere").mkdir()
    shutil.move(src / SHARD, tmp_path / "elsewhere" / SHARD)
    _point_index_at(src, f"../elsewhere/{SHARD}")
    paths = [p.name for p in src.iterdir()]
    problems = check_checkpoint(src, paths)
    assert [(p.path, p.kind) for p in problems] == [(INDEX, "index")], problems
    assert verify_local("acme/tiny", local_dir=src).problems == tuple(problems)  # --verify-only, no record
    assert "'../elsewhere/model-00002-of-00003.safetensors' for " in problems[0].found
    assert "points outside the checkpoint folder" in problems[0].found
    assert "corrupt or was tampered with" in problems[0].expected


def _as_hf_cache(src: Path, root: Path) -> Path:
    """src laid out as huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap, blobs = root / "snapshots" / rev, root / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(src.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / sha)
        (snap / f.name).symlink_to(Path("../../blobs") / sha)
    return snap


def test_hf_cache_symlinks_still_work(tmp_path):
    snap = _as_hf_cache(make_tiny(tmp_path / "src"), tmp_path / "models--o--n")
    assert (snap / SHARD).is_symlink()
    assert check_checkpoint(snap, [p.name for p in snap.iterdir()]) == []
    plan = build_plan(snap, 2)
    out = tmp_path / "out"
    summary = execute(plan, out)
    assert summary["manifest"] and check_folder(out).ok
    clean = tmp_path / "clean"
    execute(build_plan(tmp_path / "src", 2), clean)
    for f in sorted(clean.glob("model*-mp2.safetensors")):
        assert (out / f.name).read_bytes() == f.read_bytes()


def test_held_twice_names_each_file_against_the_first_holder():
    from dsv41_convert.store.index import held_twice

    files = [("a", ["x", "y"]), ("b", ["y", "z"]), ("c", None), ("d", ["x", "y", "w"])]
    assert held_twice(files) == {"b": {"a": ["y"]}, "d": {"a": ["x", "y"]}}
    assert held_twice([("a", ["x"]), ("b", ["y"])]) == {}


def test_bad_shard_names_counts_the_tensors_of_each_bad_name():
    """Each bad weight_map value is reported once, in index order, with the first tensor mapped to it and how
    many are: the count stayed at 1 however many tensors an index sent outside the folder, which understated
    a tampered index (3 tensors here, counted by hand)."""
    weight_map = {
        "embed.weight": "../x.safetensors",
        "head.weight": "model-00001-of-00002.safetensors",
        "norm.weight": "../x.safetensors",
        "layers.0.attn_norm.weight": "/abs.safetensors",
        "layers.0.ffn_norm.weight": "../x.safetensors",
    }
    found = [(b.name, b.example, b.count) for b in bad_shard_names(weight_map)]
    assert found == [("'../x.safetensors'", "embed.weight", 3), ("'/abs.safetensors'", "layers.0.attn_norm.weight", 1)]
    assert "for 3 tensors (e.g. embed.weight)" in bad_shard_names(weight_map)[0].describe()
