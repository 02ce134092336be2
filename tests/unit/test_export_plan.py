"""build_export_plan on small checkpoints built in tmp_path: the format table's coverage, the output layout
(names, grouping, index, config), and the input errors it must name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_ckpt import make_tiny, source_tensors, tiny_config, write_ckpt

from dsv41_convert.config import HF_QUANTIZATION_CONFIG
from dsv41_convert.convert.export import build_export_plan, not_carried, output_config, shard_name
from dsv41_convert.convert.export_rules import EXPORT_ACTIONS, FORMATS
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.rules import RULES, Op
from dsv41_convert.errors import PlanError
from dsv41_convert.store.safetensors_header import nbytes, read_header


@pytest.fixture(scope="module")
def srcs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("export-plan")
    return {"fp8": make_tiny(base / "fp8"), "bf16": make_tiny(base / "bf16", quantized=False)}


def test_every_family_and_storage_of_the_rules_has_an_action_for_every_format():
    families = {r.op for r in RULES} - {Op.SCALE, Op.FOLD_INTO_WEIGHT}
    for op in families:
        storages = {"float"} | ({"fp8"} if op is not Op.KEEP and op is not Op.DROP else set())
        storages |= {"fp4"} if op is Op.AS_FP4 else set()
        for storage in storages:
            assert set(EXPORT_ACTIONS[(op, storage)]) == set(FORMATS), (op, storage)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
def test_layout_follows_the_source(srcs, kind, fmt):
    src = srcs[kind]
    ep = build_export_plan(src, fmt)
    files = sorted(p.name for p in src.glob("*.safetensors"))
    assert [f.file for f in ep.plan.files] == [shard_name(k, len(files)) for k in range(len(files))]
    total = 0
    for f, source_file in zip(ep.plan.files, files, strict=True):
        pos = len(f.header)
        for t in f.tensors:  # offsets tile the file after the header
            assert t.begin == pos and t.end - t.begin == nbytes(t.dtype, t.shape)
            pos = t.end
        total += pos - len(f.header)
        # the same names in the same file, scales aside
        source_names = set(read_header(src / source_file).tensors)
        out_names = {t.name for t in f.tensors}
        weights = {n for n in source_names if not n.endswith(".scale")}
        assert {n for n in out_names if not n.endswith(".scale")} == weights
        for n in out_names - source_names:
            assert n.endswith(".scale") and n.removesuffix(".scale") + ".weight" in out_names
    assert ep.index["metadata"]["total_size"] == total
    assert ep.index["weight_map"] == {t.name: f.file for f in ep.plan.files for t in f.tensors}


def _dtypes(ep) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (t.dtype, t.shape) for f in ep.plan.files for t in f.tensors}


def test_formats_write_the_dtypes_the_issue_asks_for(srcs):
    expert, wo_a, engram = "layers.0.ffn.experts.3.w2", "layers.1.attn.wo_a", "layers.1.engram.embed"
    b16 = _dtypes(build_export_plan(srcs["fp8"], "bf16"))
    assert b16[f"{expert}.weight"] == ("BF16", (64, 32)) and f"{expert}.scale" not in b16
    assert b16[f"{wo_a}.weight"][0] == "BF16" and f"{wo_a}.scale" not in b16
    assert b16[f"{engram}.weight"] == ("BF16", (102, 32)) and not any(n.endswith(".scale") for n in b16)
    assert b16["layers.0.attn_norm.weight"][0] == "BF16" and b16["layers.0.hc_attn_fn"][0] == "F32"
    fp8 = _dtypes(build_export_plan(srcs["fp8"], "fp8"))
    assert fp8[f"{expert}.weight"] == ("F8_E4M3", (64, 32)) and fp8[f"{expert}.scale"] == ("F8_E8M0", (2, 1))
    assert fp8[f"{wo_a}.weight"][0] == "F8_E4M3" and fp8[f"{engram}.scale"] == ("F8_E8M0", (102, 1))
    for kind in ("fp8", "bf16"):
        fp4 = _dtypes(build_export_plan(srcs[kind], "fp8-fp4"))
        assert fp4[f"{expert}.weight"] == ("I8", (64, 16)) and fp4[f"{expert}.scale"] == ("F8_E8M0", (64, 1))
        assert fp4[f"{wo_a}.weight"][0] == "F8_E4M3" and f"{wo_a}.scale" in fp4


def test_config_per_format():
    hf = tiny_config()
    bf16 = output_config(hf, "bf16")
    assert "quantization_config" not in bf16 and bf16["text_config"] == hf["text_config"]
    assert output_config(hf, "fp8-fp4") == hf
    fp8 = output_config(hf, "fp8")
    assert fp8["quantization_config"] == dict(hf["quantization_config"], expert_dtype="fp8")
    assert list(fp8) == list(hf)
    from_bf16 = output_config(tiny_config(quantized=False), "fp8-fp4")
    assert list(from_bf16) == list(hf) and from_bf16["quantization_config"] == HF_QUANTIZATION_CONFIG


def test_bad_format_and_a_rank_folder_as_source(srcs, tmp_path):
    with pytest.raises(PlanError, match="--format 'fp4'"):
        build_export_plan(srcs["fp8"], "fp4")
    folder = tmp_path / "ranks"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"dim": 64}))
    with pytest.raises(PlanError, match="not a Hugging Face config"):
        build_export_plan(folder, "bf16")


def test_a_source_that_does_not_match_its_config_is_named(tmp_path):
    cfg = tiny_config()
    tensors = source_tensors(cfg)
    tensors["layers.2.ffn.experts.5.w1.weight"] = tensors["layers.2.ffn.experts.5.w1.weight"].view(-1)[:64].clone()
    write_ckpt(tmp_path / "src", tensors, cfg)
    with pytest.raises(PlanError, match=r"layers\.2\.ffn\.experts\.5\.w1\.weight: found I8 \[64\]"):
        build_export_plan(tmp_path / "src", "bf16")


def _fp8_expert_source(tmp_path: Path) -> Path:
    """A checkpoint whose config says expert_dtype fp8 and whose experts are e4m3 with 32x32 scales."""
    cfg = tiny_config()
    cfg["quantization_config"]["expert_dtype"] = "fp8"
    return write_ckpt(tmp_path / "src8", source_tensors(cfg), cfg)


def test_fp8_experts_are_a_valid_source(tmp_path):
    src = _fp8_expert_source(tmp_path)
    assert build_plan(src, 2, "fp8").files
    with pytest.raises(PlanError, match=r"routed experts are fp8.*--expert-dtype fp8"):
        build_plan(src, 2, "fp4")
    actions = {t.name: t.action for f in build_export_plan(src, "fp8-fp4").plan.files for t in f.tensors}
    assert actions["layers.0.ffn.experts.0.w1.weight"] == "requant_fp4"
    assert actions["layers.0.attn.wq_a.weight"] == "copy"
    # an I8 expert where the config says fp8 is named
    cfg = tiny_config()
    cfg["quantization_config"]["expert_dtype"] = "fp8"
    (tmp_path / "pub").mkdir()
    write_ckpt(tmp_path / "pub", source_tensors(tiny_config()), cfg)
    with pytest.raises(PlanError, match=r"experts\.0\.w1\.weight: found I8 .* expected F8_E4M3"):
        build_export_plan(tmp_path / "pub", "bf16")


def test_fp8_export_of_a_bf16_source_quantizes_its_experts_to_e4m3_blocks(srcs):
    """A bf16 source's routed experts in `--format fp8` are e4m3 with 32x32 scales, as the fp8 format's experts
    are from any source: an export that quantized them to MXFP4 (I8 pairs, a scale per 32 inputs) under a config
    saying expert_dtype fp8 would write a checkpoint no loader of that format reads."""
    dtypes = _dtypes(build_export_plan(srcs["bf16"], "fp8"))
    out, inp = 64, 32  # w2 of the tiny config: [hidden_size, moe_intermediate_size]
    blocks = (-(-out // 32), -(-inp // 32))
    assert dtypes["layers.0.ffn.experts.3.w2.weight"] == ("F8_E4M3", (out, inp))
    assert dtypes["layers.0.ffn.experts.3.w2.scale"] == ("F8_E8M0", blocks)


def test_an_empty_format_is_refused_as_a_plan_error(srcs):
    """`--format ""` is no format: it must be the PlanError naming the choices (exit 2), not a KeyError raised
    from the format table with a traceback."""
    with pytest.raises(PlanError, match=r"--format '': expected one of bf16, fp8, fp8-fp4"):
        build_export_plan(srcs["fp8"], "")


def test_fp8_export_of_a_published_source_whose_experts_cannot_make_32x32_blocks_is_refused(tmp_path):
    """A published (fp4-expert) source with moe_intermediate_size 48: its experts cannot be cast to 32x32 e4m3
    blocks, so `--format fp8` must be refused at plan time naming config.json's key. A plan validated as for fp4
    experts let it through. Its fp4 experts' scales per 32 inputs cannot tile 48 either, so bf16 and fp8-fp4 are
    refused too (bf16 planned, then failed to decode them mid-write: an audit)."""
    cfg = tiny_config()
    cfg["text_config"]["moe_intermediate_size"] = 48
    src = write_ckpt(tmp_path / "src", source_tensors(cfg), cfg)
    with pytest.raises(PlanError, match=r"not a multiple of 32: moe_intermediate_size 48 \(for fp8 experts"):
        build_export_plan(src, "fp8")
    for fmt in ("bf16", "fp8-fp4"):
        with pytest.raises(PlanError, match=r"not a multiple of 32: moe_intermediate_size 48 \(for fp4 experts"):
            build_export_plan(src, fmt)


def test_config_keeps_the_sources_own_quantization_config():
    """A source whose quantization_config differs from the published one (another key, another value) keeps it
    in the fp8 and fp8-fp4 exports, with only expert_dtype set for the format: replaced by the published
    default, the export's config.json would describe another quantization than its tensors hold."""
    hf = tiny_config()
    own = dict(hf["quantization_config"], modules_to_not_convert=["head"], activation_scheme="static")
    hf["quantization_config"] = own
    assert output_config(hf, "fp8")["quantization_config"] == dict(own, expert_dtype="fp8")
    assert output_config(hf, "fp8-fp4")["quantization_config"] == dict(own, expert_dtype="fp4")


def test_not_carried_names_only_the_source_files_an_export_does_not_write(tmp_path):
    """not_carried lists SRC's top-level files and folders an export leaves behind, and nothing it writes or
    that is a record of a run of ours: shards, config.json, the index, the tokenizer files, manifest.json, a
    share's manifest fragment and hidden entries are not named (a fragment named there was said to be lost)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in (
        "model-00001-of-00002.safetensors", "config.json", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "manifest.json", "manifest-fragment-mp2-r0.json", ".gitattributes",
        "generation_config.json", "README.md",
    ):  # fmt: skip
        (src / name).write_text("{}")
    for folder in (".cache", "encoding", "inference"):
        (src / folder).mkdir()
    assert not_carried(src) == ["README.md", "encoding/", "generation_config.json", "inference/"]


def test_bf16_export_writes_each_float_tensor_in_the_catalogs_dtype(tmp_path):
    """Guards the README's list of what the bf16 format keeps in F32: an F32 fine-tune's float tensors come out in
    the dtype the published catalog gives each (F32 only for attn_sink, the gate biases and hc_*; head, embed and
    the norms as BF16), and every quantized weight as BF16. The README once listed `head` among the F32 ones; the
    published checkpoint stores head.weight as BF16 [129280, 5120], and so does the export."""
    import re

    from reference_data import CATALOG

    want = {}
    for row in json.loads(CATALOG.read_text()):
        if row["pattern"].endswith(".scale"):
            continue
        rx = re.escape(row["pattern"]).replace(r"\{\}", r"\d+")
        want[rx] = "BF16" if row["dtype"] in ("F8_E4M3", "I8") else row["dtype"]
    cfg = tiny_config(quantized=False)
    f32 = {n: t.float() for n, t in source_tensors(cfg).items()}  # every float tensor saved as F32
    got = _dtypes(build_export_plan(write_ckpt(tmp_path / "f32", f32, cfg), "bf16"))
    assert got["head.weight"][0] == "BF16" and got["layers.0.hc_attn_fn"][0] == "F32"
    for name, (dtype, _) in got.items():
        hits = [d for rx, d in want.items() if re.fullmatch(rx, name)]
        assert hits == [dtype], (name, dtype, hits)


def test_a_source_file_of_only_dropped_tensors_gives_no_shard(tmp_path):
    """A source file holding only scales (their weights in other files) has nothing left at bf16. It wrote an
    empty shard (a `{}` header) that the index did not list, numbered among the others (`-of-00004` with three
    files in the index): the output shards are now the index's files exactly, numbered among themselves."""
    from safetensors.torch import save_file

    from dsv41_convert.convert.export import export

    cfg = tiny_config(vision=False)
    tensors = source_tensors(cfg)
    scales = {n: t for n, t in tensors.items() if n.endswith(".scale")}
    src = write_ckpt(tmp_path / "src", {n: t for n, t in tensors.items() if n not in scales}, cfg)
    last = "model-00004-of-00004.safetensors"  # sorts after write_ckpt's three
    save_file(scales, src / last)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(scales, last))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    ep = build_export_plan(src, "bf16")
    assert [f.file for f in ep.plan.files] == [shard_name(k, 3) for k in range(3)]
    assert all(f.tensors for f in ep.plan.files)
    export(ep, tmp_path / "out")
    written = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    listed = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert written == sorted(set(listed)) == [shard_name(k, 3) for k in range(3)]
    assert [f.file for f in build_export_plan(src, "fp8").plan.files] == [shard_name(k, 4) for k in range(4)]
