"""make-tiny --preset full --sparse: the published V4.1-Flash layout at full size as holes, checked against
the reconstructed published headers (tests/data/reference), plus the tokenizer the Engram map needs and
the options it refuses."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from cli_run import run_cli
from reference_src import REFERENCE

from dsv41_convert.config import load_model_args
from dsv41_convert.engram_tokens import load_token_map
from dsv41_convert.store.safetensors_header import read_header
from dsv41_convert.synth.staged import MARK

pytestmark = pytest.mark.slow  # ~20 s: the tokenizer is fitted to the Engram map's size


@pytest.fixture(scope="module")
def hollow(tmp_path_factory) -> tuple[Path, dict]:
    from dsv41_convert.synth.hollow import write_hollow

    out = tmp_path_factory.mktemp("full") / "v41"
    return out, write_hollow(out)


def test_layout_is_the_published_one(hollow):
    out, summary = hollow
    with gzip.open(REFERENCE / "v41-flash.headers.RECONSTRUCTED.json.gz") as f:
        published = json.load(f)["shards"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(published)
    for file, info in published.items():
        header = read_header(out / file)
        ours = {n: (e.dtype, tuple(e.shape)) for n, e in header.tensors.items()}
        assert ours == {n: (t["dtype"], tuple(t["shape"])) for n, t in info["tensors"].items()}, file
        assert (out / file).stat().st_size - header.data_start == info["data_bytes"], file
        assert (out / file).stat().st_size == info["file_size"], file  # the published size, header included
    assert summary["n_tensors"] == 96085 and summary["total_size"] == 510_286_023_000
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 510_286_023_000 and len(index["weight_map"]) == 96085
    with gzip.open(REFERENCE / "v41-flash.model.safetensors.index.RECONSTRUCTED.json.gz") as f:
        # the reconstructed index: the published mapping and length (7,470,294 bytes), keys sorted; the published
        # key order is unknown, so these are not the published bytes (sha256 74b0686a...)
        assert (out / "model.safetensors.index.json").read_bytes() == f.read()
    for name in ("config.json", "tokenizer_config.json"):  # hash-verified copies of the published files
        assert (out / name).read_bytes() == (REFERENCE / f"v41-flash.{name}").read_bytes(), name


def test_holes_read_as_zeros_and_take_no_disk(hollow):
    out, summary = hollow
    assert summary["disk_bytes"] < 40 * 2**20
    assert sum(p.stat().st_blocks * 512 for p in out.iterdir() if p.name != MARK) == summary["disk_bytes"]
    path = out / "model-00047-of-00048.safetensors"
    header = read_header(path)
    e = header.tensors["layers.1.engram.embed.scale"]
    with open(path, "rb") as f:
        f.seek(e.begin + 1000 * 8)
        assert f.read(4096) == bytes(4096)  # e8m0 code 0 = 2^-127: a valid scale


def test_tokenizer_feeds_the_engram_map(hollow):
    out, _ = hollow
    args = load_model_args(out / "config.json")
    token_map = load_token_map(out / "tokenizer.json", args.engram_compressed_vocab_size)
    assert len(token_map) == args.vocab_size == 129280
    assert max(token_map) + 1 == args.engram_compressed_vocab_size == 99092


def test_plan_and_dry_run_run_on_it(hollow, monkeypatch, capsys):
    """The dry run plans the full layout; like the run, it refuses a disk without room for the 537 GB."""
    import dsv41_convert.convert.execute as execute_mod

    out, _ = hollow
    args = ("shard", str(out), str(out.parent / "mp8"), "--tp", "8", "--dry-run", "--json")
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 10**12)
    code, stdout, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["tp"] == 8 and summary["total_bytes"] > 537e9  # wo_a to bf16, replicated tensors x 8
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 10**11)
    code, stdout, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and "537.31 GB to write but only 100.00 GB free" in json.loads(stdout)["error"], err
    assert not (out.parent / "mp8").exists()


def test_its_summary_line_gives_the_apparent_size(hollow, monkeypatch, capsys):
    """The line `make-tiny --preset full --sparse` ends with said "510,286,023,000 bytes apparent": the tensor
    bytes (total_size), while the shards' apparent size, headers included, is 510,296,708,312 (README)."""
    from dsv41_convert.synth import hollow as hollow_mod

    out, summary = hollow
    monkeypatch.setattr(hollow_mod, "write_hollow", lambda *args, **kw: summary)  # the fixture's run, not another
    # --overwrite: OUT (the fixture's) is refused as not empty before write_hollow is called
    code, _, err = run_cli(monkeypatch, capsys, "make-tiny", str(out), "--preset", "full", "--sparse", "--overwrite")
    apparent = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert code == 0 and apparent == 510_296_708_312, err
    assert f"{apparent:,} bytes apparent (510,286,023,000 of tensors)" in err, err


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--preset", "full"], r"--preset full goes with --sparse"),
        (["--sparse"], r"--preset full goes with --sparse"),
        (["--preset", "full", "--sparse", "--source-dtype", "bf16"], r"no --source-dtype bf16, --no-vision"),
        (["--preset", "full", "--sparse", "--seed", "3"], r"with no weights .*--shards or --seed"),  # was ignored
    ],
)
def test_refused_combinations(tmp_path, monkeypatch, capsys, extra, match):
    import re

    code, _, err = run_cli(monkeypatch, capsys, "make-tiny", str(tmp_path / "x"), *extra)
    assert code == 2 and re.search(match, err), err
    assert not (tmp_path / "x").exists()


def test_a_filesystem_without_holes_is_refused_at_the_first_shard(tmp_path):
    """On a filesystem that stores holes as data the full layout would try to fill ~510 GB: the first shard
    whose blocks on disk are more than half its size stops the run, naming the filesystem's trouble."""
    from dsv41_convert.errors import OutputError
    from dsv41_convert.synth.hollow import SPARSE_SLACK, _check_sparse

    hollow = tmp_path / "hollow.safetensors"
    with open(hollow, "wb") as f:
        f.truncate(4 * SPARSE_SLACK)
    _check_sparse(hollow, tmp_path)  # a hole: passes
    dense = tmp_path / "dense.safetensors"
    dense.write_bytes(b"\1" * (4 * SPARSE_SLACK))
    with pytest.raises(OutputError, match=r"does not keep files sparse \(dense\.safetensors: 4,194,304 bytes on disk"):
        _check_sparse(dense, tmp_path)


@pytest.mark.parametrize("where", ["start", "tokenizer", "shards"])
def test_a_signal_taken_early_stops_it_at_the_next_step(tmp_path, monkeypatch, where):
    """A Ctrl-C that landed while torch was imported (postponed to the next check: interrupts.py) stopped the
    run only after the tokenizer (~2.7 s) and every shard, 5-7 s later, longer than the whole run (an audit).
    Now write_hollow checks at its start, before each tokenizer try and before each shard."""
    from dsv41_convert import interrupts
    from dsv41_convert.synth import hollow, tokenizer

    monkeypatch.setitem(interrupts._state, "interrupted", where == "start")
    done = []
    real_build, real_check = tokenizer.build_tokenizer, hollow._check_sparse

    def build(*args, **kw):
        done.append("try")
        interrupts._state["interrupted"] |= where == "tokenizer"  # lands during the first try
        return real_build(*args, **kw)

    def shard_written(*args):
        done.append("shard")
        interrupts._state["interrupted"] |= where == "shards"  # lands while the first shard is written
        return real_check(*args)

    monkeypatch.setattr(tokenizer, "build_tokenizer", build)
    monkeypatch.setattr(hollow, "_check_sparse", shard_written)
    with pytest.raises(KeyboardInterrupt):
        hollow.write_hollow(tmp_path / "full")
    tries = done.count("try")
    assert done == {"start": [], "tokenizer": ["try"], "shards": ["try"] * tries + ["shard"]}[where]
    assert not (tmp_path / "full").exists()  # a folder the run made is removed


@pytest.mark.parametrize(
    "command",
    [
        ("plan", "--tp", "8"),
        ("shard", "OUT", "--tp", "8", "--dry-run"),
        ("export", "OUT", "--format", "bf16", "--dry-run"),
    ],
)
def test_published_tensors_with_an_edited_setting_are_warned_of(hollow, tmp_path, monkeypatch, capsys, command):
    """A config.json of the published tensors with a setting no tensor shows changed (sliding_window, a rope
    beta) ran every command, exit 0, without a word; verify then passed it (it runs source and conversion under
    the one config). Named now, with the published value; the published config itself is not warned of."""
    import dsv41_convert.convert.execute as execute_mod

    out, _ = hollow
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 10**13)
    args = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    argv = (args[0], str(out), *args[1:])
    config = out / "config.json"
    published = config.read_bytes()
    code, _, err = run_cli(monkeypatch, capsys, *argv)
    assert code == 0 and "published V4.1-Flash tensors with other settings" not in err, err
    edited = json.loads(published)
    edited["text_config"]["sliding_window"] = 256
    edited["text_config"]["rope_scaling"]["beta_fast"] = 16
    try:
        config.write_text(json.dumps(edited))
        code, _, err = run_cli(monkeypatch, capsys, *argv)
    finally:
        config.write_bytes(published)
    assert code == 0, err
    assert f"{config}: the published V4.1-Flash tensors with other settings:" in err
    assert "text_config.sliding_window 256 (published 128)" in err
    assert "text_config.rope_scaling.beta_fast 16 (published 32)" in err
