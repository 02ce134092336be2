"""End to end: make-tiny checkpoints -> shard at tp 1/2/4/8 -> every output tensor against an independent
all-in-RAM statement of upstream convert.py (tests/reference_convert.py), byte for byte.

Byte equality of the whole file with safetensors' own `save(reference)` checks names, dtypes, shapes,
values and the header at once; key sets and a strict load are checked on top.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference_convert import reference_convert
from slow_writes import slow_pwrites

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.store.file_digest import sha256_file


def _make_tiny(out: Path, quantized: bool = True) -> Path:
    """`dsv41-convert make-tiny OUT --seed 3 [--source-dtype bf16]`, in-process."""
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import write_checkpoint

    write_checkpoint(out, PRESETS["tiny"], seed=3, quantized=quantized)
    return out


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory) -> Path:
    return _make_tiny(tmp_path_factory.mktemp("src") / "fp8")


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory) -> Path:
    return _make_tiny(tmp_path_factory.mktemp("src") / "bf16", quantized=False)


def _check_against_reference(src: Path, out: Path, tp: int, expert_dtype: str) -> None:
    ref = reference_convert(src, tp, expert_dtype)
    for rank, sd in enumerate(ref):
        path = out / f"model{rank}-mp{tp}.safetensors"
        got = load_file(path)
        assert set(got) == set(sd), (sorted(set(got) ^ set(sd)))[:5]
        for name, want in sd.items():
            have = got[name]
            assert (have.dtype, tuple(have.shape)) == (want.dtype, tuple(want.shape)), name
            assert torch.equal(have.view(torch.uint8), want.contiguous().view(torch.uint8)), name
        assert path.read_bytes() == save(sd), f"{path} differs from safetensors' serialization of the reference"


def _shard(src: Path, out: Path, tp: int, expert_dtype: str, **kw) -> dict:
    plan = build_plan(src, tp, expert_dtype)
    return execute(plan, out, chunk_bytes=kw.pop("chunk_bytes", 1 << 16), **kw)


def test_fp8_source_tp2_fp4_matches_reference(fp8_src, tmp_path):
    summary = _shard(fp8_src, tmp_path / "out", 2, "fp4")
    assert len(summary["written"]) == 2
    _check_against_reference(fp8_src, tmp_path / "out", 2, "fp4")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 4, 8])
@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_fp8_source_matches_reference(fp8_src, tmp_path, tp, expert_dtype):
    _shard(fp8_src, tmp_path / "out", tp, expert_dtype, workers=2 if tp == 8 else 1)
    _check_against_reference(fp8_src, tmp_path / "out", tp, expert_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [100, 1000, 1 << 20])
def test_column_splits_match_reference_at_every_chunk_size(fp8_src, tmp_path, monkeypatch, chunk):
    """Tensors split by columns (wo_b at tp 2) are read as whole rows into one reused buffer and their
    columns picked into the writer's three buffers; a chunk narrower than one row's columns (100 bytes)
    takes a new array. pwrites slowed, so a buffer refilled before its write finished would show."""
    plan = build_plan(fp8_src, 2, "fp4")
    widths = [
        (t.reads[0].c1 - t.reads[0].c0)
        for f in plan.files
        for t in f.tensors
        if t.action == "copy" and t.reads[0].c1 >= 0
    ]
    assert widths and max(widths) > 100  # the narrow chunk takes the fallback for some
    slow_pwrites(monkeypatch, 0.002)
    execute(plan, tmp_path / "out", chunk_bytes=chunk)
    _check_against_reference(fp8_src, tmp_path / "out", 2, "fp4")


@pytest.mark.slow
def test_fp8_source_tp2_fp8_experts(fp8_src, tmp_path):
    _shard(fp8_src, tmp_path / "out", 2, "fp8")
    _check_against_reference(fp8_src, tmp_path / "out", 2, "fp8")


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "expert_dtype"), [(1, "fp4"), (2, "fp4"), (4, "fp8"), (8, "fp4")])
def test_bf16_source_matches_reference(bf16_src, tmp_path, tp, expert_dtype):
    _shard(bf16_src, tmp_path / "out", tp, expert_dtype)
    _check_against_reference(bf16_src, tmp_path / "out", tp, expert_dtype)


@pytest.mark.slow
def test_bf16_source_gives_published_format(bf16_src, fp8_src, tmp_path):
    """A bf16 source converts to the same key set, dtypes and shapes as the published format."""
    _shard(bf16_src, tmp_path / "b", 2, "fp4")
    _shard(fp8_src, tmp_path / "f", 2, "fp4")
    for rank in range(2):
        b = load_file(tmp_path / "b" / f"model{rank}-mp2.safetensors")
        f = load_file(tmp_path / "f" / f"model{rank}-mp2.safetensors")
        assert {k: (v.dtype, v.shape) for k, v in b.items()} == {k: (v.dtype, v.shape) for k, v in f.items()}
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (cfg["dtype"], cfg["expert_dtype"]) == ("fp8", "fp4")


def test_f32_tensors_of_an_all_bf16_source_are_cast_up_to_f32(bf16_src, tmp_path):
    """A fine-tune saved wholly in bfloat16, the tensors the published checkpoint keeps in F32 (attn_sink, hc_*,
    the gate biases) included: shard writes those as F32, the values unchanged, as upstream does (SPEC §3), not
    the BF16 bytes under an F32 entry nor as BF16."""
    src = tmp_path / "src"
    shutil.copytree(bf16_src, src)
    recast = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.dtype == torch.float32:
                tensors[name] = recast[name] = t.to(torch.bfloat16)
        save_file(tensors, path)
    assert any("attn_sink" in n for n in recast) and any(".hc_" in n for n in recast)
    _shard(src, tmp_path / "out", 2, "fp4")
    _check_against_reference(src, tmp_path / "out", 2, "fp4")
    got = load_file(tmp_path / "out" / "model0-mp2.safetensors")
    hc = next(n for n in recast if ".hc_" in n)  # replicated: rank 0 holds it whole
    assert got[hc].dtype == torch.float32 and torch.equal(got[hc], recast[hc].float())


def test_cli_shard_sidecars_and_manifest(fp8_src, tmp_path, monkeypatch, capsys):
    from dsv41_convert.cli import main

    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # OUT given relative: every path of the document is absolute (an audit)
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", "shard", str(fp8_src), "out", "--tp", "2", "--json"])
    main()
    summary = json.loads(capsys.readouterr().out)
    assert summary["manifest"] == str(out.resolve() / "manifest.json") and summary["out"] == str(out.resolve())
    manifest = json.loads((out / "manifest.json").read_text())
    names = {"model0-mp2.safetensors", "model1-mp2.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert names | {"config.json", "hf_config.json"} == set(manifest["files"])
    for name, rec in manifest["files"].items():
        assert rec["sha256"] == sha256_file(out / name) and rec["size"] == (out / name).stat().st_size
    assert manifest["options"]["tp"] == 2 and manifest["source"]["index_sha256"]
    assert (out / "hf_config.json").read_bytes() == (fp8_src / "config.json").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == (fp8_src / "tokenizer.json").read_bytes()
    inference = json.loads((out / "config.json").read_text())
    assert inference["dtype"] == "fp8" and inference["expert_dtype"] == "fp4" and "dim" in inference
    assert not list(out.glob("*.partial"))


def test_ranks_and_resume(fp8_src, tmp_path):
    out = tmp_path / "out"
    first = _shard(fp8_src, out, 4, "fp4", ranks=[0, 3])
    assert sorted(first["written"]) == ["model0-mp4.safetensors", "model3-mp4.safetensors"]
    assert first["manifest"] is None and not (out / "manifest.json").exists()
    second = _shard(fp8_src, out, 4, "fp4", resume=True)
    assert sorted(second["skipped"]) == ["model0-mp4.safetensors", "model3-mp4.safetensors"]
    assert sorted(second["written"]) == ["model1-mp4.safetensors", "model2-mp4.safetensors"]
    assert second["manifest"] is not None
    _check_against_reference(fp8_src, out, 4, "fp4")


def test_torchrun_share_is_disjoint(fp8_src):
    from dsv41_convert.convert.execute import select_files

    plan = build_plan(fp8_src, 8)
    shares = [select_files(plan, None, {"WORLD_SIZE": "3", "RANK": str(r)}) for r in range(3)]
    files = [f.file for share in shares for f in share]
    assert sorted(files) == sorted(f.file for f in plan.files) and len(set(files)) == 8


@pytest.mark.parametrize("launched", [False, True])
def test_a_share_without_torchrun_says_so(fp8_src, tmp_path, monkeypatch, capsys, launched):
    """RANK and WORLD_SIZE left in the environment (no torchrun: no MASTER_ADDR, MASTER_PORT) had shard write
    one share and end well without a word that the other files are not written (an audit): it still writes
    its share, and warns; under torchrun (all four set) there is no warning."""
    from cli_run import run_cli

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value) if launched else monkeypatch.delenv(name, raising=False)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(fp8_src), str(tmp_path / "out"), "--tp", "4")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == [
        "model1-mp4.safetensors",
        "model3-mp4.safetensors",
    ]
    warned = "RANK=1 and WORLD_SIZE=2 are set without MASTER_ADDR and MASTER_PORT (torchrun sets all of them): this " \
        "process writes share 1 of 2 of the rank files only"  # fmt: skip
    assert (warned in err) is not launched, err
    if not launched:  # with --ranks, the variables share out its list, and the advice is not to give it again
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(fp8_src), str(tmp_path / "out2"), "--tp", "4",
                               "--ranks", "0,2")  # fmt: skip
        assert code == 0 and "share 1 of 2 of the --ranks rank files only" in err and "use --ranks" not in err, err
        assert sorted(p.name for p in (tmp_path / "out2").glob("*.safetensors")) == ["model2-mp4.safetensors"]
        monkeypatch.setenv("RANK", "3")  # a share of no file: no other share writes them either (it said they do)
        monkeypatch.setenv("WORLD_SIZE", "4")
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(fp8_src), str(tmp_path / "out3"), "--tp", "2")
        assert code == 0 and "none written: without torchrun no other share writes them" in " ".join(err.split()), err
        assert "the other shares write them all" not in err and not (tmp_path / "out3").exists()


@pytest.mark.parametrize("command", ["shard", "export"])
def test_a_dry_run_of_a_share_without_torchrun_says_so(fp8_src, tmp_path, monkeypatch, capsys, command):
    """RANK and WORLD_SIZE left in the environment (no MASTER_ADDR, MASTER_PORT): the run warns that it writes
    one share only, and its --dry-run listed that share's files (half of them here) without a word, exit 0,
    for a pipeline to take as the whole run. The dry run says the run's warning (stderr; stdout stays one
    document of that share's files), writes nothing, and under torchrun (all four set) says nothing."""
    from cli_run import run_cli

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["--tp", "4"] if command == "shard" else ["--format", "fp8"]
    warned = "RANK=1 and WORLD_SIZE=2 are set without MASTER_ADDR and MASTER_PORT (torchrun sets all of them): this " \
        f"process writes share 1 of 2 of the {'rank files' if command == 'shard' else 'shards'} only"  # fmt: skip
    for launched in (False, True):
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            monkeypatch.setenv(name, value) if launched else monkeypatch.delenv(name, raising=False)
        out = tmp_path / f"out-{launched}"
        code, doc, err = run_cli(monkeypatch, capsys, command, str(fp8_src), str(out), *args, "--dry-run", "--json")
        assert code == 0, err
        summary = json.loads(doc)  # one document, the rank first
        assert summary["rank"] == 1 and summary["files"], doc
        assert (warned in err) is not launched, err
        assert not out.exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_timeline_names_each_file_its_process_and_stages(bf16_src, tmp_path, workers):
    """--json's timeline: every written file once, in order of start, each inside the run's seconds,
    written by this process (1 worker) or by as many other processes as workers, with the stages of a
    quantizing run (the bf16 source's weights are computed, every file is hashed and written)."""
    import os

    summary = _shard(bf16_src, tmp_path / "out", 2, "fp4", workers=workers)
    timeline = summary["timeline"]
    assert sorted(r["file"] for r in timeline) == sorted(summary["written"])
    starts = [r["start_s"] for r in timeline]
    assert starts == sorted(starts)
    assert all(0 <= r["start_s"] <= r["end_s"] <= summary["seconds"] + 1e-3 for r in timeline)
    pids = {r["worker"] for r in timeline}
    if workers == 1:
        assert pids == {os.getpid()}
    else:  # a worker's first file includes its start (importing torch and the quantizers), timed apart
        assert len(pids) == workers and os.getpid() not in pids
        first = {pid: min((r for r in timeline if r["worker"] == pid), key=lambda r: r["start_s"]) for pid in pids}
        assert all(0 < r["stages"]["start"] <= r["end_s"] - r["start_s"] for r in first.values())
    for r in timeline:
        assert {"kernel", "hash", "write"} <= set(r["stages"]), r["stages"]
        assert all(v >= 0 for v in r["stages"].values())
