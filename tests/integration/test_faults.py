"""Fault injection: each bad input gives a clear error naming file and tensor, exit code 2, and nothing that
looks finished in OUT; kill -9 mid-run then --resume gives byte-identical output."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_run import (
    done_records,
    kill_9_with_a_done_file_and_a_partial,
    run_cli,
    run_cli_with_file_size_limit,
    run_records,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny, source_tensors, tiny_config, write_ckpt

from dsv41_convert.convert import execute as execute_mod
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.errors import OutputError
from dsv41_convert.store.lock import LOCK_NAME, read_holders
from dsv41_convert.store.safetensors_header import read_header

CLI = [sys.executable, "-m", "dsv41_convert.cli"]


def assert_nothing_finished(out: Path) -> None:
    if not out.exists():
        return
    assert not list(out.glob("model*-mp*.safetensors")), list(out.iterdir())
    assert not (out / "manifest.json").exists()


@pytest.fixture
def src(tmp_path) -> Path:
    return make_tiny(tmp_path / "src")


def _shard_file(src: Path, n: int = 1) -> Path:
    return src / f"model-{n:05d}-of-00003.safetensors"


def test_truncated_shard(src, tmp_path, monkeypatch, capsys):
    p = _shard_file(src, 2)
    os.truncate(p, p.stat().st_size - 7)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "out"), "--tp", "2")
    assert code == 2
    assert "model-00002-of-00003.safetensors: tensor" in err and "truncated" in err
    assert_nothing_finished(tmp_path / "out")


def test_corrupt_header_json(src, tmp_path, monkeypatch, capsys):
    p = _shard_file(src, 1)
    blob = bytearray(p.read_bytes())
    blob[8:12] = b"XXXX"
    p.write_bytes(bytes(blob))
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(src), "--tp", "2")
    assert code == 2 and "model-00001-of-00003.safetensors: header is not valid JSON" in err


def test_oversized_header(src, monkeypatch, capsys):
    p = _shard_file(src, 3)
    blob = bytearray(p.read_bytes())
    blob[:8] = struct.pack("<Q", 1 << 40)
    p.write_bytes(bytes(blob))
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(src))
    assert code == 2 and "model-00003-of-00003.safetensors: header length" in err and "limit" in err


def test_offsets_out_of_bounds(src, monkeypatch, capsys):
    p = _shard_file(src, 1)
    h = read_header(p)
    n = h.data_start - 8
    doc = json.loads(p.read_bytes()[8 : 8 + n])
    last = max(doc, key=lambda k: doc[k]["data_offsets"][1])
    doc[last]["data_offsets"][1] += 4096  # now runs 4096 bytes past the end of the file
    text = json.dumps(doc).encode()
    text += b" " * (-len(text) % 8)
    p.write_bytes(struct.pack("<Q", len(text)) + text + p.read_bytes()[h.data_start :])
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(src))
    assert code == 2 and "model-00001-of-00003.safetensors: tensor" in err and last in err


def test_tensor_missing_from_file(src, tmp_path, monkeypatch, capsys):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["layers.0.attn.wq_a.weight"] == "model-00002-of-00003.safetensors"
    index["weight_map"]["layers.0.attn.wq_a.weight"] = "model-00003-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "out"))
    assert code == 2 and "layers.0.attn.wq_a.weight is there, but the index puts it in model-00003" in err
    assert_nothing_finished(tmp_path / "out")


def test_tensor_missing_from_its_file(src, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    p = _shard_file(src, 2)
    tensors = load_file(p)
    del tensors["layers.0.attn.wq_a.weight"]
    save_file(tensors, p)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "out"))
    assert code == 2
    assert (
        "model-00002-of-00003.safetensors: tensor layers.0.attn.wq_a.weight is in the index but not in the file" in err
    )
    assert_nothing_finished(tmp_path / "out")


def test_tensor_missing_from_index(src, monkeypatch, capsys):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.2.ffn.experts.5.w3.scale"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(src))
    assert code == 2 and "tensor layers.2.ffn.experts.5.w3.scale is not in the index" in err


def test_tensor_no_rule_takes_is_not_called_an_index_problem(src, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    p = _shard_file(src, 2)
    tensors = load_file(p)
    tensors["layers.0.attn.mystery.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, p)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.0.attn.mystery.weight"] = p.name  # files and index agree
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "out"))
    assert code == 2 and "tensors no conversion rule takes: 1 problem " in " ".join(err.split()), err
    assert f"{p.name}: layers.0.attn.mystery.weight: no rule" in err and "disagree" not in err
    del index["weight_map"]["layers.0.attn.mystery.weight"]  # and both kinds at once
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(src))
    assert code == 2 and "files and index disagree; tensors no conversion rule takes: 2 problems" in err, err
    assert_nothing_finished(tmp_path / "out")


def test_scale_that_does_not_match_its_weight(tmp_path, monkeypatch, capsys):
    cfg = tiny_config()
    tensors = source_tensors(cfg)
    tensors["layers.1.attn.wo_b.scale"] = tensors["layers.1.attn.wo_b.scale"][:, :3]
    write_ckpt(tmp_path / "src", tensors, cfg)
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(tmp_path / "src"), "--tp", "2")
    assert code == 2 and "layers.1.attn.wo_b.scale: found F8_E8M0 [2, 3], expected F8_E8M0 [2, 8]" in err


def test_wrong_tp(src, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "out"), "--tp", "3")
    assert code == 2 and "cannot run at tp 3" in err and "routed experts" in err
    assert_nothing_finished(tmp_path / "out")


def test_nan_where_it_must_quantize(tmp_path, monkeypatch, capsys):
    cfg = tiny_config(quantized=False)
    tensors = source_tensors(cfg)
    tensors["layers.2.attn.wq_a.weight"][5, 7] = float("nan")
    write_ckpt(tmp_path / "src", tensors, cfg)
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(tmp_path / "src"), str(out), "--tp", "2")
    assert code == 2 and "layers.2.attn.wq_a.weight" in err and "nan" in err.lower()
    assert_nothing_finished(out)
    assert not list(out.glob("*.partial"))


def _planted(tmp_path: Path, name: str, at: tuple[int, int], byte: int) -> Path:
    """A tiny published source whose tensor `name` holds `byte` at `at` -> its folder."""
    cfg = tiny_config()
    tensors = source_tensors(cfg)
    tensors[name].view(torch.uint8)[at] = byte
    return write_ckpt(tmp_path / "src", tensors, cfg)


def _file_of(src: Path, name: str) -> str:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]


@pytest.mark.parametrize(
    ("name", "at", "byte", "what"),
    [
        ("layers.0.attn.wo_a.scale", (0, 0), 0xFF, "(source rows 0..127): scale is NaN (e8m0 byte 255) at [0, 0]"),
        ("layers.0.attn.wo_a.weight", (3, 21), 0x7F, "(source rows 0..127): weight is NaN (e4m3 byte 127) at [3, 21]"),
        (
            "layers.0.attn.wo_a.weight",
            (200, 5),
            0xFF,
            "(source rows 128..255): weight is NaN (e4m3 byte 255) at [200, 5]",
        ),
        ("layers.0.attn.wo_a.scale", (6, 0), 0xFF, "(source rows 128..255): scale is NaN (e8m0 byte 255) at [6, 0]"),
    ],
)
def test_shard_refuses_a_nan_byte_in_wo_a(tmp_path, monkeypatch, capsys, name, at, byte, what):
    """`shard` decodes wo_a to bf16 (quant/fp8_bytes.py): a NaN scale or e4m3 byte would be written as NaN
    weights. Rows 0..127 of wo_a [256, 32] are rank 0's, 128..255 rank 1's: that rank's file is never
    finished, and the message names the block's source rows and the index in the source tensor (it counted
    from the block's first row: an audit)."""
    src = _planted(tmp_path, name, at, byte)
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2")
    assert code == 2 and f"{_file_of(src, 'layers.0.attn.wo_a.weight')}: layers.0.attn.wo_a.weight {what}" in err
    assert "corrupt shard?" in err
    rank = at[0] * (32 if name.endswith(".scale") else 1) // 128  # a scale row per 32 weight rows
    assert not (out / f"model{rank}-mp2.safetensors").exists() and not (out / "manifest.json").exists()
    assert not list(out.glob("*.partial"))


@pytest.mark.parametrize(
    ("name", "at", "blocks"),
    [
        ("layers.2.attn.wq_a.weight", (20, 9), None),  # replicated, one block
        ("layers.2.attn.wo_b.weight", (5, 200), None),  # dim-1 split at tp 2: rank 1's columns from 128 on
        ("layers.1.engram.wkv.weight", (300, 5), "blocks"),  # [320, 128], read in blocks of 128 rows
    ],
)
def test_a_nan_to_quantize_is_said_at_its_index_in_the_source_tensor(tmp_path, monkeypatch, capsys, name, at, blocks):
    """A rank's columns, and a block of rows of a tensor read in blocks, are checked as arrays of their own; the
    message gives the index and shape of the source tensor (an audit: [72, 5] for [200, 5], the block's shape)."""
    import dsv41_convert.convert.write as write

    cfg = tiny_config(quantized=False)
    tensors = source_tensors(cfg)
    rows, cols = tensors[name].shape
    tensors[name][at] = float("nan")
    write_ckpt(tmp_path / "src", tensors, cfg)
    if blocks:  # blocks of plan.ROW_ALIGN (128) rows, the least, instead of 16 MiB / 8 of source bytes
        monkeypatch.setattr(write, "compute_chunk_bytes", lambda chunk_bytes, device: 8 * 128 * cols * 2)
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(tmp_path / "src"), str(out), "--tp", "2", "--workers", "1")
    assert code == 2 and f"{name}" in err and f"found nan at index [{at[0]}, {at[1]}]" in err, err
    assert f"in BF16 {[rows, cols]}" in err
    if blocks:
        first = at[0] // 128 * 128
        assert f"{name} (source rows {first}..{min(first + 128, rows) - 1})" in err
        assert f"of the {(min(first + 128, rows) - first) * cols} read" in err


@pytest.mark.parametrize(
    ("weight", "at"), [("layers.1.attn.wq_a.weight", (0, 1)), ("layers.0.ffn.experts.6.w2.weight", (3, 0))]
)
def test_bf16_export_refuses_a_nan_scale(tmp_path, monkeypatch, capsys, weight, at):
    """`export --format bf16` decodes every fp8 weight (quant/fp8_bytes.py) and every fp4 expert
    (quant/fp4_bytes.py): a NaN scale is refused, and the file it is in is never finished (as
    tests/integration/test_export_faults.py's assert_nothing_finished)."""
    src = _planted(tmp_path, weight.removesuffix(".weight") + ".scale", at, 0xFF)
    bad_file = _file_of(src, weight)
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "bf16")
    assert code == 2 and f"{bad_file}: {weight}: scale is NaN (e8m0 byte 255) at [{at[0]}, {at[1]}]" in err
    for name in ("manifest.json", "config.json", "model.safetensors.index.json", bad_file):
        assert not (out / name).exists(), name
    assert not list(out.glob("*.partial"))


@pytest.mark.parametrize(
    ("command", "weight", "at"),
    [
        ("shard", "layers.0.attn.wo_a.weight", (0, 0)),
        ("export", "layers.1.attn.wq_a.weight", (0, 1)),
        ("export", "layers.0.ffn.experts.6.w2.weight", (3, 0)),
    ],
)
def test_a_scale_that_decodes_to_infinity_is_refused(tmp_path, monkeypatch, capsys, command, weight, at):
    """e8m0 byte 254 (2**127) times any code of 2 or more is 2**128: infinite in bf16. Before (an audit),
    `shard` and `export --format bf16` wrote inf weights and exited 0."""
    src = _planted(tmp_path, weight.removesuffix(".weight") + ".scale", at, 254)
    out = tmp_path / "out"
    args = ("shard", str(src), str(out), "--tp", "2") if command == "shard" else ("export", str(src), str(out))
    code, _, err = run_cli(monkeypatch, capsys, *args, *(["--format", "bf16"] if command == "export" else []))
    assert code == 2 and f"{_file_of(src, weight)}: {weight}" in err and "decodes to infinity" in err, err
    assert "x scale 2**127 >= 2**128" in err and "corrupt shard?" in err
    assert not (out / "manifest.json").exists() and not list(out.glob("*.partial"))


@pytest.mark.parametrize("name", ["layers.2.attn.wq_a.weight", "layers.0.ffn.experts.6.w2.weight"])
def test_a_bf16_value_too_large_to_encode_is_refused(tmp_path, monkeypatch, capsys, name):
    """3.3e38 (finite in bf16) rounds up to 2**128 in its fp8 or fp4 block: before, export wrote a block that
    decodes to inf and exited 0, and a bf16 export of that wrote inf."""
    cfg = tiny_config(quantized=False)
    tensors = source_tensors(cfg)
    tensors[name][5, 7] = 3.3e38
    write_ckpt(tmp_path / "src", tensors, cfg)
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "export", str(tmp_path / "src"), str(out), "--format", "fp8-fp4")
    assert code == 2 and f"{_file_of(tmp_path / 'src', name)}: {name}" in err and "decodes to infinity" in err, err
    assert "check the source tensor" in err
    assert not (out / "manifest.json").exists() and not list(out.glob("*.partial"))


def test_out_inside_src_and_nonempty_out(src, tmp_path):
    plan = build_plan(src, 1)
    with pytest.raises(OutputError, match="inside"):
        execute_mod.execute(plan, src / "out")
    with pytest.raises(OutputError, match="source folder"):
        execute_mod.execute(plan, src)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(OutputError, match="not empty"):
        execute_mod.execute(plan, tmp_path / "full")


def test_not_enough_disk_up_front(src, tmp_path, monkeypatch):
    """Refused before the first byte: no record in OUT (an audit: the source record left made the next plain run
    "not empty"), and no OUT where the run made it, nor the folders it made above it (they were left empty)."""
    plan = build_plan(src, 2)
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 1000)
    with pytest.raises(OutputError, match=r" bytes to write but only 1,000 bytes free"):
        execute_mod.execute(plan, tmp_path / "made" / "out")
    assert not (tmp_path / "made").exists()
    (tmp_path / "yours").mkdir()
    with pytest.raises(OutputError, match=r" bytes to write but only 1,000 bytes free"):
        execute_mod.execute(plan, tmp_path / "yours")
    assert list((tmp_path / "yours").iterdir()) == []  # a folder that was there stays, as it was


def test_room_for_the_rank_files_alone_is_not_enough(src, tmp_path, monkeypatch):
    """The space check counted the rank files' bytes alone: a disk with room for them but not for the tokenizer
    and config files written beside them passed it, and the run failed near its end (an audit)."""
    plan = build_plan(src, 2)
    ranks = sum(f.nbytes for f in plan.files)
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: ranks)
    with pytest.raises(OutputError, match=r"\d bytes to write but only [\d,]+ bytes free"):  # equal in GB
        execute_mod.execute(plan, tmp_path / "out")
    assert_nothing_finished(tmp_path / "out")
    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 10 * ranks)
    assert execute_mod.execute(plan, tmp_path / "out2")["manifest"]


@pytest.mark.slow
def test_disk_full_while_writing(src, tmp_path):
    """A real write error: the file-size limit makes write() fail with EFBIG mid-file, as a full disk would (said
    as the limit it is: more free space does not lift it)."""
    out = tmp_path / "out"
    res = run_cli_with_file_size_limit(200_000, "shard", str(src), str(out), "--tp", "1")
    err = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stderr
    limit = "larger than the file system or the file-size limit (ulimit -f) allows"
    assert f"model0-mp1.safetensors: {limit} while writing tensor" in err
    assert "bytes handed to the disk" in err  # not "(N of N bytes)", which read as finished
    assert_nothing_finished(out)
    assert not list(out.glob("*.partial")) and not run_records(out)


@pytest.mark.slow
@pytest.mark.parametrize(("io", "partial_bytes"), [("--direct-io", -1), ("--buffered-io", 20_000)])
def test_kill_9_then_resume_is_byte_identical(src, tmp_path, io, partial_bytes):
    """With O_DIRECT (the default) a partial file shows its bytes only at its end here (one staging piece)."""
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    subprocess.run([*CLI, "shard", str(src), str(clean), "--tp", "4", "--json"], check=True, capture_output=True)
    env = {**os.environ, "DSV41_CONVERT_TEST_THROTTLE_S": "0.01"}
    # two workers for four files: the second pair starts once the first is done, so the kill lands mid-file
    # (with four, all finished within the moment between seeing one done and the kill: seen once in CI's setting)
    cmd = [*CLI, "shard", str(src), str(killed), "--tp", "4", "--json", io, "--workers", "2"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, process_group=0)
    kill_9_with_a_done_file_and_a_partial(proc, killed, partial_bytes)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "manifest.json").exists()
    finished = done_records(killed)  # a file killed between its rename and its record is rewritten
    assert 1 <= len(finished) < 4 and list(killed.glob("*.partial"))
    assert finished <= {p.name for p in killed.glob("model*-mp4.safetensors")}
    # the lock file outlives its holder; the lock itself died with it (store/lock.py)
    assert [h.pid for h in read_holders((killed / LOCK_NAME).read_bytes())] == [proc.pid]
    res = subprocess.run([*CLI, "shard", str(src), str(killed), "--tp", "4", "--resume", "--json"],
                         check=True, capture_output=True, text=True)  # fmt: skip
    summary = json.loads(res.stdout)
    # every file finished before the kill is skipped; so may be one its workers finished after it (they die
    # a moment later; the resume waits for them: die_with.py); every other file is written again
    skipped, written = set(summary["skipped"]), set(summary["written"])
    assert finished <= skipped and not skipped & written and len(skipped | written) == 4 and summary["manifest"]
    assert summary["took_over"] and f"pid {proc.pid} on" in summary["took_over"][0]
    assert f"took over the lock of a run that ended without releasing it: pid {proc.pid}" in res.stderr
    assert not list(killed.glob("*.partial")) and not (killed / LOCK_NAME).exists()
    for p in sorted(clean.glob("model*")):
        assert (killed / p.name).read_bytes() == p.read_bytes(), p.name
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (clean, killed))
    assert a["files"] == b["files"]
    assert subprocess.run([*CLI, "check", str(killed)], capture_output=True).returncode == 0


def test_resume_redoes_a_corrupted_finished_file(src, tmp_path):
    out = tmp_path / "out"
    plan = build_plan(src, 2)
    execute_mod.execute(plan, out)
    good = (out / "model1-mp2.safetensors").read_bytes()
    with open(out / "model1-mp2.safetensors", "r+b") as f:
        f.seek(len(good) - 1)
        f.write(bytes([good[-1] ^ 1]))
    summary = execute_mod.execute(plan, out, resume=True)
    assert summary["written"] == ["model1-mp2.safetensors"] and summary["skipped"] == ["model0-mp2.safetensors"]
    assert (out / "model1-mp2.safetensors").read_bytes() == good


@pytest.mark.slow
def test_workers_match_single_process(src, tmp_path):
    plan = build_plan(src, 4, "fp8")
    execute_mod.execute(plan, tmp_path / "a")
    execute_mod.execute(plan, tmp_path / "b", workers=2)
    for p in (tmp_path / "a").glob("model*"):
        assert (tmp_path / "b" / p.name).read_bytes() == p.read_bytes()


HELD = [  # (tensor, index, what is planted: a byte or a value, what the message says it found)
    ("layers.1.attn.wq_a.weight", (3, 5), 0x7F, "nan at index [3, 5] in F8_E4M3 [32, 64]"),
    ("layers.1.attn.wq_a.scale", (0, 1), 0xFF, "nan at index [0, 1] in F8_E8M0 [1, 2]"),
    ("layers.0.attn.wo_b.weight", (2, 200), 0xFF, "nan at index [2, 200] in F8_E4M3 [64, 256]"),  # rank 1's columns
    ("embed.weight", (200, 3), float("inf"), "inf at index [200, 3] in BF16 [256, 64]"),  # rank 1's rows
    ("layers.0.attn.attn_sink", (5,), float("-inf"), "-inf at index [5] in F32 [8]"),
    ("layers.0.hc_attn_fn", (7, 9), float("nan"), "nan at index [7, 9] in F32 [24, 256]"),
]


@pytest.mark.parametrize(("name", "at", "planted", "found"), HELD, ids=[h[0] for h in HELD])
def test_a_nan_or_inf_the_source_holds_in_a_copied_tensor_is_refused(tmp_path, monkeypatch, capsys, name, at,
                                                                     planted, found):  # fmt: skip
    """Tensors copied unchanged (fp8 weights and scales, a dim-1 split's columns, bf16 and f32 tensors):
    before, a NaN or an infinity the source held reached the rank files, exit 0, as the decoders refuse it."""
    cfg = tiny_config()
    tensors = source_tensors(cfg)
    if isinstance(planted, int):
        tensors[name].view(torch.uint8)[at] = planted
    else:
        tensors[name][at] = planted
    src = write_ckpt(tmp_path / "src", tensors, cfg)
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2")
    assert code == 2 and f"{_file_of(src, name)}: {name}: found {found}; expected finite values in a tensor" in err
    assert "check the source tensor" in err
    assert not (out / "manifest.json").exists() and not list(out.glob("*.partial"))
    if name == "embed.weight":  # export copies it too
        code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(tmp_path / "exp"), "--format", "fp8")
        assert code == 2 and f"{_file_of(src, name)}: {name}: found {found}" in err
        assert not (tmp_path / "exp" / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("command", ["plan", "shard", "export", "reference-logits"])
@pytest.mark.parametrize("victim", ["tokenizer.json", "shard", "config.json"])
def test_a_fifo_in_the_source_is_refused_not_waited_on(tmp_path, command, victim):
    """A FIFO named as a shard or tokenizer.json: `plan` and `shard` blocked on it until killed (an audit);
    as config.json, reference-logits did (a later audit)."""
    import os
    import subprocess
    import sys

    src = write_ckpt(tmp_path / "src", source_tensors(tiny_config()), tiny_config())
    name = victim if victim == "tokenizer.json" else sorted(p.name for p in src.glob("model-*.safetensors"))[0]
    (src / name).unlink(missing_ok=True)
    os.mkfifo(src / name)
    args = {"plan": ["--tp", "2"], "shard": [str(tmp_path / "out"), "--tp", "2"],
            "export": [str(tmp_path / "out"), "--format", "bf16"],
            "reference-logits": [str(tmp_path / "out")]}[command]  # fmt: skip
    cmd = [sys.executable, "-c", "from dsv41_convert.cli import main; main()", command, str(src), *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and f"{name}: not a regular file (a FIFO" in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "where", ["SRC/config.json", "CONVERTED/config.json", "CONVERTED/manifest.json", "FILE/ref.safetensors"]
)
def test_verify_refuses_a_fifo_instead_of_waiting_on_it(tmp_path, monkeypatch, capsys, where):
    """verify --reference SRC with a FIFO as SRC's config.json waited forever, as it did on CONVERTED's
    manifest.json; CONVERTED's config.json as a FIFO was said to be "not found" (an audit); a FIFO as
    --reference-logits FILE waited in open(), where SIGTERM does not reach Python (a review)."""
    src, conv = tmp_path / "src", tmp_path / "conv"  # make-tiny's source: verify reads its tokenizer
    assert run_cli(monkeypatch, capsys, "make-tiny", str(src))[0] == 0
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")[0] == 0
    folder, name = where.split("/")
    fifo = {"SRC": src, "CONVERTED": conv, "FILE": tmp_path}[folder] / name
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    cmd = [sys.executable, "-c", "from dsv41_convert.cli import main; main()", "verify", str(conv)]
    cmd += ["--reference-logits", str(fifo)] if folder == "FILE" else ["--reference", str(src), "--decode-steps", "1"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
    assert run.returncode == 2 and f"{name}: not a regular file (a FIFO" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("command", ["plan", "shard", "export"])
def test_a_tokenizer_folder_is_refused_before_out_is_made(tmp_path, monkeypatch, capsys, command):
    """tokenizer.json a folder: shard warned "no tokenizer.json", made OUT and its run record, then failed
    copying it ("Is a directory"), and --dry-run passed (an audit): refused first, naming it."""
    src = write_ckpt(tmp_path / "src", source_tensors(tiny_config()), tiny_config())
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").mkdir()
    args = {"plan": ["--tp", "2"], "shard": [str(tmp_path / "out"), "--tp", "2"],
            "export": [str(tmp_path / "out"), "--format", "bf16"]}[command]  # fmt: skip
    code, _, err = run_cli(monkeypatch, capsys, command, str(src), *args)
    assert code == 2 and f"{src}: tokenizer.json: a folder where the tokenizer file belongs" in err, err
    assert "warning" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["shard", "export"])
@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("tokenizer.json", '{"model": ', r"not a readable tokenizer.json \(Expecting value"),  # cut short
        ("tokenizer.json", "[]", r"not a readable tokenizer.json \(a JSON list\)"),
        ("tokenizer.json", "{}", r"not a readable tokenizer.json \(no `model` object\)"),
        ("tokenizer_config.json", '{"a": 1', "not a readable tokenizer_config.json"),
    ],
)
def test_a_broken_tokenizer_file_is_refused_not_copied(tmp_path, monkeypatch, capsys, command, name, text, said):
    """shard and export copied a cut or emptied tokenizer file unchanged, exit 0 and a manifest: an output that
    looked complete, which verify and inference cannot load (an audit)."""
    import re

    src = write_ckpt(tmp_path / "src", source_tensors(tiny_config()), tiny_config())
    (src / name).write_text(text)
    args = {"shard": ["--tp", "2"], "export": ["--format", "bf16"]}[command]
    code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(tmp_path / "out"), *args)
    assert code == 2 and re.search(f"{re.escape(str(src / name))}: {said}", err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["shard", "export"])
@pytest.mark.parametrize("fault", ["truncated", "removed"])
def test_a_file_of_the_run_lost_before_its_manifest_fails_the_run(src, tmp_path, monkeypatch, capsys, command, fault):
    """A rank file (or export shard) that this run finished and that was truncated or removed before the run wrote
    its manifest (a cleanup script, a user): the run, asked for every file, exited 0 with `manifest: pending (not
    every rank is done yet)` and a fragment of the others, as a share does (a black-box hunt). Now it is an error
    naming the file (exit 2), nothing written over it, and --resume writes it again: the bytes of a clean run."""
    args = ["--tp", "2"] if command == "shard" else ["--format", "bf16"]
    clean, out = tmp_path / "clean", tmp_path / "out"
    assert run_cli(monkeypatch, capsys, command, str(src), str(clean), *args)[0] == 0
    victim = sorted(clean.glob("model*.safetensors"))[0].name
    real = execute_mod._run

    def then_lose_one(todo, src_, out_, *rest):
        results = real(todo, src_, out_, *rest)
        if fault == "truncated":
            os.truncate(out_ / victim, 1000)
        else:
            (out_ / victim).unlink()
        return results

    monkeypatch.setattr(execute_mod, "_run", then_lose_one)
    code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(out), *args)
    assert code == 2, err
    said = "1,000 bytes, not the" if fault == "truncated" else "removed"
    assert f"{out / victim} ({said}" in err and "changed after this run finished it" in err and "--resume" in err
    assert not (out / "manifest.json").exists() and not list(out.glob("manifest-fragment-*"))
    monkeypatch.setattr(execute_mod, "_run", real)
    assert run_cli(monkeypatch, capsys, command, str(src), str(out), *args, "--resume")[0] == 0
    for p in clean.iterdir():
        if p.is_file():
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name
