"""reference-logits warns of a config of the published tensors with an edited setting, as plan, shard and export
do (tests/integration/test_make_tiny_full.py runs those on the full-size layout). Here the tiny preset stands in
for the published config, so that the model runs in seconds."""

from __future__ import annotations

import json

from cli_run import run_cli
from tiny_ckpt import make_tiny

import dsv41_convert.published as published
from dsv41_convert.config import load_model_args


def test_reference_logits_names_the_edited_setting(tmp_path, monkeypatch, capsys):
    src = make_tiny(tmp_path / "src")
    stand_in = load_model_args(src / "config.json")
    monkeypatch.setattr(published, "published_args", lambda: stand_in)
    config = json.loads((src / "config.json").read_text())
    window = config["text_config"]["sliding_window"]
    config["text_config"]["sliding_window"] = window * 2
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--decode-steps", "1")
    assert code == 0, err
    assert f"text_config.sliding_window {window * 2} (published {window})" in err
    assert out.is_file()


def test_an_inference_config_is_named_by_its_own_keys(tmp_path, monkeypatch, capsys):
    """Rank files' config.json (the inference config `shard` writes, fed to reference-logits --stream-layers)
    names the window `window_size`: the warning named `text_config.sliding_window`, a key that file lacks."""
    src = make_tiny(tmp_path / "src")
    monkeypatch.setattr(published, "published_args", lambda: load_model_args(src / "config.json"))
    mp = tmp_path / "mp2"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(mp), "--tp", "2", "--workers", "1")
    assert code == 0, err
    config = json.loads((mp / "config.json").read_text())
    window = config["window_size"]
    config["window_size"] = window * 2
    (mp / "config.json").write_text(json.dumps(config))
    (mp / "manifest.json").unlink()  # the config no longer matches its record
    out = tmp_path / "ref.safetensors"
    argv = ("reference-logits", str(mp), str(out), "--stream-layers", "--decode-steps", "1")
    code, _, err = run_cli(monkeypatch, capsys, *argv)
    assert code == 0, err
    assert (
        f"{mp / 'config.json'}: the published V4.1-Flash tensors with other settings: window_size {window * 2} "
        f"(published {window})" in " ".join(err.split())
    )
    assert "sliding_window" not in err
