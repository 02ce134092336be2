"""verify/provenance.py on small folders: what a reference records of the folder it ran, the shape a recorded
provenance must have, and what `verify --reference-logits FILE` concludes of CONVERTED from it (a copy of the
rank files the reference replayed is refused, another conversion of the same model is not; a tokenizer file
CONVERTED lacks is a failure)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.verify.provenance import check_converted, problems, record

MODEL = {"n_layers": 2, "dim": 64, "vocab_size": 128}
ARGS = SimpleNamespace(to_inference_dict=lambda: dict(MODEL))
TP = 2


def _rank_folder(folder: Path, fill: int) -> Path:
    """Two rank files of 4 KiB each (model{r}-mp2.safetensors), every byte `fill` + r; no manifest.json."""
    folder.mkdir()
    for r in range(TP):
        (folder / f"model{r}-mp{TP}.safetensors").write_bytes(bytes([fill + r]) * 4096)
    return folder


def test_another_conversion_with_rank_files_of_the_same_sizes_is_not_a_copy(tmp_path):
    """A reference computed from converted rank files (`reference-logits MP --stream-layers`) is refused for a copy
    of those files only: another conversion of the model has files of the same sizes, and neither folder need have
    a manifest (both sha256 unknown), yet it is another set of bytes and may be verified against the reference."""
    made = _rank_folder(tmp_path / "made", 1)
    prov = record(made, ARGS)
    assert isinstance(prov["made_from"], dict) and prov["made_from"]["tp"] == TP
    other = _rank_folder(tmp_path / "other", 7)
    assert check_converted(prov, other, ARGS, TP, Path("ref.safetensors")) == []
    copy = tmp_path / "copy"
    shutil.copytree(made, copy)  # new inodes, same bytes: refused
    with pytest.raises(VerifyInputError, match=r"a copy: the same sizes and sampled bytes"):
        check_converted(prov, copy, ARGS, TP, Path("ref.safetensors"))


def test_a_tokenizer_file_converted_lacks_is_a_failure(tmp_path):
    """The reference ran with a tokenizer.json (Engram hashes its ids): CONVERTED without one is a failure, as is one
    with other bytes; the recorded bytes are none."""
    conv = tmp_path / "conv"
    conv.mkdir()
    text = b'{"model": {"vocab": {"a": 0}}}'
    prov = {"model": MODEL, "tokenizer": {"tokenizer.json": hashlib.sha256(text).hexdigest()}}
    (found,) = check_converted(prov, conv, ARGS, 1, Path("ref.safetensors"))
    assert found.startswith(f"tokenizer: {conv / 'tokenizer.json'} is missing")
    (conv / "tokenizer.json").write_bytes(text[:-1] + b" ")
    (found,) = check_converted(prov, conv, ARGS, 1, Path("ref.safetensors"))
    assert "differs from the tokenizer.json" in found
    (conv / "tokenizer.json").write_bytes(text)
    assert check_converted(prov, conv, ARGS, 1, Path("ref.safetensors")) == []


def test_a_reference_of_a_source_records_the_sha256_of_its_config_json(tmp_path):
    """A source's HF config is its config.json (shard copies it beside the rank files as hf_config.json): the
    reference records its sha256, so verify can compare CONVERTED's hf_config.json with it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"model_type": "deepseek_v4", "rope_theta": 10000}')
    prov = record(src, ARGS)
    assert prov["made_from"] == "source"
    assert prov["hf_config"] == hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    assert prov["model"] == MODEL and prov["tokenizer"] == {}


@pytest.mark.parametrize(
    ("prov", "said"),
    [
        ({"made_from": "a folder"}, 'made_from must be "source" or an object with `files`'),
        ({"made_from": {"tp": 2}}, 'made_from must be "source" or an object with `files`'),
        ({"tokenizer": {"tokenizer.json": "a" * 64 + "0"}}, "sha256 strings (64 hex digits)"),
        ({"tokenizer": {"tokenizer.json": "A" * 64}}, "sha256 strings (64 hex digits)"),
    ],
)
def test_a_malformed_provenance_is_named(prov, said):
    """A made_from that is neither "source" nor an object of files, or a tokenizer digest that is not exactly 64
    lowercase hex digits (65 of them too), is a problem of the file; a well-formed provenance has none."""
    found = problems({"model": MODEL} | prov)
    assert any(said in p for p in found), found
    assert problems({"model": MODEL, "tokenizer": {"tokenizer.json": "a" * 64}, "made_from": "source"}) == []
