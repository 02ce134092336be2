"""Fault injection for `export`, as tests/integration/test_faults.py does it for `shard`: each bad input gives
a clear error naming file and tensor, exit code 2, and nothing in OUT that looks finished: no config.json,
index or manifest.json, and no shard under its final name unless it is complete (a bad value found while
writing shard k leaves shards done before it, with their done records, for --resume); SRC is never
written; kill -9 mid-run then --resume gives byte-identical output."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
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

from dsv41_convert.convert.export import build_export_plan, export
from dsv41_convert.errors import OutputError

CLI = [sys.executable, "-m", "dsv41_convert.cli"]


def assert_nothing_finished(out: Path, bad_file: str | None = None) -> None:
    """No file that says the export is complete; no shard at all, or (a fault found in the data of source
    file `bad_file`) none made from that file, and no partial file left behind."""
    if not out.exists():
        return
    for name in ("manifest.json", "config.json", "model.safetensors.index.json"):
        assert not (out / name).exists(), name
    if bad_file is None:
        assert not list(out.glob("model-*.safetensors")), list(out.iterdir())
    else:
        assert not (out / bad_file).exists()
    assert not list(out.glob("*.partial"))


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tmp_path) -> Path:
    return make_tiny(tmp_path / "src")


def test_truncated_shard(src, tmp_path, monkeypatch, capsys):
    p = src / "model-00002-of-00003.safetensors"
    os.truncate(p, p.stat().st_size - 7)
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(tmp_path / "out"), "--format", "bf16")
    assert code == 2
    assert "model-00002-of-00003.safetensors: tensor" in err and "truncated" in err
    assert_nothing_finished(tmp_path / "out")


def test_corrupt_header(src, tmp_path, monkeypatch, capsys):
    p = src / "model-00001-of-00003.safetensors"
    blob = bytearray(p.read_bytes())
    blob[8:12] = b"XXXX"
    p.write_bytes(bytes(blob))
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(tmp_path / "out"), "--format", "fp8")
    assert code == 2 and "model-00001-of-00003.safetensors: header is not valid JSON" in err
    assert_nothing_finished(tmp_path / "out")


def test_missing_tensor(tmp_path, monkeypatch, capsys):
    cfg = tiny_config()
    tensors = source_tensors(cfg)
    del tensors["layers.1.attn.wo_a.scale"]
    write_ckpt(tmp_path / "src", tensors, cfg)
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "export", str(tmp_path / "src"), str(out), "--format", "fp8")
    assert code == 2 and "layers.1.attn.wo_a.scale: missing from the checkpoint" in err
    assert_nothing_finished(tmp_path / "out")


@pytest.mark.parametrize("command", ["export", "shard"])
def test_an_unquantized_checkpoint_beside_the_published_config_is_said_so(tmp_path, monkeypatch, capsys, command):
    """A bf16 fine-tune with the published config.json copied over its own (a likely mistake) was refused as
    "its routed experts ... make 720 tensors; the checkpoint holds 360" (an audit): now the refusal says what
    is wrong, before any file is made."""
    write_ckpt(tmp_path / "src", source_tensors(tiny_config(quantized=False)), tiny_config(quantized=True))
    out = tmp_path / "out"
    args = ["--format", "fp8-fp4"] if command == "export" else ["--tp", "2"]
    code, _, err = run_cli(monkeypatch, capsys, command, str(tmp_path / "src"), str(out), *args)
    assert code == 2 and "config.json has a quantization_config (a published fp8/fp4 checkpoint), but the " \
        "checkpoint holds no scales and no fp8 or fp4 weights" in err and "routed experts" not in err, err  # fmt: skip
    assert not out.exists()
    empty = tmp_path / "empty"  # no tensor at all: the check above crashed on it (StopIteration: a review)
    write_ckpt(empty, {}, tiny_config(quantized=True), n_files=1)
    code, _, err = run_cli(monkeypatch, capsys, command, str(empty), str(tmp_path / "out2"), *args)
    assert code == 2 and "checkpoint does not match config.json" in err, err


@pytest.mark.parametrize("fmt", ["fp8", "fp8-fp4"])
@pytest.mark.parametrize("name", ["layers.2.attn.wq_a.weight", "layers.0.ffn.experts.6.w2.weight"])
def test_nan_in_a_bf16_weight_to_quantize(tmp_path, monkeypatch, capsys, fmt, name):
    cfg = tiny_config(quantized=False)
    tensors = source_tensors(cfg)
    tensors[name][5, 7] = float("nan")
    write_ckpt(tmp_path / "src", tensors, cfg)
    bad_file = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"][name]
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "export", str(tmp_path / "src"), str(out), "--format", fmt)
    assert code == 2 and f"{bad_file}: {name}: found nan at index [5, 7]" in err
    assert_nothing_finished(out, bad_file)


@pytest.mark.parametrize(
    ("fmt", "scale"),
    [("bf16", "layers.1.attn.wq_a.scale"), ("bf16", "layers.1.engram.embed.scale"),
     ("fp8", "layers.1.ffn.experts.2.w1.scale")],
)  # fmt: skip
def test_a_nan_scale_in_another_file_than_its_weight_names_the_scales_file(tmp_path, monkeypatch, capsys, fmt, scale):
    """A checkpoint saved in other groupings than the published one (write_ckpt's: a weight and its scale in two
    files) with a NaN scale byte: the decode's error named the weight's file alone ('model-00001...: wq_a.weight:
    scale is NaN'), where no scale lies; it names the scale and the file that holds it too."""
    cfg = tiny_config()
    tensors = source_tensors(cfg)
    tensors[scale].view(torch.uint8)[0, 0] = 255
    write_ckpt(tmp_path / "src", tensors, cfg)
    where = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    weight = scale.removesuffix(".scale") + ".weight"
    assert where[scale] != where[weight]  # the case at hand
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "export", str(tmp_path / "src"), str(out), "--format", fmt)
    assert code == 2, err
    held = f"(in {tmp_path / 'src' / where[scale]}: {scale})"
    assert f"{where[weight]}: {weight}: scale is NaN (e8m0 byte 255) at [0, 0] {held}; expected a power" in err, err
    assert_nothing_finished(out, where[weight])


def test_a_lossy_fp4_to_fp8_block_is_an_error_naming_the_tensor(tmp_path, monkeypatch, capsys):
    """Scales 2**20 apart in one 32x32 block: the small ones cannot be re-expressed in e4m3."""
    cfg = tiny_config()
    tensors = source_tensors(cfg)
    scale = tensors["mtp.1.ffn.experts.4.w3.scale"]
    scale.view(torch.uint8)[0, 0] = 127 + 20
    write_ckpt(tmp_path / "src", tensors, cfg)
    bad_file = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())["weight_map"]
    bad_file = bad_file["mtp.1.ffn.experts.4.w3.weight"]
    out = tmp_path / "out"
    code, _, err = run_cli(monkeypatch, capsys, "export", str(tmp_path / "src"), str(out), "--format", "fp8")
    assert code == 2 and f"{bad_file}: mtp.1.ffn.experts.4.w3.weight: fp4->fp8 cast of block (0, 0) is lossy" in err
    assert "keep the routed experts in fp4 (shard --expert-dtype fp4, the default; export --format fp8-fp4" in err
    assert_nothing_finished(out, bad_file)
    # the formats that need no cast take the same source
    code, _, _ = run_cli(monkeypatch, capsys, "export", str(tmp_path / "src"), str(tmp_path / "b"), "--format", "bf16")
    assert code == 0


def test_refuses_to_overwrite_and_never_writes_into_src(src, tmp_path, monkeypatch, capsys):
    before = tree_digest(src)
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(src / "out"), "--format", "bf16")
    assert code == 2 and "inside" in err
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(src), "--format", "bf16")
    assert code == 2 and "source folder" in err
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "bf16")
    assert code == 2 and "not empty" in err and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, _, _ = run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "bf16", "--overwrite")
    assert code == 0 and json.loads((out / "manifest.json").read_text())["options"]["format"] == "bf16"
    # an overwrite in another format: the old config.json and index are gone until the new shards are done
    code, _, _ = run_cli(monkeypatch, capsys, "export", str(src), str(out), "--format", "fp8", "--overwrite")
    assert code == 0 and json.loads((out / "config.json").read_text())["quantization_config"]["expert_dtype"] == "fp8"
    assert tree_digest(src) == before


def test_format_is_required_and_checked(src, tmp_path):
    """Through the installed entry point: a usage error is Typer's message and exit 2; nothing written."""
    res = subprocess.run([*CLI, "export", str(src), str(tmp_path / "out")], capture_output=True, text=True)
    assert res.returncode == 2 and "Missing option '--format'" in res.stderr
    res = subprocess.run([*CLI, "export", str(src), str(tmp_path / "out"), "--format", "fp4"], capture_output=True,
                         text=True)  # fmt: skip
    assert res.returncode == 2 and "error: --format 'fp4': expected one of bf16, fp8, fp8-fp4" in res.stderr
    assert not (tmp_path / "out").exists()


def test_resume_refuses_shards_of_another_format(src, tmp_path):
    export(build_export_plan(src, "bf16"), tmp_path / "out")
    before = tree_digest(tmp_path / "out")
    with pytest.raises(OutputError, match=r"model-00001-of-00003\.safetensors: finished by a run with other options"):
        export(build_export_plan(src, "fp8"), tmp_path / "out", resume=True)
    assert tree_digest(tmp_path / "out") == before
    summary = export(build_export_plan(src, "bf16"), tmp_path / "out", resume=True)
    assert len(summary["skipped"]) == 3 and not summary["written"] and summary["manifest"]


class _Stopped(Exception):
    """Raised by a progress callback: the run stops there, as a kill mid-shard would end it."""


def _stop_writing_shard_2(label: str, done: int, total: int) -> None:
    """Stop once shard 2 has bytes written (the calls before are --resume's look at the finished shards)."""
    if label == "model-00002-of-00003.safetensors" and done > 0:
        raise _Stopped(label)


def test_a_resume_stopped_before_its_shards_are_done_leaves_no_earlier_config_or_index(src, tmp_path):
    """A finished export losing a shard, then a --resume stopped while rewriting it: the earlier run's config.json
    and index must be gone with its manifest (the folder then looked finished, its index listing a shard that is
    not there); the resume run to its end writes them again."""
    out = tmp_path / "out"
    export(build_export_plan(src, "fp8"), out)
    config = (out / "config.json").read_bytes()
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(_Stopped):
        export(build_export_plan(src, "fp8"), out, resume=True, progress=_stop_writing_shard_2)
    assert_nothing_finished(out, "model-00002-of-00003.safetensors")
    summary = export(build_export_plan(src, "fp8"), out, resume=True)
    assert summary["manifest"] and len(summary["skipped"]) == 2
    assert (out / "config.json").read_bytes() == config and (out / "model.safetensors.index.json").is_file()


def test_not_enough_disk_up_front(src, tmp_path, monkeypatch):
    from dsv41_convert.convert import execute as execute_mod

    monkeypatch.setattr(execute_mod, "disk_free", lambda path: 1000)
    with pytest.raises(OutputError, match=r" bytes to write but only 1,000 bytes free"):
        export(build_export_plan(src, "bf16"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # it was made for the run, and left empty


@pytest.mark.slow
def test_disk_full_while_writing(src, tmp_path):
    """A real write error: the file-size limit makes write() fail with EFBIG mid-file, as a full disk would (said
    as the limit it is)."""
    out = tmp_path / "out"
    res = run_cli_with_file_size_limit(400_000, "export", str(src), str(out), "--format", "bf16")
    err = " ".join(res.stderr.split())
    assert res.returncode == 2, res.stderr
    # with several workers, whichever file first outgrows the limit is the one named
    limit = "larger than the file system or the file-size limit \\(ulimit -f\\) allows"
    named = re.search(rf"(model-0000\d-of-00003\.safetensors): {limit} while writing tensor", err)
    assert named, err
    assert build_export_plan(src, "bf16").plan.files[int(named[1][6:11]) - 1].nbytes > 400_000
    assert_nothing_finished(out)
    assert not run_records(out)


@pytest.mark.slow
@pytest.mark.parametrize(("io", "partial_bytes"), [("--direct-io", -1), ("--buffered-io", 20_000)])
def test_kill_9_then_resume_is_byte_identical(src, tmp_path, io, partial_bytes):
    """kill -9 with one shard done and another partly written, then --resume: the same bytes as a clean run.
    With O_DIRECT (the default) the partial file shows no bytes before its end here (one staging piece)."""
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    args = ["--format", "bf16", "--json", io]
    subprocess.run([*CLI, "export", str(src), str(clean), *args], check=True, capture_output=True)
    env = {**os.environ, "DSV41_CONVERT_TEST_THROTTLE_S": "0.01"}
    proc = subprocess.Popen([*CLI, "export", str(src), str(killed), *args], env=env, process_group=0,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    kill_9_with_a_done_file_and_a_partial(proc, killed, partial_bytes)
    assert proc.returncode == -signal.SIGKILL
    for name in ("manifest.json", "config.json", "model.safetensors.index.json"):
        assert not (killed / name).exists(), name
    finished = done_records(killed)  # a file killed between its rename and its record is rewritten
    assert 1 <= len(finished) < 3 and list(killed.glob("*.partial"))
    assert finished <= {p.name for p in killed.glob("model-*.safetensors")}
    res = subprocess.run([*CLI, "export", str(src), str(killed), "--resume", *args],
                         check=True, capture_output=True, text=True)  # fmt: skip
    summary = json.loads(res.stdout)
    # every file finished before the kill is skipped; so may be one its workers finished after it (they die
    # a moment later; the resume waits for them: die_with.py); every other file is written again
    skipped, written = set(summary["skipped"]), set(summary["written"])
    assert finished <= skipped and not skipped & written and len(skipped | written) == 3 and summary["manifest"]
    assert not list(killed.glob("*.partial"))
    for p in sorted(clean.iterdir()):
        if p.is_file():
            assert (killed / p.name).read_bytes() == p.read_bytes(), p.name


@pytest.mark.parametrize(
    ("key", "value", "refused", "kept"),
    [
        # an fp8-fp4 export wrote expert scales [out, 2] the published layout calls [out, 1]: a checkpoint plan,
        # shard and export then refused (an audit); fp8 experts need 32x32 blocks
        ("moe_intermediate_size", 48, [["export", "--format", "fp8-fp4"], ["export", "--format", "fp8"],
                                       ["shard", "--tp", "1"], ["shard", "--tp", "1", "--expert-dtype", "fp8"]],
         [["export", "--format", "bf16"]]),
        # Engram's per-32 rows: quantizing a table of head dim 48 makes no published table
        ("engram_head_dim", 48, [["export", "--format", "fp8-fp4"], ["export", "--format", "fp8"],
                                 ["shard", "--tp", "1"]], [["export", "--format", "bf16"]]),
    ],
)  # fmt: skip
def test_dims_the_output_blocks_cannot_tile_are_refused_naming_the_config(tmp_path, monkeypatch, capsys, key, value,
                                                                         refused, kept):  # fmt: skip
    cfg = tiny_config(quantized=False, vision=False)
    cfg["text_config"][key] = value
    src = write_ckpt(tmp_path / "src", source_tensors(cfg), cfg)
    for k, (command, *options) in enumerate(refused):
        out = tmp_path / f"out{k}"
        code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(out), *options)
        assert code == 2 and f"{src / 'config.json'}: not a multiple of 32: {key} {value} (" in err, (options, err)
        assert not out.exists()
    for command, *options in kept:  # nothing is quantized: any dims
        code, _, err = run_cli(monkeypatch, capsys, command, str(src), str(tmp_path / "kept"), *options)
        assert code == 0, err


@pytest.mark.parametrize("key", ["engram_head_dim", "moe_intermediate_size"])
def test_a_published_source_whose_scales_cannot_tile_its_dims_is_refused_before_any_byte(
    tmp_path, monkeypatch, capsys, key
):
    """A published-format (fp8/fp4) source with a dim of 48 where its per-32 scales need a multiple of 32, laid out
    as `published_layout` has it: decoding it to bf16 cannot work, so `export --format bf16` must refuse it as an
    input problem (exit 2, naming the key or the tensor) before OUT is made, as it does for a bf16 source whose
    export would quantize such dims (an audit: plan took its floored scales, and the export died mid-write with
    a ValueError traceback). plan and shard refuse it as well."""
    cfg = tiny_config(vision=False)
    cfg["text_config"][key] = 48
    src = write_ckpt(tmp_path / "src", source_tensors(cfg), cfg)
    code, _, err = run_cli(monkeypatch, capsys, "export", str(src), str(tmp_path / "out"), "--format", "bf16")
    assert code == 2 and f"{key} 48" in err and "not a multiple of 32" in err and "config.json" in err, err
    assert not (tmp_path / "out").exists()
    for command in (["plan", str(src), "--tp", "2"], ["shard", str(src), str(tmp_path / "mp2"), "--tp", "2"]):
        code, _, err = run_cli(monkeypatch, capsys, *command)
        assert code == 2 and f"{key} 48" in err, (command, err)
    assert not (tmp_path / "mp2").exists()


def test_a_config_a_framework_saved_again_converts_the_same_and_unknown_keys_are_refused(
    src, tmp_path, monkeypatch, capsys
):
    """A fine-tune's config.json re-saved by transformers carries its bookkeeping (its version, the dtype in every
    sub-config, use_cache, the token ids, the run's name): refused before as "unknown keys ... add them to
    dsv41_convert/config.py" (an audit). The weights mean the same: the export's shards are byte-identical. A key
    that may change their meaning is still refused, and the message no longer sends a user into the source."""
    resaved = tmp_path / "resaved"
    resaved.mkdir()
    for p in src.iterdir():
        (resaved / p.name).write_bytes(p.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config.update(_name_or_path="/ckpt/ft-7", use_cache=False, tie_word_embeddings=False, transformers_version="5.1")
    config["text_config"].update(torch_dtype="bfloat16", pad_token_id=1, output_router_logits=False,
                                 router_aux_loss_coef=0.001, _attn_implementation_autoset=True)  # fmt: skip
    config["vision_config"]["torch_dtype"] = "bfloat16"
    (resaved / "config.json").write_text(json.dumps(config, indent=2))
    for folder in (src, resaved):
        code, _, err = run_cli(monkeypatch, capsys, "export", str(folder), str(tmp_path / f"{folder.name}-out"),
                               "--format", "fp8")  # fmt: skip
        assert code == 0, err
    shards = sorted(p.name for p in (tmp_path / "src-out").glob("*.safetensors"))
    assert shards and all(
        (tmp_path / "src-out" / n).read_bytes() == (tmp_path / "resaved-out" / n).read_bytes() for n in shards
    )
    meaningful = (("text_config", "rope_parameters", {"rope_type": "yarn"}), (None, "tie_word_embeddings", True))
    for where, key, value in meaningful:
        edited = json.loads(json.dumps(config))
        (edited[where] if where else edited)[key] = value
        (resaved / "config.json").write_text(json.dumps(edited))
        code, _, err = run_cli(monkeypatch, capsys, "export", str(resaved), str(tmp_path / "no"), "--format", "fp8")
        flat = " ".join(err.split())
        assert code == 2 and key in flat and "config.json" in flat and "dsv41_convert/config.py" not in flat, err
    assert not (tmp_path / "no").exists()


def test_a_config_with_non_ascii_text_is_written_as_the_source_writes_it(src, tmp_path):
    """config.json is the source's, as UTF-8 text (as transformers and the published repository write it): an
    fp8-fp4 export of a source whose config names its run in non-ASCII text gives back the source's bytes; with
    ASCII escapes the copy's config.json differed from its source's."""
    config = json.loads((src / "config.json").read_text())
    config["_name_or_path"] = "/ckpt/réglage-fin-ü"
    (src / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    export(build_export_plan(src, "fp8-fp4"), tmp_path / "out")
    assert (tmp_path / "out" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_an_f32_fine_tune_exports_to_bf16_as_the_bf16_checkpoint_does(tmp_path, monkeypatch, capsys):
    """A fine-tune saved in float32: `export --format bf16` kept every F32 tensor F32 (twice the bytes, under a
    config saying bfloat16; an audit). Its tensors now go out in the dtype the bf16 format gives them, the
    published one for float tensors (F32 where published) and BF16 for the weights it quantizes: with
    bf16-exact values, the same bytes as the bf16 checkpoint's export, config.json included (it said float32
    over BF16 weights: a review), and the MTP stages' tied embed/head a fine-tune saved (copied F32 before)."""
    cfg = tiny_config(quantized=False, vision=False)
    cfg["text_config"]["torch_dtype"] = "bfloat16"  # as transformers saves a sub-config
    tensors = source_tensors(cfg)
    tensors |= {"mtp.0.embed.weight": tensors["embed.weight"].clone(), "mtp.0.head.weight": tensors["head.weight"]}
    bf16 = write_ckpt(tmp_path / "bf16", tensors, cfg)
    cfg32 = json.loads(json.dumps(cfg))
    cfg32["dtype"] = cfg32["text_config"]["torch_dtype"] = "float32"
    f32 = write_ckpt(tmp_path / "f32", {n: t.float() for n, t in tensors.items()}, cfg32)
    for folder in (bf16, f32):
        code, _, err = run_cli(monkeypatch, capsys, "export", str(folder), str(tmp_path / f"{folder.name}-out"),
                               "--format", "bf16")  # fmt: skip
        assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "bf16-out").glob("*.safetensors"))
    assert names == sorted(p.name for p in (tmp_path / "f32-out").glob("*.safetensors"))
    for name in [*names, "config.json"]:
        assert (tmp_path / "bf16-out" / name).read_bytes() == (tmp_path / "f32-out" / name).read_bytes(), name
    assert json.loads((tmp_path / "f32-out" / "config.json").read_text())["text_config"]["torch_dtype"] == "bfloat16"
    from safetensors import safe_open

    dtypes = set()
    for name in names:
        with safe_open(str(tmp_path / "f32-out" / name), "pt") as f:
            dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16", "F32"}  # the published F32 ones (hc_*, attn_sink, gate biases) stay F32


@pytest.mark.parametrize("command", [["shard", "--tp", "2"], ["export", "--format", "fp8-fp4"], ["plan", "--tp", "2"]])
def test_a_tokenizer_the_engram_layers_were_not_trained_with_is_refused_before_any_byte(
    src, tmp_path, monkeypatch, capsys, command
):
    """A fine-tune that added a token to the tokenizer: its compressed Engram token map has another size than the
    config's engram_compressed_vocab_size, so the Engram hashes of the converted model read other rows. shard and
    export copied it beside the weights (exit 0, a manifest) and only verify or inference refused them (an
    audit); plan refuses it now, naming the file, before any byte."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|tool_call|>"])
    tokenizer.save(str(src / "tokenizer.json"))
    name, *options = command
    out = [str(tmp_path / "out")] if name != "plan" else []
    code, _, err = run_cli(monkeypatch, capsys, name, str(src), *out, *options)
    flat = " ".join(err.split())
    assert code == 2 and f"{src / 'tokenizer.json'}: its compressed Engram token map has" in flat, err
    assert "does not belong to this checkpoint" in flat
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda c: c["text_config"].update(topk_method="greedy"), "topk_method = 'greedy', this model supports only"),
        (lambda c: c["text_config"].update(topk_method=None), None),  # null: transformers' default, noaux_tc
        (lambda c: c["text_config"].update(engram_pad_token_id=600), "engram_pad_token_id = 600, not a token id"),
        (
            lambda c: c["text_config"].update(rope_parameters=c["text_config"].pop("rope_scaling")),
            "rope_parameters: transformers 5's form of rope_scaling and rope_theta",
        ),
    ],
    ids=["greedy routing", "null routing", "pad id past the vocabulary", "transformers 5 rope"],
)
def test_config_values_that_change_the_model_are_refused_naming_the_key(src, monkeypatch, capsys, edit, said):
    """An audit of the fine-tune round trip: `topk_method: greedy` (routing without the gate bias) was taken
    for the model this tool runs; an engram_pad_token_id past the vocabulary was blamed on tokenizer.json; the
    transformers 5 rope_parameters was "an unknown key" whose removal then failed on rope_scaling."""
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(src), "--tp", "2")
    if said is None:
        assert code == 0, err
        return
    assert code == 2 and said in " ".join(err.split()) and "config.json" in err, err


def test_an_f16_source_is_refused_as_a_dtype_the_model_never_holds(tmp_path, monkeypatch, capsys):
    cfg = tiny_config(quantized=False, vision=False)
    tensors = source_tensors(cfg)
    tensors["layers.0.attn.wq_a.weight"] = tensors["layers.0.attn.wq_a.weight"].half()
    tensors["mtp.0.embed.weight"] = tensors["embed.weight"].half()  # tied, dropped by shard: passed unlooked at
    write_ckpt(tmp_path / "f16", tensors, cfg)
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(tmp_path / "f16"), "--tp", "2")
    for name in ("layers.0.attn.wq_a.weight", "mtp.0.embed.weight"):
        assert code == 2 and f"{name}: F16, which this model's checkpoints never hold" in err, err
    tensors = source_tensors(cfg)
    tensors["mtp.0.head.weight"] = tensors["head.weight"].to(torch.float8_e4m3fn)  # no float of this model either
    write_ckpt(tmp_path / "fp8-head", tensors, cfg)
    code, _, err = run_cli(monkeypatch, capsys, "plan", str(tmp_path / "fp8-head"), "--tp", "2")
    assert code == 2 and "mtp.0.head.weight: found F8_E4M3, expected BF16 or F32 (a tied MTP embed/head)" in err, err


@pytest.mark.parametrize("quantized", [True, False], ids=["published format", "bf16"])
@pytest.mark.parametrize(
    ("name", "tied", "said"),
    [
        ("mtp.0.head.weight", lambda t: t.half(), "mtp.0.head.weight: F16, which this model's checkpoints never hold"),
        ("mtp.0.embed.weight", lambda t: t.to(torch.float8_e4m3fn), "found F8_E4M3, expected BF16 or F32"),
        ("mtp.1.head.weight", lambda t: t[:-8], "mtp.1.head.weight: found [248, 64], expected [256, 64]"),
        ("mtp.7.embed.weight", lambda t: t, "mtp.7.embed.weight: a DSpark stage config.json does not have (extra)"),
    ],
    ids=["f16", "fp8", "shape", "stage"],
)
def test_a_tied_mtp_embed_or_head_that_cannot_be_the_backbones_is_refused(
    tmp_path, monkeypatch, capsys, quantized, name, tied, said
):
    """mtp.K.embed / head, a copy of the backbone's embed / head that shard drops and export carries: of a
    published-format source, plan and shard passed one in F16 or fp8 (exit 0; export then failed mid-run, "drop
    tensor stored as F16: export has no rule for it"), as only a bf16 source's dtypes were checked; and of either,
    one of another shape (a resized vocabulary the copies missed) or of a stage the model does not have was
    carried by export into a checkpoint that is no longer the model's layout. Refused before any byte now."""
    cfg = tiny_config(quantized=quantized, vision=False)
    tensors = source_tensors(cfg)
    backbone = tensors[name.split(".")[2] + ".weight"]  # embed.weight or head.weight
    write_ckpt(tmp_path / "src", tensors | {name: tied(backbone).clone()}, cfg)
    src = str(tmp_path / "src")
    for command in (["plan", src, "--tp", "2"], ["shard", src, str(tmp_path / "mp")]):
        code, _, err = run_cli(monkeypatch, capsys, *command)
        assert code == 2 and said in " ".join(err.split()) and ".safetensors: tensor " + name in err, err
    assert not (tmp_path / "mp").exists()
