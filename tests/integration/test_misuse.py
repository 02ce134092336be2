"""Misuse the CLI the way a user can (wrong paths, wrong values, conflicting options, Ctrl-C) and see a clear
`error:` naming the file, exit 2 (130 for Ctrl-C), no traceback, and nothing misleading left in OUT."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_run import default_sigint, done_records, partial_sizes, run_cli
from safetensors.torch import load_file, save_file
from tiny_ckpt import make_tiny

from dsv41_convert.store.manifest import DONE_DIR
from dsv41_convert.store.publish import new_file_mode

CLI = [sys.executable, "-m", "dsv41_convert.cli"]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("misuse") / "src")


@pytest.fixture(scope="module")
def sharded(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("misuse") / "mp2"
    subprocess.run([*CLI, "shard", str(src), str(out), "--tp", "2"], check=True, capture_output=True)
    return out


def copy_of(folder: Path, to: Path) -> Path:
    subprocess.run(["cp", "-a", str(folder), str(to)], check=True)
    return to


def edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps(edit(cfg)))


def assert_clean_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert err.startswith("error:") or "error:" in err, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize("command", [["plan"], ["shard", "OUT"], ["export", "OUT", "--format", "bf16"]])
def test_a_file_given_as_the_source_folder(src, tmp_path, monkeypatch, capsys, command):
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    code, _, err = run_cli(monkeypatch, capsys, args[0], str(src / "config.json"), *args[1:])
    assert_clean_error(code, err, f"{src / 'config.json'}: not a folder")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c: c["text_config"].update(vocab_size="512") or c,
            "text_config.vocab_size = '512' (str), expected int",
        ),
        (lambda c: c["text_config"].update(num_attention_heads=0) or c, "text_config.num_attention_heads = 0"),
        (lambda c: c["text_config"].update(rms_norm_eps=True) or c, "text_config.rms_norm_eps = True (bool)"),
        (lambda c: c["text_config"].update(compress_ratios=4) or c, "text_config.compress_ratios = 4 (int)"),
        (lambda c: [1, 2], "a JSON object expected, found a list"),
        (lambda c: None, "a JSON object expected, found a NoneType"),
        (lambda c: {k: v for k, v in c.items() if k != "text_config"}, "no text_config"),
        (lambda c: c.update(quantization_config=[]) or c, "quantization_config must be a JSON object, found []"),
        (lambda c: c.update(quantization_config=7) or c, "quantization_config must be a JSON object, found 7"),
        (lambda c: c.update(vision_config=1) or c, "vision_config must be a JSON object, found 1"),
        (
            lambda c: c["quantization_config"].update(weight_block_size=32) or c,
            "weight_block_size [32, 32], found 'fp8' 32",
        ),
    ],
)
def test_config_values_of_the_wrong_kind(src, tmp_path, monkeypatch, capsys, edit, message):
    """Each a clean error naming config.json; the objects of the wrong kind and a None config were
    tracebacks (AttributeError, TypeError) from plan, shard and export."""
    bad = copy_of(src, tmp_path / "bad")
    edit_config(bad, edit)
    _every_reader_refuses(bad, tmp_path / "out", monkeypatch, capsys, f"{bad / 'config.json'}: ", message)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("config.json", b"\xff", "not valid JSON"),
        ("model.safetensors.index.json", b"\xff", "not valid JSON"),
        ("config.json", b"[" * 5000 + b"]" * 5000, "not valid JSON"),
        ("model.safetensors.index.json", b"[]", "a JSON object expected, found a list"),
        ("config.json", b'{"vocab_size": ' + b"9" * 5000 + b"}", "not valid JSON"),  # past int()'s 4300 digits
        ("model.safetensors.index.json", b'{"metadata": {"total_size": ' + b"9" * 5000 + b"}}", "not valid JSON"),
    ],
)
def test_json_files_that_are_no_json_object(src, tmp_path, monkeypatch, capsys, name, text, message):
    """Bytes that are not UTF-8, nesting past Python's recursion limit, an index that is a list, an integer past
    Python's int-string limit: tracebacks (UnicodeDecodeError, RecursionError, AttributeError, ValueError) before."""
    bad = copy_of(src, tmp_path / "bad")
    (bad / name).write_bytes(text)
    _every_reader_refuses(bad, tmp_path / "out", monkeypatch, capsys, f"{bad / name}: ", message)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_json_files_that_give_a_key_twice(src, tmp_path, monkeypatch, capsys, name):
    """A key given twice in one object (the config's layer count, a tensor of the index's weight_map, each given
    again with another value) was read as its last value by plan, shard and export, exit 0, without a word."""
    bad = copy_of(src, tmp_path / "bad")
    text = (bad / name).read_text()
    if name == "config.json":
        key = "num_hidden_layers"
        text = text.replace(f'"{key}":', f'"{key}": 1, "{key}":', 1)
    else:
        key = next(iter(json.loads(text)["weight_map"]))
        text = text.replace(f'"{key}":', f'"{key}": "model-00009-of-00009.safetensors", "{key}":', 1)
    (bad / name).write_text(text)
    _every_reader_refuses(bad, tmp_path / "out", monkeypatch, capsys, f"{bad / name}: ", f"gives {key!r} twice")


HUGE = 10**400  # JSON allows it; no tensor size or position reaches 2**63


@pytest.mark.parametrize(
    ("key", "edit"),
    [
        ("sliding_window", lambda t: HUGE),
        ("moe_intermediate_size", lambda t: HUGE),
    ],
    ids=["sliding_window", "moe_intermediate_size"],
)
def test_config_sizes_past_any_tensor_are_refused(src, tmp_path, monkeypatch, capsys, key, edit):
    """A config.json int past 2**63 - 1 is a clean error naming the key: `plan` ended in a traceback
    (OverflowError) printing its memory table for a sliding_window of 10**400, and plan, shard and export all did
    building the catalogue for such a moe_intermediate_size."""
    bad = copy_of(src, tmp_path / "bad")
    edit_config(bad, lambda c: c["text_config"].update({key: edit(c["text_config"])}) or c)
    digits = len(str(HUGE))  # 401: the message counts the number's digits
    _every_reader_refuses(
        bad, tmp_path / "out", monkeypatch, capsys, f"text_config.{key} holds a {digits}-digit number", "2**63 - 1"
    )


def _reference_of_an_image_prompt(bad: Path, tmp_path: Path, monkeypatch, capsys) -> tuple[int, str]:
    """reference-logits of `bad` with one text-and-image prompt: -> (exit code, stderr); no reference is left."""
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 10, 10)).save(tmp_path / "a.png")
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "hello", "image": "a.png"}) + "\n")
    ref = tmp_path / "ref.safetensors"
    code, _, err = run_cli(
        monkeypatch, capsys, "reference-logits", str(bad), str(ref), "--prompts", str(tmp_path / "p.jsonl")
    )
    assert not ref.exists()
    return code, err


@pytest.mark.parametrize("token", [-1, 256], ids=["-1", "the vocabulary's size"])
def test_an_image_prompt_needs_an_image_token_inside_the_vocabulary(src, tmp_path, monkeypatch, capsys, token):
    """Every position of an image span holds image_token_id, which is embedded before the image replaces it: with
    an id outside the vocabulary (256 ids here) reference-logits of an image prompt ended in a traceback
    (IndexError in the embedding) for -1, and for an id past the vocabulary in an error blaming the prompts'
    token ids for the Engram hash. Both are now an input error naming the prompt, the image and the key."""
    bad = copy_of(src, tmp_path / "bad")
    edit_config(bad, lambda c: c.update(image_token_id=token) or c)
    code, err = _reference_of_an_image_prompt(bad, tmp_path, monkeypatch, capsys)
    assert_clean_error(code, err, "p.jsonl:1: image ", f"image_token_id {token} is not a token id (0..255)")


@pytest.mark.parametrize("token", [252, 250])  # 250: the first id past the tokenizer's
def test_an_image_prompt_needs_an_image_token_the_engram_tokenizer_has(src, tmp_path, monkeypatch, capsys, token):
    """The Engram hash maps every position's id through the token map of tokenizer.json, an image span's too (as
    upstream's engram.py does): a vocabulary padded past the tokenizer (256 ids, the tokenizer's 250) with
    config.json's image_token_id 252 between them ended reference-logits of an image prompt in "token id 252
    reached the Engram hash ... give prompts of the tokenizer's ids", though the prompt held no such id. Now an
    input error naming the prompt, the image, the key and the tokenizer's ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    bad = copy_of(src, tmp_path / "bad")
    edit_config(bad, lambda c: c.update(image_token_id=token) or c)
    folded = json.loads((bad / "config.json").read_text())["text_config"]["engram_compressed_vocab_size"]
    words = {" " * (i // folded) + f"t{i % folded}": i for i in range(250)}  # tiny_ckpt's tokenizer, 250 ids
    Tokenizer(WordLevel(words, unk_token="t0")).save(str(bad / "tokenizer.json"))
    code, err = _reference_of_an_image_prompt(bad, tmp_path, monkeypatch, capsys)
    assert_clean_error(
        code,
        err,
        "p.jsonl:1: image ",
        f"config.json's image_token_id {token}",
        f"the 250 ids of {bad / 'tokenizer.json'}",
    )
    assert "give prompts of" not in err, err


def test_a_vision_tower_without_room_for_an_image_is_refused(src, tmp_path, monkeypatch, capsys):
    """max_image_tokens 0 in a model with a vision tower (a zero size of a part the model has): plan, shard and
    export took it, and reference-logits of an image prompt said `image ...: math domain error`, naming the
    image, not the key. Now every reader refuses it naming the key."""
    bad = copy_of(src, tmp_path / "bad")
    edit_config(bad, lambda c: c["vision_config"].update(max_image_tokens=0) or c)
    message = "vision_config.max_image_tokens = 0, expected a positive number"
    code, err = _reference_of_an_image_prompt(bad, tmp_path, monkeypatch, capsys)
    assert_clean_error(code, err, f"{bad / 'config.json'}: ", message)
    _every_reader_refuses(bad, tmp_path / "out", monkeypatch, capsys, f"{bad / 'config.json'}: ", message)


@pytest.mark.parametrize(
    ("key", "value"),
    [("rope_theta", 0), ("rope_theta", -5.0), ("max_wh_ratio", 0), ("max_wh_ratio", -1.0)],
    ids=["rope_theta-0", "rope_theta-negative", "max_wh_ratio-0", "max_wh_ratio-negative"],
)
def test_a_vision_value_no_image_can_run_with_is_refused(src, tmp_path, monkeypatch, capsys, key, value):
    """A vision rope base or width/height ratio of 0 or less in a model with a vision tower: plan, shard and
    export took it, and reference-logits of an image prompt then blamed the source's weights for NaN logits
    ('a NaN or Inf weight in the source, or an overflow': 1 / theta**x of a base of 0 or less) or the image
    ('image ...: height and width must be > 0': every image cut to width 0). Now every reader refuses it
    naming the key, as the README promises of a theta not positive. (The image token is moved into this
    source's 256 ids, so that the image prompt reaches the vision tower.)"""
    bad = copy_of(src, tmp_path / "bad")
    edit_config(bad, lambda c: c["vision_config"].update({key: value}) or c.update(image_token_id=250) or c)
    message = f"vision_config.{key} = {value!r}, expected a positive number"
    code, err = _reference_of_an_image_prompt(bad, tmp_path, monkeypatch, capsys)
    assert_clean_error(code, err, f"{bad / 'config.json'}: ", message)
    _every_reader_refuses(bad, tmp_path / "out", monkeypatch, capsys, f"{bad / 'config.json'}: ", message)


def _every_reader_refuses(bad: Path, out: Path, monkeypatch, capsys, *needles: str) -> None:
    """plan, shard and export of the source `bad` each a clean error with `needles`; nothing made at `out`."""
    for command in (["plan", str(bad), "--tp", "2"], ["shard", str(bad), str(out), "--tp", "2"],
                    ["export", str(bad), str(out), "--format", "bf16"]):  # fmt: skip
        code, _, err = run_cli(monkeypatch, capsys, *command)
        assert_clean_error(code, err, *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    "name",
    ["model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "model-00002-of-00003.safetensors"],
)
@pytest.mark.parametrize("target", ["gone", "loop"])
def test_a_link_to_no_file_at_the_index_or_a_tokenizer_is_named(src, tmp_path, monkeypatch, capsys, name, target):
    """A link at the index's, a tokenizer file's or a shard's name that leads to no file (a deleted blob of the HF
    cache, a link to itself) is a clean error naming it (exit 2), and nothing is made at OUT: plan, shard and export
    took it for no file there, skipping the index's check of the shards (exit 0) or converting without the tokenizer
    with a warning that said the source has none; a shard's was "No such file or directory" of a name `ls` lists."""
    bad = copy_of(src, tmp_path / "bad")
    (bad / name).unlink()
    (bad / name).symlink_to(bad / name if target == "loop" else tmp_path / "nowhere" / name)
    _every_reader_refuses(bad, tmp_path / "out", monkeypatch, capsys, f"{bad}: {name}: a link that leads to no file")


def test_an_output_the_system_refuses_is_an_error_not_a_traceback(src, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("x")
    for command in (
        ["shard", str(src), str(tmp_path / "a_file" / "out")],
        ["make-tiny", str(tmp_path / "a_file" / "t")],
    ):
        code, _, err = run_cli(monkeypatch, capsys, *command)
        assert_clean_error(code, err, str(tmp_path / "a_file"), "Not a directory")
    # the system's own refusal, from the first look at OUT (an OSError, not one of our checks)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / ("x" * 300)))
    assert_clean_error(code, err, "File name too long")


@pytest.mark.parametrize("repo", ["a/b/c", "../x"])
def test_download_of_something_that_is_no_repo_id(tmp_path, monkeypatch, capsys, repo):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(monkeypatch, capsys, "download", repo, "--local-dir", str(tmp_path / "d"))
    assert_clean_error(code, err, f"{repo}: not a Hub repo id")
    assert "downloading" not in err and not (tmp_path / "d").exists()


def test_download_of_a_repo_id_with_its_revision_points_at_the_option(tmp_path, monkeypatch, capsys):
    """`download org/m@v1` (the SRC syntax of plan, shard and export) said only "not a Hub repo id (Repo id must
    use alphanumeric chars ...)"; it now names the option that takes the revision."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(monkeypatch, capsys, "download", "org/m@v1", "--local-dir", str(tmp_path / "d"))
    assert_clean_error(code, err, "org/m@v1: a revision goes in --revision here: `download org/m --revision v1`")
    assert not (tmp_path / "d").exists()


def test_verify_of_an_incomplete_or_empty_folder_is_an_input_error(src, sharded, tmp_path, monkeypatch, capsys):
    incomplete = copy_of(sharded, tmp_path / "incomplete")
    (incomplete / "model1-mp2.safetensors").unlink()
    ref = tmp_path / "ref.safetensors"  # never read: the rank files are checked first
    ref.write_bytes(b"")
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(incomplete), "--reference-logits", str(ref))
    assert_clean_error(code, err, "tp 2 needs 2 rank files; missing model1-mp2.safetensors")
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(src), "--reference-logits", str(ref))
    assert_clean_error(code, err, f"{src}: no rank files")
    out = tmp_path / "streamed.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(incomplete), str(out), "--stream-layers")
    assert_clean_error(code, err, "tp 2 needs 2 rank files; missing model1-mp2.safetensors")
    assert not out.exists()


def test_rank_files_given_as_a_source(sharded, tmp_path, monkeypatch, capsys):
    for command in (["plan", str(sharded)], ["reference-logits", str(sharded), str(tmp_path / "r.safetensors")]):
        code, _, err = run_cli(monkeypatch, capsys, *command)
        assert_clean_error(code, err, f"{sharded}: holds rank files (model0-mp2.safetensors", "--stream-layers")
        assert "duplicated" not in err
    assert not (tmp_path / "r.safetensors").exists()


def test_conflicting_or_empty_options(src, sharded, tmp_path, monkeypatch, capsys):
    out = copy_of(sharded, tmp_path / "out")
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    for dry_run in ([], ["--dry-run"]):
        code, _, err = run_cli(
            monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", "--resume", "--overwrite", *dry_run
        )
        assert_clean_error(code, err, "--resume and --overwrite: pick one")
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "o2"), "--tp", "2", "--ranks", "")
    assert_clean_error(code, err, "--ranks ''")
    # a rank twice (1,1 for 1,0): was written once without a word, the rank meant left unwritten (an audit)
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "o2"), "--tp", "2", "--ranks", "1,1")
    assert_clean_error(code, err, "--ranks [1]: given more than once")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("value", ["٠", "1_0", " 1", "+1", "0x1"])
@pytest.mark.parametrize("option", ["--ranks", "--tp", "--workers"])
def test_numbers_are_written_in_ascii_digits(src, tmp_path, monkeypatch, capsys, option, value):
    """int() takes "٠" (Arabic-Indic zero) as 0 and "1_0" as 10: `--ranks ٠` converted rank 0 and `--tp 1_0`
    a tp of 10. A number option now takes the digits 0-9 alone, and the run writes nothing."""
    args = {"--ranks": ["--tp", "2", "--ranks", value], "--tp": ["--tp", value], "--workers": ["--workers", value]}
    out = tmp_path / "o"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), *args[option])
    assert code == 2 and repr(value) in err and "digits 0-9" in err, err
    assert not out.exists()


def test_rank_files_of_another_tp_are_refused_on_resume_and_replaced_on_overwrite(src, sharded, tmp_path):
    out = copy_of(sharded, tmp_path / "out")
    res = subprocess.run([*CLI, "shard", str(src), str(out), "--tp", "4", "--resume"], capture_output=True, text=True)
    assert res.returncode == 2 and "holds files of another conversion (model0-mp2.safetensors" in res.stderr
    assert not list(out.glob("*-mp4.*"))
    subprocess.run([*CLI, "shard", str(src), str(out), "--tp", "4", "--overwrite"], check=True, capture_output=True)
    assert sorted(p.name for p in out.glob("model*")) == [f"model{r}-mp4.safetensors" for r in range(4)]
    assert done_records(out) == {f"model{r}-mp4.safetensors" for r in range(4)}
    assert subprocess.run([*CLI, "check", str(out)], capture_output=True).returncode == 0


def test_an_export_and_rank_files_never_share_a_folder(src, sharded, tmp_path):
    """export into a folder of rank files (and shard into an export's folder): refused on --resume, naming
    the other conversion's files; --overwrite removes them with their records. Before, both were kept beside
    the new files, `check` passed the mix and verify failed to load it."""
    out = copy_of(sharded, tmp_path / "out")
    export = [*CLI, "export", str(src), str(out), "--format", "bf16"]
    res = subprocess.run([*export, "--resume"], capture_output=True, text=True)
    assert res.returncode == 2 and "holds files of another conversion (hf_config.json, model0-mp2" in res.stderr
    assert not list(out.glob("model-*"))
    subprocess.run([*export, "--overwrite"], check=True, capture_output=True)
    assert not list(out.glob("*-mp2.*")) and not (out / "hf_config.json").exists()
    assert not [n for n in done_records(out) if "-mp2" in n]
    assert subprocess.run([*CLI, "check", str(out)], capture_output=True).returncode == 0

    shard = [*CLI, "shard", str(src), str(out), "--tp", "2"]
    res = subprocess.run([*shard, "--resume"], capture_output=True, text=True)
    assert res.returncode == 2 and "(model-00001-of-" in res.stderr
    subprocess.run([*shard, "--overwrite"], check=True, capture_output=True)
    assert sorted(p.name for p in out.glob("model*")) == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    assert done_records(out) == {"model0-mp2.safetensors", "model1-mp2.safetensors"}
    assert all(
        a.read_bytes() == b.read_bytes()
        for a, b in zip(sorted(out.glob("model*")), sorted(sharded.glob("model*")), strict=True)
    )


def test_resume_removes_the_temporaries_of_a_run_killed_while_writing_a_small_file(src, sharded, tmp_path):
    out = copy_of(sharded, tmp_path / "out")
    stale = [out / "tokenizer.json.4242.partial", out / DONE_DIR / "model0-mp2.safetensors.done.json.4242.partial"]
    for path in stale:
        path.write_text("half")
    kept = out / "model1-mp2.safetensors.partial"  # a rank file's partial is resume state, not a temporary
    users = out / "thesis.2024.partial"  # a name of that shape whose target no run of ours writes
    users.write_text("a year of work")
    res = subprocess.run([*CLI, "shard", str(src), str(out), "--tp", "2", "--resume", "--json"], capture_output=True)
    assert res.returncode == 0, res.stderr
    assert not any(p.exists() for p in stale) and not kept.exists()
    assert users.read_text() == "a year of work"
    assert subprocess.run([*CLI, "check", str(out)], capture_output=True).returncode == 0


@pytest.mark.parametrize("how", [["shard", "--tp", "2", "--overwrite"], ["export", "--format", "bf16", "--resume"]])
def test_a_users_file_named_like_a_temporary_is_never_removed(src, tmp_path, how):
    """`remove_stale_temporaries` removed every NAME.DIGITS.partial of OUT; a run that holds OUT alone now
    removes only those of the small files it writes itself (tokenizer, configs, index, manifest)."""
    out = tmp_path / "out"
    out.mkdir()
    users = [out / "thesis.2024.partial", out / "video.1.partial"]
    for path in users:
        path.write_text("mine")
    res = subprocess.run([*CLI, how[0], str(src), str(out), *how[1:]], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert all(p.read_text() == "mine" for p in users)


def test_a_source_without_a_tokenizer_is_said_and_verify_names_what_is_missing(src, tmp_path, monkeypatch, capsys):
    bare = copy_of(src, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    out = tmp_path / "out"
    for dry_run in (["--dry-run"], []):  # the dry run said nothing of it (an audit)
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(bare), str(out), "--tp", "2", *dry_run)
        assert code == 0 and f"warning: {bare}: no tokenizer.json, so {out} will have none either" in err
    code, _, err = run_cli(
        monkeypatch, capsys, "export", str(bare), str(tmp_path / "hf"), "--format", "bf16", "--dry-run"
    )
    assert code == 0 and "no tokenizer.json" in err, err
    code, _, err = run_cli(monkeypatch, capsys, "export", str(bare), str(tmp_path / "hf"), "--format", "bf16")
    assert code == 0 and "no tokenizer.json" in err and "rank files" not in err, err  # an export writes none
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(bare), str(tmp_path / "r.safetensors"))
    assert_clean_error(code, err, f"{bare / 'tokenizer.json'}: not found; this model has Engram layers")


def test_the_advice_for_a_missing_tokenizer_lists_it_when_followed(src, tmp_path, monkeypatch, capsys):
    """`manifest OUT` of shares converted from a source without tokenizer.json advised "put the model's
    tokenizer.json beside the weights": put beside the rank files, `manifest OUT` then refused it (exit 2, "no
    fragment records it (no share wrote it)") and `check` left it unchecked. The advice (shard's and export's
    too) is what lists it: the tokenizer in SRC, the conversion into OUT again with --resume."""
    bare = copy_of(src, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    a, b = tmp_path / "a", tmp_path / "b"
    for out, rank in ((a, "0"), (b, "1")):
        code, _, err = run_cli(monkeypatch, capsys, "shard", str(bare), str(out), "--tp", "2", "--ranks", rank)
        assert code == 0, err
    for name in ("model1-mp2.safetensors", "manifest-fragment-mp2-r1.json"):
        (a / name).write_bytes((b / name).read_bytes())
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(a))
    advice = "put the model's tokenizer.json in SRC and convert into OUT again with --resume"
    assert code == 0 and f"warning: {a}: no tokenizer.json, so the manifest lists none" in err and advice in err, err
    (bare / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())  # as advised
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(bare), str(a), "--tp", "2", "--resume")
    assert code == 0 and "warning" not in err, err
    assert "tokenizer.json" in json.loads((a / "manifest.json").read_text())["files"]
    code, _, err = run_cli(monkeypatch, capsys, "check", str(a))
    assert code == 0 and "not checked" not in err, err


def test_an_unreadable_tokenizer_is_named(src, tmp_path, monkeypatch, capsys):
    bad = copy_of(src, tmp_path / "bad")
    (bad / "tokenizer.json").write_text("{not json")
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(bad), str(tmp_path / "r.safetensors"))
    assert_clean_error(code, err, f"{bad / 'tokenizer.json'}: not a readable tokenizer.json")
    assert not (tmp_path / "r.safetensors").exists()


def test_demo_refuses_a_tp_before_writing_anything(tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(tmp_path / "d"), "--tp", "3")
    assert_clean_error(code, err, "the demo's tiny model: the model cannot run at tp 3")
    assert not (tmp_path / "d").exists()


def test_demo_into_a_link_to_nothing_or_a_file_is_named(tmp_path, monkeypatch, capsys):
    """`demo DIR` where DIR is a link to a path that does not exist said only "DIR: File exists" (mkdir's
    words); shard, export and make-tiny name the link and its target. Now demo does too, and a file at DIR is
    named as no folder; nothing is written."""
    dang = tmp_path / "dang"
    dang.symlink_to(tmp_path / "gone")
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(dang))
    assert_clean_error(code, err, f"{dang}: a link to {tmp_path / 'gone'}, which does not exist")
    (tmp_path / "afile").write_text("mine")
    code, _, err = run_cli(monkeypatch, capsys, "demo", str(tmp_path / "afile"))
    assert_clean_error(code, err, f"{tmp_path / 'afile'}: Not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dang"] and not (tmp_path / "gone").exists()


def test_made_files_have_the_mode_of_a_new_file(tmp_path, monkeypatch, capsys):
    old = os.umask(0o027)
    try:
        assert new_file_mode() == 0o640
        code, _, _ = run_cli(monkeypatch, capsys, "make-tiny", str(tmp_path / "t"), "--no-vision")
    finally:
        os.umask(old)
    assert code == 0
    modes = {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "t").glob("*.safetensors")}
    assert modes == {0o640}  # safetensors' save_file alone makes 0600


def test_every_file_shard_and_export_write_has_the_mode_of_a_new_file(src, tmp_path, monkeypatch, capsys):
    """umask 002 (a group's shared folder): every file shard and export write (rank files, manifest, records,
    locks) is group-writable, as make-tiny's and reference-logits' files are; they were made 0644 whatever the
    umask, so another member of the group could not take the folder's lock to --resume a stopped run."""
    old = os.umask(0o002)
    try:
        shard = run_cli(monkeypatch, capsys, "shard", str(src), str(tmp_path / "s"), "--tp", "2")[0]
        export = run_cli(monkeypatch, capsys, "export", str(src), str(tmp_path / "e"), "--format", "bf16")[0]
    finally:
        os.umask(old)
    assert (shard, export) == (0, 0)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert {name for name, mode in modes.items() if mode not in (0o664, 0o775)} == set()


@pytest.mark.slow
def test_ctrl_c_of_the_run_alone_stops_every_worker_at_once_and_resume_finishes(src, sharded, tmp_path):
    """`kill -INT` of the run (not its process group): before, the workers ran on, finished their files
    and the one each had queued, and the run waited for them."""
    out = tmp_path / "out"
    env = {**os.environ, "DSV41_CONVERT_TEST_THROTTLE_S": "0.05"}
    cmd = [*CLI, "shard", str(src), str(out), "--tp", "8", "--workers", "2", "--buffered-io", "--json"]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    )
    deadline = time.monotonic() + 120
    while not any(partial_sizes(out)) and time.monotonic() < deadline:
        time.sleep(0.02)
    started = {p.name.removesuffix(".partial") for p in out.glob("model*.partial")} | done_records(out)
    os.kill(proc.pid, signal.SIGINT)
    t = time.monotonic()
    doc, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted; what is on disk is kept" in err and "Traceback" not in err
    assert time.monotonic() - t < 10  # the throttled files take over a minute each
    assert json.loads(doc) == {"ok": False, "exit_code": 130, "error": err.strip().removeprefix("error: ")}
    time.sleep(1)  # no worker left to write anything
    written = {p.name.removesuffix(".partial") for p in out.glob("model*")}
    # the run forwards the signal at its pool loop's next check (<= 0.2 s), and in that window the worker
    # not yet writing may begin the file it was handed (seen under load, before and after 139a3e2): one
    # file at most; the fault (workers running on into their queued files) adds one per worker and minutes
    assert len(written - started) <= 1 and len(written) <= 3, (written, started)
    assert not (out / "manifest.json").exists()
    res = subprocess.run([*CLI, "shard", str(src), str(out), "--tp", "8", "--resume"], capture_output=True)
    assert res.returncode == 0, res.stderr
    clean = tmp_path / "clean"
    subprocess.run([*CLI, "shard", str(src), str(clean), "--tp", "8"], check=True, capture_output=True)
    for p in clean.glob("model*"):
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name


@pytest.mark.slow
def test_sigterm_stops_the_run_as_ctrl_c_does_and_resume_finishes(src, tmp_path):
    """`kill` (SIGTERM) of the run: before, it died at once, its workers with it, and multiprocessing's
    tracker warned of 8 leaked semaphores; now the orderly stop of Ctrl-C, exit 143."""
    out = tmp_path / "out"
    env = {**os.environ, "DSV41_CONVERT_TEST_THROTTLE_S": "0.05"}
    cmd = [*CLI, "shard", str(src), str(out), "--tp", "8", "--workers", "2", "--buffered-io", "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(partial_sizes(out, "model*.partial")) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.terminate()
    doc, err = proc.communicate(timeout=60)  # the pipes close: no process of the run holds them any more
    message = "terminated (SIGTERM); what is on disk is kept: shard continues it with --resume"
    assert proc.returncode == 143 and err.strip() == f"error: {message}", err
    assert json.loads(doc) == {"ok": False, "exit_code": 143, "error": message}
    assert not (out / "manifest.json").exists()
    res = subprocess.run([*CLI, "shard", str(src), str(out), "--tp", "8", "--resume"], capture_output=True)
    assert res.returncode == 0, res.stderr
    assert subprocess.run([*CLI, "check", str(out)], capture_output=True).returncode == 0


def test_a_failed_check_document_carries_its_exit_code(sharded, tmp_path, monkeypatch, capsys):
    """`check --json` of a corrupt file exits 1 with {"ok": false, ...} and no `exit_code`; under a torchrun
    launch (whose own exit is 1 for any failed process) README says to read `exit_code` from the documents and
    takes one without it for a success, 0: a pipeline so reading took the corrupt folder for checked. The
    document now carries the run's exit code, as verify's does: 1 for a failed check, 0 for a held one."""
    bad = copy_of(sharded, tmp_path / "bad")
    with open(bad / "model1-mp2.safetensors", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    for env in ({}, {"RANK": "1", "WORLD_SIZE": "2"}):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code, out, _ = run_cli(monkeypatch, capsys, "check", str(bad), "--json")
        doc = json.loads(out)
        assert code == 1 and doc["ok"] is False and doc["exit_code"] == 1, out
        code, out, _ = run_cli(monkeypatch, capsys, "check", str(sharded), "--json")
        doc = json.loads(out)
        assert code == 0 and doc["ok"] is True and doc["exit_code"] == 0, out


def test_an_input_error_with_json_is_also_a_document_on_stdout(sharded, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "check", str(tmp_path / "nope"), "--json")
    assert_clean_error(code, err, "nope: no such folder")
    assert json.loads(out) == {"ok": False, "exit_code": 2, "error": err.removeprefix("error: ")}
    code, out, err = run_cli(monkeypatch, capsys, "check", str(tmp_path / "nope"))
    assert code == 2 and out == ""


@pytest.mark.parametrize("size", [-1, 10**400, True], ids=["negative", "past-any-file", "bool"])
@pytest.mark.parametrize("command", ["check", "manifest"])
def test_a_manifest_recording_no_file_size_is_refused_as_damaged(sharded, tmp_path, monkeypatch, capsys, size, command):
    """A manifest.json whose `size` of a file is no file size is damaged, an input error naming the manifest and
    the entry (exit 2), as any entry without a size is: a size of 10**400 ended `check` and `manifest` in a
    traceback (OverflowError) drawing the byte progress, and -1 or true was reported as a file that differs
    (exit 1) by `check`. The folder is left as it was."""
    bad = copy_of(sharded, tmp_path / "bad")
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"]["model0-mp2.safetensors"]["size"] = size
    (bad / "manifest.json").write_text(json.dumps(manifest))
    before = {p.name: p.read_bytes() for p in bad.iterdir() if p.is_file()}
    code, _, err = run_cli(monkeypatch, capsys, command, str(bad))
    assert_clean_error(code, err, f"{bad / 'manifest.json'}: entry 'model0-mp2.safetensors'")
    assert {p.name: p.read_bytes() for p in bad.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("index", [True, False])
def test_manifest_of_a_source_folder_writes_nothing_there(src, tmp_path, monkeypatch, capsys, index):
    """`manifest SRC` on a Hugging Face checkpoint (nothing to merge) says what the folder is and leaves it
    as it was: no lock file, no done-records folder. Without an index (one model.safetensors, or any folder
    no run of ours held) it made and removed its lock file there, moving the folder's mtime."""
    folder = src if index else copy_of(src, tmp_path / "no_index")
    if not index:
        (folder / "model.safetensors.index.json").unlink()
    before = sorted(p.relative_to(folder) for p in folder.rglob("*")), folder.stat().st_mtime_ns
    time.sleep(0.01)  # a file made and removed would move the folder's mtime
    code, _, err = run_cli(monkeypatch, capsys, "manifest", str(folder))
    assert_clean_error(code, err, "no manifest-fragment-*.json files")
    assert (sorted(p.relative_to(folder) for p in folder.rglob("*")), folder.stat().st_mtime_ns) == before


def test_verify_against_a_source_with_fp8_experts_is_refused_before_the_reference(
    src, sharded, tmp_path, monkeypatch, capsys
):
    """fp4 rank files against an `export --format fp8` checkpoint: no conversion of it holds them; said at
    once (it computed the whole reference, then failed to cut a [2, 8] scale into [64, 8])."""
    fp8 = tmp_path / "fp8"
    subprocess.run([*CLI, "export", str(src), str(fp8), "--format", "fp8"], check=True, capture_output=True)

    def no_compute(*_args, **_kwargs):
        raise AssertionError("the refusal must come before the reference")

    monkeypatch.setattr("dsv41_convert.verify.run.compute_reference", no_compute)
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(sharded), "--reference", str(fp8))
    assert_clean_error(code, err, f"{fp8}: its routed experts are fp8", "the source they were made from")
    # it also advised "or `export --format fp8-fp4` it first": that export holds the source's values, not its
    # bytes (the fp4 -> fp8 cast writes e2m1 -0 as +0), so verify against it FAILED this correct conversion
    assert "it first" not in err, err
    monkeypatch.undo()
    back = tmp_path / "fp8-fp4"
    subprocess.run([*CLI, "export", str(fp8), str(back), "--format", "fp8-fp4"], check=True, capture_output=True)
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(sharded), "--reference", str(back))
    assert code == 1 and "twin weights" in out, out + err


def test_an_edited_config_of_the_rank_files_is_named_not_the_reference(sharded, tmp_path, monkeypatch, capsys):
    """vocab_size changed in OUT/config.json: the error names that file against the rank files' shapes (it
    blamed the reference file's logits)."""
    bad = copy_of(sharded, tmp_path / "bad")
    edit_config(bad, lambda c: c | {"vocab_size": c["vocab_size"] * 2})
    ref = tmp_path / "unused.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(bad), "--reference-logits", str(ref))
    assert_clean_error(code, err, f"{bad / 'config.json'}: vocab_size", "not the config these rank files were written")


@pytest.mark.parametrize("command", [["check"], ["verify", "--reference-logits", "r.safetensors"]])
def test_a_folder_that_does_not_exist_is_called_so(tmp_path, monkeypatch, capsys, command):
    missing = tmp_path / "nowhere"
    code, _, err = run_cli(monkeypatch, capsys, command[0], str(missing), *command[1:])
    assert_clean_error(code, err, f"{missing}: no such folder")


def test_reference_at_a_tp_the_model_cannot_run_is_refused_before_the_launch(src, tmp_path, monkeypatch, capsys):
    def no_launch(*_args, **_kwargs):
        raise AssertionError("refused before the ranks start")

    monkeypatch.setattr("dsv41_convert.verify.reference.launch", no_launch)
    out = tmp_path / "new" / "deep" / "r.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--tp", "3")
    assert_clean_error(code, err, f"{src / 'config.json'}: the model cannot run at tp 3")
    assert "rank 0:" not in err and not (tmp_path / "new").exists()  # no folders made for it (an audit)


@pytest.mark.parametrize("command", [["shard", "OUT", "--tp", "2"], ["export", "OUT", "--format", "bf16"]])
def test_dry_run_refuses_what_the_run_would(src, sharded, tmp_path, monkeypatch, capsys, command):
    """--dry-run said yes (exit 0) to an OUT inside SRC, a file, and a non-empty folder the run refuses."""
    (tmp_path / "afile").write_text("x")
    for out, said in [
        (src / "sub", "the output folder is the source folder"),
        (tmp_path / "afile", "exists and is not a folder"),
        (sharded, "not empty"),
    ]:
        args = [a.replace("OUT", str(out)) for a in command]
        code, _, err = run_cli(monkeypatch, capsys, args[0], str(src), *args[1:], "--dry-run")
        assert_clean_error(code, err, said)
    assert not (src / "sub").exists()
    resume = [a.replace("OUT", str(sharded)) for a in command]
    code, _, err = run_cli(monkeypatch, capsys, resume[0], str(src), *resume[1:], "--dry-run", "--resume")
    if command[0] == "shard":
        assert code == 0, err
    else:  # an export into rank files: the other conversion's files are named, as the run names them
        assert_clean_error(code, err, "holds files of another conversion")


@pytest.mark.parametrize("option", [["--decode-steps", "5"], ["--max-seq-len", "10"]])
def test_verify_options_a_reference_file_fixes_are_refused_with_it(sharded, tmp_path, monkeypatch, capsys, option):
    """--decode-steps / --max-seq-len with --reference-logits were ignored without a word (PASS)."""
    ref = tmp_path / "unused.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(sharded), "--reference-logits", str(ref), *option)
    assert_clean_error(code, err, f"{option[0]} go(es) with --reference SRC")


def test_no_replay_with_reference_src_is_refused(sharded, src, monkeypatch, capsys):
    """`verify --reference SRC --no-replay` ran as without it (no replay runs against SRC: the twin does), and said
    nothing of the option (a helper's hunt); refused now, before the reference is computed."""
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(sharded), "--reference", str(src), "--no-replay")
    assert_clean_error(code, err, "--no-replay goes with --reference-logits FILE")
    assert "reference: " not in err


def _session_processes(sid: int) -> list[str]:
    ps = subprocess.run(["ps", "-o", "pid=,stat=", "-s", str(sid)], capture_output=True, text=True).stdout.split("\n")
    return [line for line in ps if line.strip() and "Z" not in line.split()[-1]]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigint-run-alone", "kill-9"])
def test_verify_interrupted_leaves_no_rank_running(tmp_path, how):
    """SIGINT to the verify process alone (a supervisor's stop), or kill -9 of it: it exits and no rank or
    fork server outlives it (each dies with its parent: die_with.py). Before, a SIGINT as the ranks started
    could leave one rank and the server running, holding the caller's pipes (by hand: 1 of 3 runs signalled
    4 s after the start); this test's timing did not reproduce that on the old code, so it guards the
    behaviour rather than replaying the fault."""
    src, sharded, ref = tmp_path / "src", tmp_path / "mp2", tmp_path / "ref.safetensors"
    subprocess.run([*CLI, "make-tiny", str(src)], check=True, capture_output=True)  # its real tokenizer
    subprocess.run([*CLI, "shard", str(src), str(sharded), "--tp", "2"], check=True, capture_output=True)
    cmd = [*CLI, "reference-logits", str(src), str(ref), "--tp", "2", "--decode-steps", "1", "--threads", "2"]
    subprocess.run(cmd, check=True, capture_output=True)
    verify = [*CLI, "verify", str(sharded), "--reference-logits", str(ref), "--threads", "1"]  # then the teacher
    # output captured, as a supervisor does: every process holding the pipes must end for it to close
    proc = subprocess.Popen(
        verify, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=default_sigint
    )
    for line in proc.stderr:  # the signal as the ranks start (where the old code lost them)
        if line.startswith(b"converted:"):
            break
    os.kill(proc.pid, signal.SIGINT if how == "sigint-run-alone" else signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("the pipes stayed open: a rank or the fork server outlived verify") from None
    assert proc.returncode == (130 if how == "sigint-run-alone" else -9), err
    deadline = time.monotonic() + 10
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _session_processes(proc.pid)


@pytest.mark.parametrize("name", ["x[bold]y", "a[/]b", "[red]"])
def test_brackets_in_a_path_are_printed_as_they_are(src, tmp_path, monkeypatch, capsys, name):
    """Messages go through rich: a folder named `x[bold]y` was reported as `xy` (the markup eaten) and one
    with `[/]` in its name ended in a MarkupError traceback instead of the error."""
    folder = tmp_path / name
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder / "nope"))
    assert_clean_error(code, err, f"{folder / 'nope'}: no such folder")
    out = tmp_path / f"out{name}"
    code, printed, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2")
    assert code == 0 and f"shard {src} -> {out} (tp 2)" in err, err
    assert f"manifest: {out / 'manifest.json'}" in err and printed == f"{out.resolve()}\n", (printed, err)


@pytest.mark.parametrize(
    "command",
    [
        ["plan", "--tp", "2"],
        ["shard", "OUT", "--tp", "2", "--dry-run"],
        ["export", "OUT", "--format", "bf16", "--dry-run"],
    ],
)
def test_brackets_in_the_source_path_stay_in_the_plan_tables_title(src, tmp_path, monkeypatch, capsys, command):
    """The title of the table `plan` and the dry runs print names SRC: a folder named `y[b]z` was shown as
    `yz`, rich reading `[b]` as bold (and `[/]` in a name would end in a MarkupError)."""
    folder = copy_of(src, tmp_path / "y[b]z")
    args = [a.replace("OUT", str(tmp_path / "out")) for a in command]
    code, printed, err = run_cli(monkeypatch, capsys, args[0], str(folder), *args[1:])
    assert code == 0, err
    assert printed.splitlines()[0].startswith(f"{folder}  "), printed.splitlines()[0]


@pytest.mark.parametrize("name", ["x:100:y", "run:a:b"])
def test_emoji_codes_in_a_path_are_printed_as_they_are(src, tmp_path, monkeypatch, capsys, name):
    """rich replaces `:name:` emoji codes: `make-tiny x:100:y` printed the folder, the result line a script reads,
    as `x\U0001f4afy`, and every message and table title naming it the same (`run:a:b` as `run\U0001f170b`)."""
    folder = tmp_path / name
    code, printed, err = run_cli(monkeypatch, capsys, "make-tiny", str(folder))
    assert code == 0 and printed == f"{folder}\n", printed
    code, printed, err = run_cli(monkeypatch, capsys, "plan", str(folder), "--tp", "2")
    assert code == 0 and printed.splitlines()[0].startswith(f"{folder}  "), printed.splitlines()[0]
    code, _, err = run_cli(monkeypatch, capsys, "check", str(folder))
    assert_clean_error(code, err, f"{folder / 'manifest.json'}: not found; was {folder} written by")


@pytest.mark.parametrize("name", ["tab\tname", "cr\rname", "bell\aname"])
def test_the_result_line_is_the_path_byte_for_byte(tmp_path, monkeypatch, capsys, name):
    """The result on stdout (make-tiny's folder, check's verdict, download's folder, manifest's file) is what a
    script reads: rich rendered it, expanding a tab in the folder's name to spaces and dropping a carriage return
    or a bell, so the line named a folder that does not exist."""
    folder = tmp_path / name
    code, printed, _ = run_cli(monkeypatch, capsys, "make-tiny", str(folder))
    assert code == 0 and printed == f"{folder}\n", repr(printed)


@pytest.mark.parametrize("name", ["tab\tname", "cr\rname", "bell\aname", "x[bold]y:100:z"])
def test_messages_on_stderr_name_the_path_byte_for_byte(src, tmp_path, name):
    """An error, a warning or a line of progress on stderr (a log a script reads) went through rich, which expanded a
    tab in the path to spaces and dropped a carriage return or a bell: `error: <path>: no such folder` named a path
    that does not exist."""
    folder = tmp_path / name
    proc = subprocess.run([*CLI, "check", str(folder / "nope")], capture_output=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: {folder / 'nope'}: no such folder\n".encode(), proc.stderr  # before any progress
    out = tmp_path / f"out{name}"
    proc = subprocess.run([*CLI, "shard", str(src), str(out), "--tp", "2"], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"shard {src} -> {out} (tp 2)\n".encode()), proc.stderr
    assert proc.stderr.endswith(f"manifest: {out / 'manifest.json'}\n".encode()), proc.stderr


def test_a_source_folder_whose_name_is_not_utf8_converts(src, sharded, tmp_path):
    """Linux names are bytes: the tokenizers library takes a path only as UTF-8 text, so every command that
    checks the Engram tokenizer refused a whole checkpoint in a folder named b"bad\\xffname" with "not a
    readable tokenizer.json ('utf-8' codec can't encode character ...)", exit 2. The rank files are those of
    the same checkpoint under a plain name, byte for byte."""
    folder = copy_of(src, tmp_path / os.fsdecode(b"bad\xffname"))
    proc = subprocess.run([*CLI, "plan", str(folder), "--tp", "2"], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / os.fsdecode(b"out\xff")
    proc = subprocess.run([*CLI, "shard", str(folder), str(out), "--tp", "2"], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        name = f"model{rank}-mp2.safetensors"
        assert (out / name).read_bytes() == (sharded / name).read_bytes(), name


_INTERRUPT_AFTER_A_WORKER_STARTS = """
import sys
import multiprocessing.process as mp_process
from dsv41_convert import cli, interrupts

start = mp_process.BaseProcess.start

def start_then_signal(self):
    worker = getattr(self._target, "__name__", "") == "_process_worker"  # start() drops _target
    start(self)
    if worker:
        mp_process.BaseProcess.start = start
        interrupts.interrupt()  # what the CLI's signal handler runs, here between the start and the pool's record

mp_process.BaseProcess.start = start_then_signal
sys.argv = ["dsv41-convert", *sys.argv[1:]]
cli.main()
"""


def test_a_signal_while_the_pool_starts_its_workers_never_hangs_the_run(src, tmp_path):
    """SIGTERM or Ctrl-C while the pool started its workers (an audit: `export --workers 2` hung in 3 to 4 of
    15 tries with the signal at 0.6-1.6 s, holding OUT's lock, printing nothing): a worker started but not yet
    recorded by the pool was never ended, and the fork server's stop waited for it. Now the run stops, exit
    130, and --resume finishes it."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", _INTERRUPT_AFTER_A_WORKER_STARTS, "export", str(src), str(out), "--format", "bf16"]
    try:
        run = subprocess.run([*cmd, "--workers", "2", "--json"], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        subprocess.run(["pkill", "-KILL", "-f", str(out)], check=False)
        pytest.fail("the run hung after the signal")
    assert run.returncode == 130, run.stderr
    assert json.loads(run.stdout)["exit_code"] == 130 and "Traceback" not in run.stderr
    resumed = subprocess.run([*CLI, "export", str(src), str(out), "--format", "bf16", "--resume"], capture_output=True)
    assert resumed.returncode == 0, resumed.stderr
    assert subprocess.run([*CLI, "check", str(out)], capture_output=True).returncode == 0


@pytest.mark.slow
def test_sigterm_of_an_export_with_workers_never_hangs_it(src, tmp_path):
    """`export BF16 OUT --format fp8-fp4 --workers 2`, SIGTERM once 1..4 files exist: before, a worker's
    KeyboardInterrupt could land inside a queue operation and its cleanup then waited forever, the run
    holding OUT's lock (an audit: 5 of 10 tries; here 1 of 10). Every run must now stop, exit 143."""
    bf16 = tmp_path / "bf16"
    subprocess.run([*CLI, "export", str(src), str(bf16), "--format", "bf16"], check=True, capture_output=True)
    for round_ in range(4):
        out = tmp_path / f"out{round_}"
        cmd = [*CLI, "export", str(bf16), str(out), "--format", "fp8-fp4", "--workers", "2"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while len(list(out.glob("*safetensors*"))) <= round_ and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
            proc.kill()
            proc.communicate()
            pytest.fail(f"round {round_}: the run hung after SIGTERM")
        assert proc.returncode in (143, 0), (round_, proc.returncode, err)  # 0: it had finished first


@pytest.fixture(scope="module")
def model_src(tmp_path_factory) -> Path:
    """A tiny source with a working tokenizer (the model runs on it: reference-logits)."""
    from dsv41_convert.synth.presets import TINY
    from dsv41_convert.synth.write import write_checkpoint

    root = tmp_path_factory.mktemp("model-src") / "src"
    write_checkpoint(root, TINY, seed=0, quantized=True, vision=False)
    return root


def _nan_in(src: Path, to: Path, name: str, value: bytes = b"\x00\x00\xc0\x7f") -> Path:
    """A copy of `src` whose float32 tensor `name` starts with a NaN (or with the bytes `value`)."""
    from dsv41_convert.store.safetensors_header import read_header

    folder = copy_of(src, to)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    info = read_header(folder / index[name]).tensors[name]
    with open(folder / index[name], "r+b") as f:
        f.seek(info.begin)
        f.write(value)
    return folder


@pytest.mark.parametrize("extra", [[], ["--stream-layers"]])
def test_reference_logits_refuses_to_write_non_finite_outputs(model_src, tmp_path, monkeypatch, capsys, extra):
    """A NaN weight in the source gave an all-NaN reference file and exit 0; verify then refused the file, naming
    no source tensor (an audit). Now exit 2 naming the source, nothing written: the NaN itself where the source
    holds one (as shard names it), the outputs where finite weights overflow (bf16's largest in a norm here)."""
    out = tmp_path / "ref.safetensors"
    bad = _nan_in(model_src, tmp_path / "nan", "layers.2.hc_attn_scale")
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(bad), str(out), "--decode-steps", "1", *extra)
    assert_clean_error(code, err, "layers.2.hc_attn_scale: found nan at index [0] in F32", "check the source tensor")
    huge = _nan_in(model_src, tmp_path / "huge", "layers.0.attn_norm.weight", b"\x7f\x7f" * 4)
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(huge), str(out), "--decode-steps", "1", *extra)
    assert_clean_error(code, err, f"{huge}: the model computed non-finite outputs", "nothing written")
    assert not out.exists() and not list(tmp_path.glob("ref.safetensors*"))


def test_reference_logits_on_a_full_disk_is_an_error_naming_the_file(model_src, tmp_path):
    """safetensors raises its own SafetensorError for ENOSPC / EFBIG: a traceback, exit 1, no JSON (an audit)."""
    from cli_run import run_cli_with_file_size_limit

    out = tmp_path / "ref.safetensors"
    args = ("reference-logits", str(model_src), str(out), "--decode-steps", "1", "--json")
    res = run_cli_with_file_size_limit(256 << 10, *args)
    doc = json.loads(res.stdout)
    assert res.returncode == 2 and str(out) in doc["error"] and "nothing written" in doc["error"], res.stderr
    assert "Traceback" not in res.stderr and not list(tmp_path.glob("ref.safetensors*"))


def test_a_prompt_file_that_is_not_utf8_is_named(src, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"text": "caf\xe9"}\n')
    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--prompts", str(prompts))
    assert_clean_error(code, err, f"{prompts}: not UTF-8 text at byte 13")
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_streamed_reference_on_cuda_without_cuda_is_an_input_error(src, tmp_path, monkeypatch, capsys):
    """The streamed path launches no ranks, so launch()'s CUDA check never ran: a RuntimeError traceback."""
    out = tmp_path / "ref.safetensors"
    args = ("reference-logits", str(src), str(out), "--stream-layers", "--device", "cuda")
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert_clean_error(code, err, "--device cuda: no CUDA device is available")
    assert not out.exists()


@pytest.mark.parametrize("extra", [["--tp", "2"], ["--as-converted"]])
def test_streamed_reference_with_tp_options_is_refused_before_anything(src, tmp_path, monkeypatch, capsys, extra):
    out = tmp_path / "new" / "r.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--stream-layers", *extra)
    assert_clean_error(code, err, "--stream-layers computes the tp-1 reference: no --tp or --as-converted")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("command", [["shard", "--tp", "2"], ["export", "--format", "fp8"]])
@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_source_changed_during_the_run_gives_no_rank_file_and_no_manifest(tmp_path, command, workers):
    """A source replaced mid-run (`make-tiny --overwrite`, a download fetching a shard again): the rank files
    mixed two models, each committed, with a manifest over them, exit 0 (an audit). Now each file's source is
    checked once its bytes are written, before it takes its name: exit 2 naming the shard, no file under its
    name, no manifest; --resume refuses, --overwrite converts the source as it now is."""
    src = make_tiny(tmp_path / "src", vision=False)
    out = tmp_path / "out"
    env = {**os.environ, "DSV41_CONVERT_TEST_THROTTLE_S": "0.005"}
    name, *options = command
    cmd = [*CLI, name, str(src), str(out), *options, "--workers", workers]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and list(out.glob("*.partial"))) and time.monotonic() < deadline:
        time.sleep(0.01)
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten: same size, a later time
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert f"{shard.name} changed (size or modification time) while this run read it" in " ".join(err.split()), err
    assert not (out / "manifest.json").exists()
    assert not [p.name for p in out.glob("*.safetensors")]  # every file begun after the change's stamp
    resume = subprocess.run([*CLI, name, str(src), str(out), *options, "--resume"], capture_output=True, text=True)
    assert resume.returncode == 2 and "changed (size or modification time) since a run began" in resume.stderr
    again = subprocess.run([*CLI, name, str(src), str(out), *options, "--overwrite"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert subprocess.run([*CLI, "check", str(out)], capture_output=True).returncode == 0


@pytest.mark.parametrize("kind", ["shard", "export"])
def test_a_source_changed_between_planning_and_writing_is_refused_before_any_byte(tmp_path, kind):
    """The run's baseline of the source's stamps was taken after the plan had read the headers: a shard
    replaced in between was read at the old file's offsets (a review). The plan keeps the stamps it read
    the headers under; the run compares them first."""
    from dsv41_convert.convert.execute import execute
    from dsv41_convert.convert.export import build_export_plan, export
    from dsv41_convert.convert.plan import build_plan
    from dsv41_convert.errors import OutputError

    src = make_tiny(tmp_path / "src", vision=False)
    out = tmp_path / "out"
    plan = build_plan(src, 2) if kind == "shard" else build_export_plan(src, "bf16")
    shard = sorted(src.glob("*.safetensors"))[-1]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(OutputError, match=rf"{shard.name} changed \(size or modification time\) since this run read"):
        execute(plan, out) if kind == "shard" else export(plan, out)
    assert not [p.name for p in out.glob("*")] if out.exists() else True


def test_overwrite_replaces_what_a_shard_stopped_by_an_input_error_left(src, tmp_path):
    """A shard stopped by an input error (a NaN weight) before its first rank file leaves config.json,
    hf_config.json and the tokenizer files in OUT. `export --resume` there said "pass --overwrite to replace
    them", and `export --overwrite` then refused hf_config.json as a file "no dsv41-convert run wrote there"
    (shard had written it): the user was sent in a circle. --overwrite now replaces it."""
    bad = copy_of(src, tmp_path / "bad")
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    name = "layers.0.attn.wq_a.weight"
    tensors = load_file(bad / index[name])
    tensors[name].view(torch.uint8).view(-1)[5] = 0x7F  # e4m3 NaN
    save_file(tensors, bad / index[name])
    out = tmp_path / "out"
    res = subprocess.run([*CLI, "shard", str(bad), str(out), "--tp", "2"], capture_output=True, text=True)
    assert res.returncode == 2 and "found nan" in res.stderr, res.stderr
    assert (out / "hf_config.json").is_file() and not list(out.glob("model*-mp2*"))
    res = subprocess.run([*CLI, "export", str(src), str(out), "--format", "bf16", "--overwrite"], capture_output=True)
    assert res.returncode == 0, res.stderr
    assert not (out / "hf_config.json").exists()
    assert subprocess.run([*CLI, "check", str(out)], capture_output=True).returncode == 0
