"""make-tiny end to end: the written checkpoint against the published layout rules, the config,
the tokenizer, the fp8 <-> bf16 round trip, determinism and the command line."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import math
import os
import re
import shutil
import stat
import struct
import sys
from pathlib import Path

import pytest
import torch
from reference_data import CATALOG
from safetensors.torch import load_file
from tokenizers import Tokenizer
from typer.testing import CliRunner

from dsv41_convert.cli import app, main
from dsv41_convert.config import load_model_args
from dsv41_convert.convert.catalogue import Fmt, catalogue, file_tensors
from dsv41_convert.engram_tokens import compressed_token_map
from dsv41_convert.errors import OutputError
from dsv41_convert.quant import encode_fp8_blocks, encode_mxfp4
from dsv41_convert.quant.fp4 import as_int8
from dsv41_convert.synth.presets import TINY, hf_config
from dsv41_convert.synth.staged import INDEX, MARK
from dsv41_convert.synth.weights import decode_file_tensors
from dsv41_convert.synth.write import write_checkpoint

_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


def _headers(folder: Path) -> dict[str, dict[str, dict]]:
    """file -> {tensor: {dtype, shape, data_offsets}}, read straight from the safetensors headers."""
    out = {}
    for path in sorted(folder.glob("model-*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        assert "__metadata__" not in header
        out[path.name] = header
    return out


def _load_all(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("model-*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _sha(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_fp8")
    write_checkpoint(out, TINY, seed=0)
    return out


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_bf16")
    write_checkpoint(out, TINY, seed=0, quantized=False)
    return out


def test_file_set_and_index(fp8_dir):
    shards = [f"model-{i:05d}-of-00014.safetensors" for i in range(1, 15)]
    assert sorted(p.name for p in fp8_dir.iterdir()) == sorted(
        ["config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", MARK, *shards]
    )
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())
    headers = _headers(fp8_dir)
    union = {name: file for file, h in headers.items() for name in h}
    assert sum(len(h) for h in headers.values()) == len(union)  # no name in two files
    assert index["weight_map"] == union
    data = sum(math.prod(t["shape"]) * _BYTES[t["dtype"]] for h in headers.values() for t in h.values())
    assert index["metadata"]["total_size"] == data
    for file, h in headers.items():  # tensors tile the data area exactly
        end = max(t["data_offsets"][1] for t in h.values())
        header_len = struct.unpack("<Q", (fp8_dir / file).read_bytes()[:8])[0]
        assert (fp8_dir / file).stat().st_size == 8 + header_len + end


def test_index_lists_the_tensors_in_name_order(fp8_dir):
    """The published index lists weight_map by tensor name (as json.dumps of a sorted dict writes it), not by
    file: make-tiny's follows, so its index bytes are the published shape (written in file order, the names of
    each shard came in a run of their own)."""
    weight_map = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert list(weight_map) == sorted(weight_map)
    assert len({weight_map[n] for n in weight_map}) == 14  # every shard is there, so order had files to mix


def test_published_shard_grouping(fp8_dir):
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    by_file: dict[str, set[str]] = {}
    for name, file in index.items():
        by_file.setdefault(file, set()).add(name)
    files = [by_file[f] for f in sorted(by_file)]
    assert all(n.startswith(("vision.", "aligner.")) for n in files[0])
    assert files[1] == {"embed.weight", "image_start", "image_end", "image_newline"}
    for i in range(6):
        assert {n.split(".")[1] for n in files[2 + i]} == {str(i)} and not [n for n in files[2 + i] if ".engram." in n]
    assert files[8] == {"head.weight", "norm.weight"}
    for k in range(3):
        assert all(n.startswith(f"mtp.{k}.") for n in files[9 + k])
    assert all(n.startswith("layers.0.engram.") for n in files[12]) and len(files[12]) == 6
    assert all(n.startswith("layers.1.engram.") for n in files[13]) and len(files[13]) == 6


def test_shards_are_save_files_bytes_but_the_engram_tables_in_module_order(fp8_dir):
    from safetensors.torch import save

    engram = 0
    for path in sorted(fp8_dir.glob("model-*.safetensors")):
        names = list(_headers(fp8_dir)[path.name])
        if ".engram." not in names[0]:
            assert save(load_file(path)) == path.read_bytes(), path.name
            continue
        engram += 1
        pre = names[0].rsplit(".engram.", 1)[0] + ".engram."
        parts = ["embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight", "k_weight"]
        assert names == [pre + p for p in parts], path.name  # the table first: the published sizes need it
        offsets = [_headers(fp8_dir)[path.name][n]["data_offsets"] for n in names]
        assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(offsets))
    assert engram == 2


def test_names_and_dtypes_follow_the_published_catalog(fp8_dir):
    published: dict[str, str] = {}
    for row in json.loads(CATALOG.read_text()):
        published[row["pattern"]] = row["dtype"]
    found: dict[str, str] = {}
    for h in _headers(fp8_dir).values():
        for name, t in h.items():
            pattern = re.sub(r"\.\d+(?=\.|$)", ".{}", name)
            assert published.get(pattern) == t["dtype"], (name, t["dtype"], published.get(pattern))
            found[pattern] = t["dtype"]
    # tiny enables every feature, so every published pattern occurs and nothing else
    assert set(found) == set(published)


def test_shape_relations(fp8_dir):
    a = load_model_args(fp8_dir / "config.json")
    t = {n: (h["dtype"], h["shape"]) for hd in _headers(fp8_dir).values() for n, h in hd.items()}
    for name, (dtype, shape) in t.items():
        if not name.endswith(".scale"):
            continue
        wdtype, wshape = t[name.removesuffix("scale") + "weight"]
        assert dtype == "F8_E8M0", name
        if wdtype == "I8":  # packed e2m1: [out, in/2], scale per 32 of the logical in
            assert shape == [wshape[0], 2 * wshape[1] // 32], name
        elif ".engram.embed." in name:
            assert shape == [wshape[0], wshape[1] // 32], name
        else:
            assert wdtype == "F8_E4M3" and shape == [math.ceil(wshape[0] / 32), math.ceil(wshape[1] / 32)], name
    assert t["layers.0.ffn.experts.15.w1.weight"] == ("I8", [a.moe_inter_dim, a.dim // 2])
    assert t["mtp.0.ffn.experts.7.w2.weight"] == ("I8", [a.dim, a.moe_inter_dim // 2])
    assert "mtp.0.ffn.experts.8.w1.weight" not in t and "layers.0.ffn.experts.16.w1.weight" not in t
    for i, layer in enumerate(a.engram_layer_ids):
        assert t[f"layers.{layer}.engram.embed.weight"] == ("F8_E4M3", [a.engram_num_embeddings[i], a.engram_head_dim])
    assert t["layers.3.attn.wo_a.weight"] == ("F8_E4M3", [a.o_groups * a.o_lora_rank, a.n_heads * a.head_dim // 8])
    assert t["layers.1.attn.compressor.wgate.weight"][0] == "BF16" and "layers.3.attn.compressor.wgate.weight" not in t
    assert "layers.5.attn.indexer.wk.weight" not in t and "layers.5.attn.indexer.wq_b.weight" in t
    assert t["mtp.2.confidence_head.proj.weight"] == ("BF16", [1, a.dim + a.dspark_markov_rank])
    # every header tensor is exactly what the catalogue plans
    planned = {f.name: (f.dtype, list(f.shape)) for p in catalogue(a) for f in file_tensors(p, True)}
    assert planned == t


def test_config_and_tokenizer(fp8_dir):
    config = json.loads((fp8_dir / "config.json").read_text())
    a = load_model_args(fp8_dir / "config.json")
    tok = Tokenizer.from_file(str(fp8_dir / "tokenizer.json"))
    _, size = compressed_token_map(tok)
    assert size == a.engram_compressed_vocab_size
    assert config == hf_config(TINY, compressed_vocab_size=size)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    assert a.dtype == "fp8" and a.expert_dtype == "fp4" and a.vision_enabled
    text = "The indexer picks 8 of 32 compressed positions; ünïcode too."
    assert tok.decode(tok.encode(text).ids) == text
    tc = json.loads((fp8_dir / "tokenizer_config.json").read_text())
    assert tok.token_to_id(tc["bos_token"]["content"]) == 0 and tok.token_to_id(tc["eos_token"]["content"]) == 1


def test_bf16_is_the_same_model(fp8_dir, bf16_dir):
    """bf16 values == decoded fp8/fp4 values, bit for bit; and quantizing them gives the fp8 bytes."""
    a = load_model_args(fp8_dir / "config.json")
    assert load_model_args(bf16_dir / "config.json").dtype == "bf16"
    q8, b16 = _load_all(fp8_dir), _load_all(bf16_dir)
    assert set(b16) == {n for n in q8 if not n.endswith(".scale")}
    experts: dict[int, list[str]] = {}
    for p in catalogue(a):
        bf = b16[p.name if p.fmt in (Fmt.BF16, Fmt.F32) else f"{p.name}.weight"]
        dec = decode_file_tensors(p, q8)
        assert bf.dtype == dec.dtype and torch.equal(bf.view(torch.uint8), dec.view(torch.uint8)), p.name
        if p.fmt is Fmt.FP4:  # re-encoded below, stacked by in-features (scales are per row)
            experts.setdefault(bf.size(1), []).append(p.name)
        elif p.fmt in (Fmt.FP8, Fmt.FP8_ROWS):
            q, s = encode_fp8_blocks(bf, block=(32, 32) if p.fmt is Fmt.FP8 else (1, 32), name=p.name)
            assert torch.equal(q.view(torch.uint8), q8[f"{p.name}.weight"].view(torch.uint8)), p.name
            assert torch.equal(s.view(torch.uint8), q8[f"{p.name}.scale"].view(torch.uint8)), p.name
    assert sum(len(v) for v in experts.values()) == 3 * (6 * 16 + 3 * 8)
    for names in experts.values():
        packed, s = encode_mxfp4(torch.cat([b16[f"{n}.weight"] for n in names]))
        assert torch.equal(as_int8(packed), torch.cat([q8[f"{n}.weight"] for n in names]))
        assert torch.equal(s.view(torch.uint8), torch.cat([q8[f"{n}.scale"] for n in names]).view(torch.uint8))


def test_values_are_model_like(fp8_dir):
    q8 = _load_all(fp8_dir)
    assert all(torch.isfinite(t.float()).all() for n, t in q8.items() if t.dtype != torch.int8)
    scales = torch.cat([t.view(torch.uint8).flatten() for n, t in q8.items() if n.endswith(".scale")])
    assert len(torch.unique(scales)) >= 6  # several exponents, not one scale everywhere
    # norms follow the released checkpoint's means (tensors.NORM_MEAN), 10% spread
    for name, mean in (("layers.2.attn_norm", 0.025), ("layers.2.attn.q_norm", 0.97), ("norm", 1.0)):
        w = q8[f"{name}.weight"].float()
        assert abs(w.mean().item() / mean - 1) < 0.05 and 0.05 < w.std().item() / mean < 0.15, name
    assert q8["layers.0.hc_attn_fn"].abs().max().item() < 0.1
    assert q8["layers.0.ffn.gate.bias"].abs().max().item() < 0.1
    # quantized projections decode to their Init std, times ~1.32 (rms of 2**k, k in {-1, 0, 1}) when jittered
    a = load_model_args(fp8_dir / "config.json")
    for key, lo, hi in (("experts", 1.2, 1.45), ("shared_experts", 1.2, 1.45), ("engram.embed", 0.95, 1.05)):
        ps = [p for p in catalogue(a) if key in p.name and p.fmt in (Fmt.FP8, Fmt.FP4, Fmt.FP8_ROWS)]
        rel = torch.cat([(decode_file_tensors(p, q8).float() / p.init.std).flatten() for p in ps])
        assert abs(rel.mean().item()) < 0.01 and lo < rel.std().item() < hi, (key, rel.std().item())


@pytest.mark.slow
def test_deterministic_bytes_and_layout_independent_values(fp8_dir, tmp_path):
    again = tmp_path / "again"
    write_checkpoint(again, TINY, seed=0)
    assert _sha(again) == _sha(fp8_dir)
    other = tmp_path / "seed1"
    write_checkpoint(other, TINY, seed=1, vision=False, layer_shards=2)
    assert len(list(other.glob("model-*.safetensors"))) == 9
    a, b = _load_all(fp8_dir), _load_all(other)
    assert not [n for n in b if n.startswith(("vision.", "aligner.", "image_")) or n.endswith("bias_vl")]
    assert not torch.equal(
        a["layers.0.attn.wq_a.weight"].view(torch.uint8), b["layers.0.attn.wq_a.weight"].view(torch.uint8)
    )
    same = tmp_path / "seed0_2shards"
    write_checkpoint(same, TINY, seed=0, layer_shards=2)
    c = _load_all(same)
    assert c.keys() == a.keys()
    assert all(torch.equal(a[n].view(torch.uint8), c[n].view(torch.uint8)) for n in a)


def test_refuses_non_empty_out(fp8_dir, tmp_path):
    with pytest.raises(OutputError, match="not empty"):
        write_checkpoint(fp8_dir, TINY)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"notes\.txt"):
        write_checkpoint(tmp_path, TINY, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("kind", ["foreign", "unmarked"])
def test_without_overwrite_the_advice_is_one_overwrite_takes(fp8_dir, tmp_path, kind):
    """A folder holding a user's file, or a copy of real shards (no mark), was refused "not empty; pass
    --overwrite to replace a checkpoint there", and --overwrite then refused it too: without --overwrite the
    refusal is the one --overwrite would give, and "pass --overwrite" is said only where it works."""
    out = tmp_path / "out"
    if kind == "foreign":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    else:
        shutil.copytree(fp8_dir, out)
        (out / MARK).unlink()
    before = _listing(out)
    with pytest.raises(OutputError) as without:
        write_checkpoint(out, TINY, seed=1)
    with pytest.raises(OutputError) as with_it:
        write_checkpoint(out, TINY, seed=1, overwrite=True)
    assert "pass --overwrite" not in str(without.value)
    assert str(without.value) == str(with_it.value)
    assert _listing(out) == before
    made = tmp_path / "made"  # make-tiny's own checkpoint: --overwrite is advised, and replaces it
    shutil.copytree(fp8_dir, made)
    with pytest.raises(OutputError, match="not empty; pass --overwrite"):
        write_checkpoint(made, TINY, seed=1)
    write_checkpoint(made, TINY, seed=1, overwrite=True)


def test_overwrite_that_fails_moving_in_says_the_old_checkpoint_is_gone(tmp_path, monkeypatch):
    """A rename that fails (EIO) while the new shards move in, after the old index and shards went: the error
    was the rename's alone (an audit), OUT holding part of a checkpoint. Now it says so and how to mend it."""
    out = tmp_path / "tw"
    write_checkpoint(out, TINY)
    real = os.replace

    def replace(a, b):
        if Path(b).parent == out and Path(b).name.startswith("model-00005"):  # moving in, not the stage's own
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(a), None, str(b))
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputError) as info:
        write_checkpoint(out, TINY, seed=1, overwrite=True)
    said = str(info.value)
    assert said.startswith(f"{out}: moving the new checkpoint in failed at model-00005") and "Input/output" in said
    assert f"{out} holds no whole checkpoint; run make-tiny again with --overwrite" in said
    monkeypatch.setattr(os, "replace", real)
    write_checkpoint(out, TINY, seed=1, overwrite=True)  # as it says
    assert (out / INDEX).is_file()
    # a first run into a new folder had no old checkpoint to lose, and the folder goes again (a review)
    new = tmp_path / "new"
    out = new
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OutputError) as info:
        write_checkpoint(new, TINY)
    assert str(info.value).endswith(f"(Input/output error); {new} is removed again: run make-tiny again")
    assert not new.exists()


def test_cli_json_summary(tmp_path):
    out = tmp_path / "cli"
    result = CliRunner().invoke(app, ["make-tiny", str(out), "--no-vision", "--shards", "1", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["source_dtype"] == "fp8" and summary["vision"] is False
    assert [f["file"] for f in summary["files"]] == [f"model-{i:05d}-of-00008.safetensors" for i in range(1, 9)]
    assert sum(f["tensors"] for f in summary["files"]) == summary["n_tensors"]


def test_cli_errors_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "x").write_text("")
    for extra, message in ([[], "does not write (x)"], [["--overwrite", "--shards", "7"], "--shards 7"]):
        monkeypatch.setattr(sys, "argv", ["dsv41-convert", "make-tiny", str(tmp_path), *extra])
        with pytest.raises(SystemExit) as exc:
            main()
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert (tmp_path / "x").exists()


def _listing(folder):
    return {p.name: p.read_bytes() if p.is_file() else None for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    "plant",
    [
        lambda out: (out / "zz.partial").mkdir(),  # a folder with a name the old check took for ours
        lambda out: (out / "model-00001-of-00014.safetensors.d").mkdir(),
        lambda out: (out / "model-notes.safetensors.txt").write_text("mine"),  # "model-" ... ".safetensors" in it
        lambda out: (out / "tokenizer.json.bak").write_text("mine"),
        lambda out: (out / "model-00099-of-00099.safetensors.sha256").write_text("mine"),
        lambda out: (out / "config.json").unlink() or (out / "config.json").symlink_to(out / "tokenizer.json"),
    ],
)
def test_overwrite_touches_nothing_of_a_folder_with_foreign_entries(fp8_dir, tmp_path, plant):
    """--overwrite judged entries by a loose name test and deleted them one by one: a folder named zz.partial
    made it fail half-way through a checkpoint it had partly deleted; a user's model-notes.safetensors.txt
    was deleted (an audit). Every entry must now be a regular file of a name make-tiny writes, checked before
    anything is touched."""
    out = tmp_path / "out"
    shutil.copytree(fp8_dir, out, symlinks=True)
    plant(out)
    before = _listing(out)
    with pytest.raises(OutputError, match="holds what make-tiny does not write"):
        write_checkpoint(out, TINY, seed=1, overwrite=True)
    assert _listing(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_overwrite_replaces_only_a_folder_make_tiny_marked(fp8_dir, tmp_path):
    """A folder of files with make-tiny's exact names that make-tiny did not write (a copy of the real
    shards, which are named so) was replaced by `make-tiny OUT --overwrite`: now the mark make-tiny leaves
    decides, and without it nothing is touched."""
    out = tmp_path / "copy"
    shutil.copytree(fp8_dir, out)
    (out / MARK).unlink()
    before = _listing(out)
    with pytest.raises(OutputError, match=rf"{out}: no {MARK}, so not a checkpoint make-tiny wrote"):
        write_checkpoint(out, TINY, seed=1, overwrite=True)
    assert _listing(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["copy"]
    (out / MARK).symlink_to(fp8_dir / MARK)  # a link is no mark
    with pytest.raises(OutputError, match="holds what make-tiny does not write"):
        write_checkpoint(out, TINY, seed=1, overwrite=True)
    (out / MARK).unlink()
    (out / MARK).write_text("")
    write_checkpoint(out, TINY, seed=1, overwrite=True)
    assert (out / MARK).read_text().startswith("written by `dsv41-convert make-tiny`")


def test_a_failed_write_leaves_out_as_it_was(fp8_dir, tmp_path, monkeypatch):
    """A full disk in the middle of the shards left config, tokenizer files and some shards (with --overwrite
    after deleting the old checkpoint), and an error naming no file (an audit): the checkpoint is staged beside
    OUT's hidden folder, removed on failure, OUT untouched (a folder the run made is removed), and the error
    names OUT."""
    from dsv41_convert.synth import write as synth_write

    real, written = synth_write.write_shard, []

    def full_disk(out, shard, *args, **kw):
        if len(written) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(shard.file)
        return real(out, shard, *args, **kw)

    monkeypatch.setattr(synth_write, "write_shard", full_disk)
    old = tmp_path / "old"
    shutil.copytree(fp8_dir, old)
    before = _listing(old)
    for out, overwrite in ((tmp_path / "new", False), (old, True)):
        written.clear()
        with pytest.raises(OutputError, match=rf"{out}: No space left on device while writing the checkpoint"):
            write_checkpoint(out, TINY, seed=1, overwrite=overwrite)
    assert _listing(old) == before and sorted(p.name for p in tmp_path.iterdir()) == ["old"]


def test_a_failed_write_removes_the_folders_it_made_above_out(tmp_path, monkeypatch):
    """`make-tiny new/a/out` makes `new` and `new/a` too (mkdir -p); a run that failed (a full disk, Ctrl-C,
    SIGTERM) removed `out` but left the empty `new/a` it had made (found by a bug hunt). The README promises
    that a folder the run made is removed: every one of them goes, and a folder above OUT that was there
    before stays, as does one that something else put a file in meanwhile."""
    from dsv41_convert.synth import write as synth_write

    def full_disk(out, shard, *args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(synth_write, "write_shard", full_disk)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(OutputError, match="No space left on device"):
        write_checkpoint(tmp_path / "new" / "a" / "out", TINY, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # neither new/a/out nor new/a nor new

    (tmp_path / "there").mkdir()
    with pytest.raises(OutputError, match="No space left on device"):
        write_checkpoint(tmp_path / "there" / "b" / "out", TINY, seed=1)
    assert sorted(p.name for p in (tmp_path / "there").iterdir()) == []  # kept, and empty again

    def full_disk_after_a_note(out, shard, *args, **kw):
        (tmp_path / "busy" / "note.txt").write_text("another writer's file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(synth_write, "write_shard", full_disk_after_a_note)
    with pytest.raises(OutputError, match="No space left on device"):
        write_checkpoint(tmp_path / "busy" / "c" / "out", TINY, seed=1)
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["note.txt"]  # c removed, busy and its file kept


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_file_put_in_out_during_the_run_is_kept(fp8_dir, tmp_path, monkeypatch, overwrite):
    """A file or folder that something else put in OUT while the run wrote (your notes, a copy landing there)
    was removed with the old checkpoint's leftovers once the new one was in (`rm -r` of a folder of yours,
    exit 0; found by a bug hunt): `--overwrite` "never removes a file it did not write" (--help), and
    anything else there is kept (README). Only make-tiny's own leftovers go."""
    from dsv41_convert.synth import write as synth_write

    real = synth_write.write_shard
    out = tmp_path / "out"
    if overwrite:
        shutil.copytree(fp8_dir, out)
        (out / "model-00003-of-00014.safetensors.partial").write_bytes(b"half")  # a leftover of make-tiny's

    def and_a_note(stage, shard, *args, **kw):
        if not (out / "notes.txt").exists():
            (out / "notes.txt").write_text("mine")
            (out / "mine").mkdir()
            (out / "mine" / "data.bin").write_bytes(b"\x01\x02")
        return real(stage, shard, *args, **kw)

    monkeypatch.setattr(synth_write, "write_shard", and_a_note)
    summary = write_checkpoint(out, TINY, seed=1, layer_shards=2, overwrite=overwrite)
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "mine" / "data.bin").read_bytes() == b"\x01\x02"
    made = ["config.json", "tokenizer.json", "tokenizer_config.json", INDEX, MARK]
    made += [f["file"] for f in summary["files"]]
    assert sorted(p.name for p in out.iterdir()) == sorted([*made, "notes.txt", "mine"])


def test_a_failed_run_keeps_a_file_put_in_the_out_it_made(tmp_path, monkeypatch):
    """A run that made OUT and then failed removed OUT with `rm -r`, also a file something else had put there
    meanwhile (found by a bug hunt): only make-tiny's own files go, and OUT (and the folder made above it)
    stay while they hold another's file."""
    from dsv41_convert.synth import write as synth_write

    out = tmp_path / "new" / "out"

    def a_note_then_a_full_disk(stage, shard, *args, **kw):
        (out / "notes.txt").write_text("mine")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(synth_write, "write_shard", a_note_then_a_full_disk)
    with pytest.raises(OutputError, match="No space left on device"):
        write_checkpoint(out, TINY, seed=1)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_the_checkpoint_and_keeps_the_folder(fp8_dir, tmp_path):
    """With --overwrite the new checkpoint replaces the old one in OUT itself: the old files the new one has
    not are gone, nothing else is left in or beside OUT, and OUT is the same folder (inode, mode, group and
    setgid bit: a first version renamed a new folder over it, which widened a 2770 folder to 755 and left a
    shell inside OUT in a deleted folder; an audit). Files of an interrupted run (a .partial, a hidden stage
    folder) are cleared with it."""
    out = tmp_path / "out"
    shutil.copytree(fp8_dir, out)
    os.chmod(out, 0o2770)
    (out / "model-00003-of-00014.safetensors.partial").write_bytes(b"half")
    (out / ".make-tiny.partial-stale").mkdir()
    (out / ".make-tiny.partial-stale" / "config.json").write_text("{}")
    before = out.stat()
    summary = write_checkpoint(out, TINY, seed=1, layer_shards=2, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "tokenizer.json", "tokenizer_config.json", INDEX, MARK, *(f["file"] for f in summary["files"])]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    after = out.stat()
    assert (after.st_ino, stat.S_IMODE(after.st_mode), after.st_gid) == (before.st_ino, 0o2770, before.st_gid)
    assert json.loads((out / INDEX).read_text())["weight_map"]  # the new index, last in


def test_out_as_the_current_folder_an_empty_one_and_a_long_name(tmp_path, monkeypatch, capsys):
    """`make-tiny .` failed after writing everything (its hidden folder was made inside OUT and then refused
    as foreign), a 245-character name failed (the hidden folder's name went past 255); an empty folder is
    filled, not replaced (an audit)."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    from cli_run import run_cli

    code, _, err = run_cli(monkeypatch, capsys, "make-tiny", ".", "--no-vision", "--shards", "1")
    assert code == 0, err
    assert (here / INDEX).is_file() and [p.name for p in here.iterdir() if p.name.startswith(".")] == [MARK]
    long_name = tmp_path / ("a" * 245)
    write_checkpoint(long_name, TINY, vision=False, layer_shards=1)
    assert (long_name / INDEX).is_file()


def test_a_second_run_into_out_is_refused_while_one_writes(tmp_path):
    """Two runs into one OUT wrote beside each other (an audit: both exit 0, the first's files replaced);
    OUT is held as every writer holds its folder."""
    from dsv41_convert.errors import LockedError
    from dsv41_convert.store.lock import hold

    out = tmp_path / "out"
    out.mkdir()
    with hold(out), pytest.raises(LockedError, match=f"{out}: in use by pid {os.getpid()}"):
        write_checkpoint(out, TINY, vision=False, layer_shards=1)
    assert list(out.iterdir()) == []


def test_a_second_run_without_overwrite_names_the_run_writing_there(tmp_path):
    """A second make-tiny into an OUT another make-tiny was writing (holding it, its hidden stage folder inside)
    was refused as "not empty; pass --overwrite", which that run's lock then refuses too; the README promises a
    second writer the folder and the process that holds it."""
    from dsv41_convert.errors import LockedError
    from dsv41_convert.store.lock import hold

    out = tmp_path / "out"
    out.mkdir()
    with hold(out):
        (out / ".make-tiny.partial-abcd1234").mkdir()  # the running run's stage
        with pytest.raises(LockedError, match=f"{out}: in use by pid {os.getpid()}"):
            write_checkpoint(out, TINY, vision=False, layer_shards=1)
    assert [p.name for p in out.iterdir()] == [".make-tiny.partial-abcd1234"]  # the other run's, untouched


def test_a_signal_while_the_files_move_in_waits_for_the_last(fp8_dir, tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while the new files replace the old ones is postponed until the new index is in:
    OUT is then the whole new checkpoint, and the run still stops (KeyboardInterrupt) instead of going on."""
    from dsv41_convert import interrupts
    from dsv41_convert.synth import staged

    out = tmp_path / "out"
    shutil.copytree(fp8_dir, out)
    real = staged._move_in

    def signalled(stage, into, made):
        interrupts.interrupt()  # the signal handler's call: raises at once unless deferred
        real(stage, into, made)

    monkeypatch.setattr(staged, "_move_in", signalled)
    monkeypatch.setitem(interrupts._state, "interrupted", False)
    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(out, TINY, seed=1, layer_shards=2, overwrite=True)
    shards = {p.name for p in out.glob("model-*.safetensors")}
    assert shards == set(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert shards and not [n for n in shards if n.endswith("-of-00014.safetensors")]  # the old ones removed
    assert json.loads((out / INDEX).read_text())["weight_map"] and not list(out.glob(".make-tiny*"))


class _Killed(BaseException):
    """A kill -9 at a rename, as far as what is on disk goes (no cleanup of OUT runs after one)."""


def test_a_kill_while_the_files_move_in_never_leaves_a_whole_looking_mix(fp8_dir, tmp_path, monkeypatch):
    """make-tiny --overwrite killed between two of its renames left the old seed's shards beside the new
    seed's under one complete set of k-of-n names, without an index, which plan and shard took for one
    checkpoint (an audit). Now every old shard is gone before the first new one comes in: killed at any
    rename, OUT never holds shards of both."""
    import types

    from dsv41_convert.synth import staged

    new = tmp_path / "new"
    write_checkpoint(new, TINY, seed=1)
    names = sorted(p.name for p in fp8_dir.glob("model-*.safetensors"))
    assert names == sorted(p.name for p in new.glob("model-*.safetensors"))
    for kill_at in range(len(list(new.iterdir()))):  # each of the renames that move the new files in
        out = tmp_path / f"out{kill_at}"
        shutil.copytree(fp8_dir, out)
        calls = itertools.count()

        def replace(a, b, kill_at=kill_at, calls=calls):
            if next(calls) == kill_at:
                raise _Killed
            os.replace(a, b)

        monkeypatch.setattr(staged, "os", types.SimpleNamespace(replace=replace, readlink=os.readlink))
        with pytest.raises(_Killed):
            write_checkpoint(out, TINY, seed=1, overwrite=True)
        monkeypatch.undo()
        here = [n for n in names if (out / n).is_file()]
        old = [n for n in here if (out / n).read_bytes() == (fp8_dir / n).read_bytes()]
        assert not old or len(old) == len(here), (kill_at, old, here)  # the old checkpoint, or none of it
        if (out / INDEX).is_file():
            assert all((out / n).read_bytes() == (new / n).read_bytes() for n in names), kill_at


def test_a_link_to_nowhere_is_named_as_such(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputError, match=r"dangling: a link to .*nowhere, which does not exist"):
        write_checkpoint(tmp_path / "dangling", TINY)
    linked = tmp_path / "linked"
    (tmp_path / "target").mkdir()
    linked.symlink_to(tmp_path / "target")
    write_checkpoint(linked, TINY, vision=False, layer_shards=1)  # a link to a folder: written there
    assert linked.is_symlink() and (tmp_path / "target" / INDEX).is_file()


@pytest.mark.parametrize("refused", ["not-empty", "foreign", "held", "shards", "full-foreign"])
def test_a_refused_make_tiny_is_said_before_any_progress(tmp_path, monkeypatch, capsys, refused):
    """`make-tiny OUT` into a folder of other files printed the progress display's title (`make-tiny tiny -> OUT`)
    and an empty line before `error: OUT: holds what make-tiny does not write`, as if the run had started (with
    `--preset full --sparse` 3 s later, after its tokenizer); so did OUT not empty, OUT held by another run and
    `--shards` out of range. The refusal is now the first thing said, and OUT is as it was."""
    from cli_run import run_cli

    from dsv41_convert.store.lock import hold

    out = (tmp_path / "out").resolve()
    out.mkdir()
    options, held = [], contextlib.nullcontext()
    if refused == "not-empty":
        write_checkpoint(out, TINY)
        said = f"{out}: not empty"
    elif refused == "held":
        said, held = f"{out}: in use by pid {os.getpid()}", hold(out)
    elif refused == "shards":
        options, said = ["--shards", "1000"], "--shards 1000: the backbone has"
    else:
        (out / "notes.txt").write_text("mine")
        options = ["--preset", "full", "--sparse"] if refused == "full-foreign" else []
        said = f"{out}: holds what make-tiny does not write (notes.txt)"
    before = sorted(p.name for p in out.iterdir())
    with held:
        code, stdout, err = run_cli(monkeypatch, capsys, "make-tiny", str(out), *options)
    assert code == 2 and err.startswith(f"error: {said}") and stdout == "", err
    assert sorted(p.name for p in out.iterdir()) == before
