"""`--dry-run` of one share (RANK and WORLD_SIZE, as torchrun sets them): it lists what that process's run
writes, no more, for `shard` and `export` alike; the share's real run is the measure (its `written` and the
files it leaves)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import run_cli
from tiny_ckpt import make_tiny


def _no_launch(monkeypatch) -> None:
    """No torchrun variables, whatever ran in this process before."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _whole_runs_dry_run(monkeypatch, capsys, verb: str, src: Path, out: Path, options: list[str]) -> dict:
    """`verb SRC OUT *options --dry-run --json` of one process, no launch: the whole run's files."""
    _no_launch(monkeypatch)
    code, dry, err = run_cli(monkeypatch, capsys, verb, str(src), str(out), *options, "--dry-run", "--json")
    assert code == 0, err
    return json.loads(dry)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("dry-share") / "src")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(
    ("command", "listed"), [(["shard", "--tp", "4"], "files"), (["export", "--format", "bf16"], "files")]
)
def test_a_shares_dry_run_lists_the_files_its_run_writes(src, tmp_path, monkeypatch, capsys, rank, command, listed):
    """Guards against `export --dry-run` under RANK/WORLD_SIZE listing every output shard (all of SRC's,
    with their total) while the share's run writes only its half; `shard --dry-run` lists its share's ranks."""
    out = tmp_path / "out"
    verb, *options = command
    dry = _whole_runs_dry_run(monkeypatch, capsys, verb, src, out, options)
    every = dry[listed]  # the files of the whole run
    monkeypatch.setenv("WORLD_SIZE", "2")  # a share left in the shell, not a launch: the run still writes it
    monkeypatch.setenv("RANK", str(rank))
    code, dry, err = run_cli(monkeypatch, capsys, verb, str(src), str(out), *options, "--dry-run", "--json")
    assert code == 0, err
    planned = json.loads(dry)
    code, ran, err = run_cli(monkeypatch, capsys, verb, str(src), str(out), *options, "--json")
    assert code == 0, err
    written = json.loads(ran)["written"]
    assert 0 < len(written) < len(every)  # a share: some of the files, not all
    assert sorted(f["file"] for f in planned[listed]) == sorted(written)
    for f in planned[listed]:
        assert f["bytes"] == (out / f["file"]).stat().st_size, f["file"]
    assert planned["total_bytes"] == sum((out / name).stat().st_size for name in written)


def test_a_resume_dry_run_lists_only_the_ranks_its_run_writes(src, tmp_path, monkeypatch, capsys):
    """Guards against `shard --resume --dry-run` listing ranks 1 and 3, finished by an earlier `--ranks 1,3`
    run, among the ranks "this run would write" (README, `shard`), while the `--resume` run writes only 0 and 2."""
    out = tmp_path / "out"
    _no_launch(monkeypatch)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "4", "--ranks", "1,3")
    assert code == 0, err
    resume = ("shard", str(src), str(out), "--tp", "4", "--resume", "--json")
    code, dry, err = run_cli(monkeypatch, capsys, *resume, "--dry-run")
    assert code == 0, err
    listed = sorted(r["rank"] for r in json.loads(dry)["files"])
    code, ran, err = run_cli(monkeypatch, capsys, *resume)
    assert code == 0, err
    written = json.loads(ran)["written"]
    assert sorted(written) == ["model0-mp4.safetensors", "model2-mp4.safetensors"]  # 1 and 3 skipped, as finished
    assert listed == [0, 2]


def test_a_resume_dry_run_of_an_export_lists_what_the_other_share_left(src, tmp_path, monkeypatch, capsys):
    """The same for `export --resume --dry-run` after one share of two: the shards the share finished are not
    listed, the other share's are; and one whose bytes a done record no longer matches in size is listed again,
    as the run writes it again."""
    out = tmp_path / "out"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code, ran, err = run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "bf16", "--json")
    assert code == 0, err
    first = json.loads(ran)["written"]
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name)
    resume = ("export", str(src), str(out), "--format", "bf16", "--resume", "--json")
    code, dry, err = run_cli(monkeypatch, capsys, *resume, "--dry-run")
    assert code == 0, err
    listed = sorted(f["file"] for f in json.loads(dry)["files"])
    assert listed and not set(listed) & set(first)
    with open(out / first[0], "ab") as cut:  # no longer the size its done record says
        cut.write(b"x")
    code, dry, err = run_cli(monkeypatch, capsys, *resume, "--dry-run")
    assert sorted(f["file"] for f in json.loads(dry)["files"]) == sorted([*listed, first[0]])
    code, ran, err = run_cli(monkeypatch, capsys, *resume)
    assert code == 0, err
    assert sorted(json.loads(ran)["written"]) == sorted([*listed, first[0]])


@pytest.mark.parametrize("command", [["shard", "--tp", "2"], ["export", "--format", "bf16"]], ids=["shard", "export"])
def test_a_share_of_no_file_writes_nothing_whenever_it_starts(src, tmp_path, monkeypatch, capsys, command):
    """More processes than output files (torchrun's WORLD_SIZE past the rank files or shards): a share that holds
    none and started after the others had finished was refused, exit 2 ("files other than the other ranks'
    files (model.safetensors.index.json)"), so torchrun failed a complete run. Such a share now touches nothing
    and says so, its dry run too, whether it starts first or last; the others' run is whole."""
    out = tmp_path / "out"
    verb, *options = command
    dry = _whole_runs_dry_run(monkeypatch, capsys, verb, src, out, options)
    world = len(dry["files"]) + 1  # the last share holds no file
    monkeypatch.setenv("WORLD_SIZE", str(world))

    def run_share(rank: int, *extra: str) -> dict:
        monkeypatch.setenv("RANK", str(rank))
        code, doc, err = run_cli(monkeypatch, capsys, verb, str(src), str(out), *options, *extra, "--json")
        assert code == 0, (rank, extra, err)
        return json.loads(doc)

    assert run_share(world - 1)["nothing_to_write"] and not out.exists()  # first: OUT not even made
    for rank in range(world - 1):
        assert run_share(rank)["written"]
    assert (out / "manifest.json").is_file()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    for extra in (["--dry-run"], []):  # last, after the others finished
        doc = run_share(world - 1, *extra)
        assert doc.get("total_bytes", 0) == 0 and not doc.get("written"), doc
    assert doc["nothing_to_write"] and doc["manifest"] is None
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    monkeypatch.setenv("RANK", str(world - 1))
    code, _, err = run_cli(monkeypatch, capsys, verb, str(src), str(out), *options)
    assert code == 0 and "no " in err and "in this share" in err, err
    # and no progress display first: its title and an empty bar came before "no ... in this share" (a helper's hunt)
    assert f"{verb} {src} -> {out}" not in err, err


def test_a_shard_dry_run_says_the_plans_files_in_plan_json_keys(src, tmp_path, monkeypatch, capsys):
    """`plan --json` and `shard --dry-run --json` describe the same files: `plan` listed them as `files` with
    `n_tensors` (and `tensors`, the list of them), the dry run as `ranks` with `tensors` a count, so a pipeline
    reading one document's keys got a KeyError, or a count for a list, from the other (a carried item,
    2026-12-07). Now the dry run uses plan's keys, `rules` beside them; export's dry run too."""
    _no_launch(monkeypatch)
    code, doc, err = run_cli(monkeypatch, capsys, "plan", str(src), "--tp", "2", "--json")
    assert code == 0, err
    plan = json.loads(doc)
    dry = _whole_runs_dry_run(monkeypatch, capsys, "shard", src, tmp_path / "out", ["--tp", "2"])
    for key in ("src", "tp", "expert_dtype", "source_format", "total_bytes"):
        assert dry[key] == plan[key], key
    assert "ranks" not in dry
    said = ("rank", "file", "n_tensors", "bytes")
    assert [{k: f[k] for k in said} for f in dry["files"]] == [{k: f[k] for k in said} for f in plan["files"]]
    assert all(f["n_tensors"] == len(p["tensors"]) for f, p in zip(dry["files"], plan["files"], strict=True))
    assert all(sum(f["rules"].values()) == f["n_tensors"] for f in dry["files"])
    export = _whole_runs_dry_run(monkeypatch, capsys, "export", src, tmp_path / "exp", ["--format", "bf16"])
    assert all(set(f) == {"file", "n_tensors", "bytes", "rules"} for f in export["files"])
