"""`check OUT`: manifest sizes and sha256, naming the bad file."""

import hashlib
import json

import pytest

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.store.manifest import FORMAT
from dsv41_convert.store.manifest_check import check_folder


def _folder(tmp_path, files: dict[str, bytes]):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    entries = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}
    (tmp_path / "manifest.json").write_text(json.dumps({"format": FORMAT, "files": entries}))
    return tmp_path


def test_clean_folder_passes(tmp_path):
    result = check_folder(_folder(tmp_path, {"model0-mp1.safetensors": b"abc" * 100, "config.json": b"{}"}))
    assert result.ok and sorted(result.checked) == ["config.json", "model0-mp1.safetensors"]


def test_flipped_byte_truncation_and_missing_file_are_named(tmp_path):
    folder = _folder(tmp_path, {"a.safetensors": b"x" * 64, "b.safetensors": b"y" * 64, "c.json": b"{}"})
    (folder / "a.safetensors").write_bytes(b"x" * 63 + b"z")
    (folder / "b.safetensors").write_bytes(b"y" * 60)
    (folder / "c.json").unlink()
    result = check_folder(folder)
    assert not result.ok and result.checked == []
    a, b, c = result.problems
    assert a.startswith("a.safetensors: sha256")
    assert b.startswith("b.safetensors: 60 bytes, manifest says 64")
    assert c.startswith("c.json: missing")


def test_missing_or_foreign_manifest_is_an_input_error(tmp_path):
    with pytest.raises(VerifyInputError, match=r"manifest\.json: not found"):
        check_folder(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other", "files": {}}))
    with pytest.raises(VerifyInputError, match="format 'other'"):
        check_folder(tmp_path)
    (tmp_path / "manifest.json").write_text(
        json.dumps({"format": FORMAT, "files": {"../x": {"size": 1, "sha256": ""}}})
    )
    with pytest.raises(VerifyInputError, match="plain file name"):
        check_folder(tmp_path)
