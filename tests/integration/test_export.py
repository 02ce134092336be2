"""End to end: make-tiny checkpoints -> export in each format -> round trips compared bit for bit, the bf16
export against an independent decode of the published tensors, and `shard` of the exports.

make-tiny's quantized tensors are canonical (the encoders give back their bytes), so every round trip is
byte-exact except where a format cannot hold a sign: the lossless fp4 -> fp8 cast writes the e2m1 -0 as
e4m3 +0 (as upstream convert.py does), so after a trip through fp8 those zeros come back as +0. The
tests check that these are the only differences. A checkpoint with non-canonical scales gives other
bytes with the same values: `test_non_canonical_scales_keep_values` lists which tensors and why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import run_cli
from tiny_ckpt import make_tiny

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.export import build_export_plan, export
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.quant import decode_fp8_blocks, decode_mxfp4

pytestmark = pytest.mark.slow
FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")


def _make_tiny(out: Path, quantized: bool) -> Path:
    from dsv41_convert.synth.presets import PRESETS
    from dsv41_convert.synth.write import write_checkpoint

    write_checkpoint(out, PRESETS["tiny"], seed=3, quantized=quantized)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """make-tiny fp8 and bf16 (seed 3), and the exports the round trips need, each made once."""
    base = tmp_path_factory.mktemp("export")
    d = {"pub": _make_tiny(base / "pub", True), "b16": _make_tiny(base / "b16", False)}
    for name, src, fmt in (
        ("pub-bf16", "pub", "bf16"),
        ("pub-fp8", "pub", "fp8"),
        ("pub-fp8-fp4", "pub", "fp8-fp4"),
        ("pub-bf16-fp8-fp4", "pub-bf16", "fp8-fp4"),
        ("pub-fp8-bf16", "pub-fp8", "bf16"),
        ("b16-fp8-fp4", "b16", "fp8-fp4"),
    ):
        d[name] = base / name
        summary = export(build_export_plan(d[src], fmt), d[name])
        assert summary["manifest"] and summary["format"] == fmt
    return d


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


def assert_same_files(a: Path, b: Path) -> None:
    names = [p.name for p in _shards(a)]
    assert names == [p.name for p in _shards(b)] and names
    for name in [*names, *FILES]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_published_to_fp8_fp4_is_a_byte_identical_copy(ckpts):
    assert_same_files(ckpts["pub"], ckpts["pub-fp8-fp4"])


def test_published_to_bf16_to_fp8_fp4_gives_back_the_published_bytes(ckpts):
    assert_same_files(ckpts["pub"], ckpts["pub-bf16-fp8-fp4"])


def test_bf16_variant_equals_bf16_export_of_the_fp8_variant(ckpts):
    assert_same_files(ckpts["b16"], ckpts["pub-bf16"])


def test_bf16_variant_to_fp8_fp4_equals_the_fp8_variant(ckpts):
    assert_same_files(ckpts["pub"], ckpts["b16-fp8-fp4"])


def _signed_zero_only(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes except where one holds -0 and the other +0 (same value)."""
    bits = {1: torch.uint8, 2: torch.int16}[a.element_size()]
    diff = a.view(bits) != b.view(bits)
    return bool((a[diff].float() == 0).all() and (b[diff].float() == 0).all())


def test_published_to_fp8_to_bf16_equals_published_to_bf16(ckpts):
    """Value for value; bytes too, but for the -0 the fp4 -> fp8 cast writes as +0."""
    signed = set()
    for p in _shards(ckpts["pub-bf16"]):
        want, got = load_file(p), load_file(ckpts["pub-fp8-bf16"] / p.name)
        assert want.keys() == got.keys()
        for name, w in want.items():
            g = got[name]
            assert (g.dtype, g.shape) == (w.dtype, w.shape), name
            if not torch.equal(g.view(torch.uint8), w.view(torch.uint8)):
                assert ".experts." in name and _signed_zero_only(w, g), name
                signed.add(name)
    assert signed  # the tiny model's experts hold e2m1 -0 codes
    assert (ckpts["pub-bf16"] / "config.json").read_bytes() == (ckpts["pub-fp8-bf16"] / "config.json").read_bytes()


def test_fp8_export_back_to_fp8_fp4_is_the_published_but_for_signed_zeros(ckpts, tmp_path):
    """requant_fp4: fp8 experts decoded exactly and encoded to MXFP4 again give the published codes and
    scales, but for the e2m1 -0 the cast had written as +0; every other tensor is copied."""
    export(build_export_plan(ckpts["pub-fp8"], "fp8-fp4"), tmp_path / "back")
    signed = 0
    for p in _shards(ckpts["pub"]):
        want, got = load_file(p), load_file(tmp_path / "back" / p.name)
        assert want.keys() == got.keys()
        for name, w in want.items():
            g = got[name]
            assert (g.dtype, g.shape) == (w.dtype, w.shape), name
            if torch.equal(g.view(torch.uint8), w.view(torch.uint8)):
                continue
            assert ".experts." in name and w.dtype == torch.int8, name
            wb, gb = w.view(torch.uint8), g.view(torch.uint8)
            nibbles = torch.stack([wb & 0x0F, wb >> 4, gb & 0x0F, gb >> 4])
            diff = nibbles[:2] != nibbles[2:]
            assert bool((nibbles[:2][diff] == 8).all() and (nibbles[2:][diff] == 0).all()), name  # -0 -> +0
            signed += 1
    assert signed
    assert (ckpts["pub"] / "config.json").read_bytes() == (tmp_path / "back" / "config.json").read_bytes()


def test_bf16_export_is_the_decoded_published_tensors(ckpts):
    """Against an independent decode: safetensors' own reader and the quant/ decoders, tensor by tensor."""
    for p in _shards(ckpts["pub"]):
        pub, got = load_file(p), load_file(ckpts["pub-bf16"] / p.name)
        assert set(got) == {n for n in pub if not n.endswith(".scale")}
        for name, t in got.items():
            src = pub[name]
            if src.dtype == torch.int8:
                want = decode_mxfp4(src, pub[name.removesuffix(".weight") + ".scale"], 32, torch.bfloat16)
            elif src.dtype == torch.float8_e4m3fn:
                want = decode_fp8_blocks(src, pub[name.removesuffix(".weight") + ".scale"], None, torch.bfloat16)
            else:
                want = src
            assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8), want.view(torch.uint8)), name


def test_fp8_export_experts_are_the_lossless_cast(ckpts):
    from dsv41_convert.quant import fp4_to_fp8

    config = json.loads((ckpts["pub-fp8"] / "config.json").read_text())
    assert config["quantization_config"]["expert_dtype"] == "fp8"
    n_experts = 0
    for p in _shards(ckpts["pub"]):
        pub, got = load_file(p), load_file(ckpts["pub-fp8"] / p.name)
        assert got.keys() == pub.keys()
        for name, t in got.items():
            if ".experts." in name and name.endswith(".weight"):
                sname = name.removesuffix(".weight") + ".scale"
                w8, s8 = fp4_to_fp8(pub[name], pub[sname], 32, name)
                assert torch.equal(t.view(torch.uint8), w8.view(torch.uint8)), name
                assert torch.equal(got[sname].view(torch.uint8), s8.view(torch.uint8)), sname
                n_experts += 1
            elif ".experts." not in name:
                assert torch.equal(t.view(torch.uint8), pub[name].view(torch.uint8)), name
    assert n_experts


def test_shard_of_the_fp8_export_equals_shard_of_the_published(ckpts, tmp_path):
    """--expert-dtype fp8 from the fp8 export, and from a bf16 source (quantized as the published scheme, its
    MXFP4 experts then cast, as README says: fp4 precision in fp8 bytes), gives the published source's files."""
    for src in ("pub", "pub-fp8", "b16"):
        execute(build_plan(ckpts[src], 2, "fp8"), tmp_path / src)
    for other in ("pub-fp8", "b16"):
        for name in ("model0-mp2.safetensors", "model1-mp2.safetensors", "config.json"):
            assert (tmp_path / "pub" / name).read_bytes() == (tmp_path / other / name).read_bytes(), (other, name)


def test_cli_export_dry_run_json_and_check(ckpts, tmp_path, monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "export", str(ckpts["pub"]), str(tmp_path / "o"), "--format", "fp8",
                           "--dry-run", "--json")  # fmt: skip
    assert code == 0 and not (tmp_path / "o").exists()
    summary = json.loads(out)
    assert summary["format"] == "fp8" and summary["total_bytes"] == sum(r["bytes"] for r in summary["files"])
    assert [r["file"] for r in summary["files"]] == sorted(p.name for p in ckpts["pub"].glob("*.safetensors"))
    assert "tp" not in summary and "ranks" not in summary  # an export has shards, not ranks
    code, out, _ = run_cli(monkeypatch, capsys, "export", str(ckpts["pub"]), str(tmp_path / "o"), "--format", "fp8",
                           "--dry-run")  # fmt: skip
    assert code == 0 and "export --format fp8" in out and "per shard" in out and "tp 1" not in out, out
    code, out, _ = run_cli(monkeypatch, capsys, "export", str(ckpts["pub"]), str(tmp_path / "o"), "--format",
                           "bf16", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["manifest"]
    assert_same_files(ckpts["pub-bf16"], tmp_path / "o")
    code, _, _ = run_cli(monkeypatch, capsys, "check", str(tmp_path / "o"))
    assert code == 0
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert set(FILES) <= set(manifest["files"]) and manifest["options"]["format"] == "bf16"


def test_torchrun_shares_of_an_export_finish_in_one_folder_or_gathered(ckpts, tmp_path, monkeypatch, capsys):
    """An export under torchrun (RANK, WORLD_SIZE): each share writes its shards and a fragment and says so
    ("manifest: None" before, no word of the rest, exit 0). In one folder the last share writes config.json,
    the index and the manifest; shares from several machines gathered into one are refused by `manifest`
    (it writes no export's index: before, "hf_config.json: missing"), and `export --resume` finishes them:
    either way the same bytes as one run."""
    pub, fmt = str(ckpts["pub"]), "bf16"
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # not a torchrun launch, whatever ran in this process before
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        for out in (tmp_path / "one", tmp_path / f"machine{rank}"):
            code, _, err = run_cli(monkeypatch, capsys, "export", pub, str(out), "--format", fmt)
            assert code == 0, err
            if rank == 0 or out.name != "one":
                assert "manifest: pending (not every shard is done yet)" in err and "fragment: " in err, err
                assert f"`dsv41-convert export SRC OUT --format {fmt} --resume`" in err
                assert "are set without MASTER_ADDR and MASTER_PORT" in err  # not a torchrun launch: warned
                assert "--ranks" not in err  # export has no --ranks (the warning advised it: a usage error)
                assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert_same_files(ckpts["pub-bf16"], tmp_path / "one")
    assert run_cli(monkeypatch, capsys, "check", str(tmp_path / "one"))[0] == 0
    code, out, err = run_cli(monkeypatch, capsys, "manifest", str(tmp_path / "one"), "--json")  # finished already
    assert code == 0 and json.loads(out)["already_merged"], err
    fragments = sorted(p.name for p in (tmp_path / "one").glob("manifest-fragment-*.json"))
    assert json.loads(out)["export_fragments"] == fragments and fragments
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(tmp_path / "one"))  # said "no fragment left"
    said = " ".join(err.split())
    kept = f"{len(fragments)} fragment{'s' * (len(fragments) != 1)} of its shares"
    assert code == 0 and "no fragment left" not in said and kept in said, err
    shard = sorted((tmp_path / "one").glob("model-*.safetensors"))[0]
    data = bytearray(original := shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(data)  # the advice fits an export: its fragments stay, and `manifest` merges none
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(tmp_path / "one"))
    assert code == 2 and "`export SRC OUT --format F --resume`" in " ".join(err.split()), err
    shard.write_bytes(original)
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for rank in (0, 1):
        for p in (tmp_path / f"machine{rank}").iterdir():
            if p.is_file():
                (gathered / p.name).write_bytes(p.read_bytes())
    code, out, err = run_cli(monkeypatch, capsys, "check", str(gathered))  # its advice: export's, not manifest's
    finish = f"`dsv41-convert export {ckpts['pub'].resolve()} {gathered} --format {fmt} --resume`"
    assert code != 0 and finish in " ".join((out + err).split()) and "dsv41-convert manifest" not in out + err
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(gathered))
    assert code == 2 and f"a fragment of `export --format {fmt}`, not of `shard`" in err, err
    assert f"`dsv41-convert export {ckpts['pub'].resolve()} {gathered} --format {fmt} --resume`" in err
    code, _, err = run_cli(monkeypatch, capsys, "export", pub, str(gathered), "--format", fmt, "--resume")
    assert code == 0 and "wrote 0 shards" in err, err
    assert_same_files(ckpts["pub-bf16"], gathered)
    assert run_cli(monkeypatch, capsys, "check", str(gathered))[0] == 0


def _canonical_and_same(pub: dict, back: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scale block of weight `name`: (canonical in `pub`, same bytes in `back`), both [*scale shape] bool.

    Canonical, stated independently of the encoders: the block's largest e4m3 code magnitude is above 224
    (so amax/448 > scale/2 and the encoder's power-of-two ceiling is the stored scale), or the fp4 group's
    largest e2m1 magnitude is 4 or 6 (amax/6 > scale/2)."""
    from dsv41_convert.quant import E2M1_VALUES, infer_block
    from dsv41_convert.quant.fp8 import pad_blocks

    sname = name.removesuffix(".weight") + ".scale"
    q, s, q2, s2 = pub[name], pub[sname], back[name], back[sname]
    if q.dtype == torch.int8:  # codes [out, in], groups of 32 along the row
        b = q.view(torch.uint8)
        mags = E2M1_VALUES[torch.stack((b & 0x0F, b >> 4), -1).flatten(-2).long() & 7]
        canonical = mags.unflatten(-1, (-1, 32)).amax(-1) >= 4
        same = (q.view(torch.uint8) == q2.view(torch.uint8)).unflatten(-1, (-1, 16)).all(-1)
    else:
        bo, bi = infer_block(q.shape, s.shape)
        canonical = pad_blocks(q.float().abs(), bo, bi).amax(dim=(1, 3)) > 224
        same = pad_blocks((q.view(torch.uint8) == q2.view(torch.uint8)).int(), bo, bi).amin(dim=(1, 3)).bool()
    return canonical, same & (s.view(torch.uint8) == s2.view(torch.uint8))


def test_non_canonical_scales_keep_values(tmp_path):
    """tests/tiny_ckpt.py draws e4m3 codes and scales independently, so blocks may not be canonical (their
    largest code is below what their scale implies: e4m3 <= 224, e2m1 <= 3). published -> bf16 -> fp8-fp4
    re-encodes exactly those blocks with a smaller scale and larger codes: other bytes, the same values.
    Every canonical block and every unquantized tensor comes back byte for byte."""
    src = make_tiny(tmp_path / "src")
    export(build_export_plan(src, "bf16"), tmp_path / "b16")
    export(build_export_plan(tmp_path / "b16", "fp8-fp4"), tmp_path / "back")
    pub = {k: v for p in src.glob("model-*.safetensors") for k, v in load_file(p).items()}
    back = {k: v for p in (tmp_path / "back").glob("model-*.safetensors") for k, v in load_file(p).items()}
    assert pub.keys() == back.keys()  # a new scale goes beside its weight, wherever the old one was
    differ = {}
    for name, t in pub.items():
        if name.endswith(".scale"):
            continue
        if t.dtype not in (torch.float8_e4m3fn, torch.int8):
            assert torch.equal(t.view(torch.uint8), back[name].view(torch.uint8)), name
            continue
        canonical, same = _canonical_and_same(pub, back, name)
        assert torch.equal(canonical, same), name  # why a block differs: it was not canonical
        sname = name.removesuffix(".weight") + ".scale"
        if t.dtype == torch.int8:
            a, b = (decode_mxfp4(x[name], x[sname], 32, torch.float32) for x in (pub, back))
        else:
            a, b = (decode_fp8_blocks(x[name], x[sname], None, torch.float32) for x in (pub, back))
        assert torch.equal(a, b), name
        if not same.all():
            differ[name] = int((~same).sum())
    # codes ~ N(0, 50) give 32x32 e4m3 blocks with largest codes ~165: non-canonical; random e2m1 groups
    # nearly always hold a 4 or 6: canonical
    assert any(pub[n].dtype == torch.float8_e4m3fn for n in differ) and len(differ) >= 40


def _verify_fp8_export(ckpts, conv: Path):
    from dsv41_convert.synth.presets import TINY
    from dsv41_convert.verify.prompts import default_prompts
    from dsv41_convert.verify.run import VerifyOptions, verify

    ids = default_prompts(TINY.vocab_size, count=1, length=24)[0].input_ids
    prompts = conv.parent / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(ids)}) + "\n")
    return verify(VerifyOptions(conv, reference=ckpts["pub-fp8"], prompts=prompts, n_decode=1, threads=1))


def test_verify_takes_the_fp8_export_as_reference_and_catches_swapped_expert_rows(ckpts, tmp_path):
    """The reference model runs the fp8 experts as stored; one fp8 expert with its rows swapped is caught."""
    from safetensors.torch import save_file

    conv = tmp_path / "mp1"
    execute(build_plan(ckpts["pub-fp8"], 1, "fp8"), conv)
    result = _verify_fp8_export(ckpts, conv)
    assert result.ok, result.failures
    assert all(s.max_abs == 0 for s in result.overall.values())  # tp 1, same weights: bit for bit
    path = conv / "model0-mp1.safetensors"
    tensors = load_file(path)
    w = tensors["layers.0.ffn.experts.0.w1.weight"].view(torch.uint8)
    w[:, :] = w.flip(0)  # rows swapped in one expert: same bytes, other places
    save_file(tensors, path)
    result = _verify_fp8_export(ckpts, conv)
    assert not result.ok and any(t.name.startswith("layers.0.ffn.experts.0.w1") for t in result.localization.tensors)
