"""numbers.byte_amounts and numbers.counted: counts as a message says them (bytes never two that read the same)."""

import json

import pytest

from dsv41_convert.numbers import byte_amounts, counted


def test_gb_where_they_read_apart_bytes_where_they_would_not():
    assert byte_amounts(3_000_000_000, 1_250_000_000) == ["3.00 GB", "1.25 GB"]
    # "0.02 GB to write but only 0.02 GB free" and "0.00 GB short" (audits)
    assert byte_amounts(19_000_000, 17_000_000) == ["19,000,000 bytes", "17,000,000 bytes"]
    assert byte_amounts(2_000_000_000, 1_999_000_000, 1_000_000) == [
        "2,000,000,000 bytes", "1,999,000,000 bytes", "1,000,000 bytes"
    ]  # fmt: skip
    assert byte_amounts(2_000_000_000, 0) == ["2.00 GB", "0.00 GB"]  # nothing free reads 0.00 GB truly


@pytest.mark.parametrize(
    ("n", "verbs", "said"),
    [
        (0, None, "0 files"),
        (1, None, "1 file"),
        (2, None, "2 files"),
        (1, ("matches", "match"), "1 file matches"),
        (3, ("matches", "match"), "3 files match"),
        (0, ("does", "do"), "0 files do"),
    ],
)
def test_counted_agrees_noun_and_verb_with_the_count(n, verbs, said):
    """Messages said "file(s)", "1 files match", "after 1 attempts": one rule for every count now."""
    assert counted(n, "file", verbs) == said


def test_download_summary_and_missing_shard_count_one_in_the_singular(monkeypatch, capsys, tmp_path):
    """`download --verify-only` of a folder of one file with one problem said "1 files, ...: 1 problems", and a
    missing shard the index gives one tensor "a shard with 1 tensors": counts numbers.counted left behind."""
    from cli_run import run_cli
    from tiny_ckpt import make_tiny

    src = make_tiny(tmp_path / "src")
    lone = tmp_path / "lone"
    lone.mkdir()
    shard = sorted(src.glob("*.safetensors"))[0]
    (lone / "model.safetensors").write_bytes(shard.read_bytes())  # no config.json: its one problem
    code, _, err = run_cli(monkeypatch, capsys, "download", "acme/tiny", "--local-dir", str(lone), "--verify-only")
    assert code == 1
    assert "1 file, " in err and err.rstrip().endswith(": 1 problem"), err

    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra.weight"] = "model-00009-of-00009.safetensors"  # one tensor in a shard not there
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(monkeypatch, capsys, "download", "acme/tiny", "--local-dir", str(src), "--verify-only")
    assert code == 1
    assert "a shard with 1 tensor (" in err, err
