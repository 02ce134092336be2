"""verify.prompts: built-in prompts and the JSONL format."""

import json
from pathlib import Path

import pytest

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.synth.tokenizer import build_tokenizer
from dsv41_convert.verify.prompts import DEFAULT_LENGTH, default_prompts, load_prompts


def test_defaults_are_fixed_and_longer_than_the_tiny_window():
    a, b = default_prompts(512), default_prompts(512)
    assert a == b and len(a) == 3
    assert all(len(p.input_ids) == DEFAULT_LENGTH > 16 for p in a)
    assert all(3 <= t < 512 - 8 for p in a for t in p.input_ids)
    assert a[0].input_ids != a[1].input_ids


def test_jsonl_ids_and_text(tmp_path):
    tok = build_tokenizer(512)
    tok.save(str(tmp_path / "tokenizer.json"))
    lines = [json.dumps({"input_ids": [5, 6, 7]}), "", "# comment", json.dumps({"text": "hello world"})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    prompts = load_prompts(tmp_path / "p.jsonl", tmp_path / "tokenizer.json", 512)
    assert prompts[0].input_ids == (5, 6, 7) and prompts[0].label == "line-1"
    assert prompts[1].input_ids == tuple(tok.encode("hello world", add_special_tokens=False).ids)
    assert prompts[1].label == "line-4" and prompts[1].text == "hello world"


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", r"p.jsonl:1: not a JSON object"),
        (json.dumps({"input_ids": [1], "text": "x"}), r"exactly one of"),
        (json.dumps({"input_ids": [1, 600]}), r"\[600\] outside \[0, 512\): the vocabulary"),
        (json.dumps({"ids": [1]}), r"unknown keys \['ids'\]"),
        (json.dumps({"input_ids": []}), r"non-empty list"),
        (json.dumps({"input_ids": [1], "image": "a.png"}), r"image goes with a text prompt"),
        (json.dumps({"text": "hi"}), r"needs tokenizer.json"),
        (json.dumps({"input_ids": [1], "decode_ids": []}), r"decode_ids must be a non-empty list"),
        (json.dumps({"input_ids": [1], "decode_ids": [3, "x"]}), r"decode_ids must be a non-empty list"),
        (json.dumps({"input_ids": [1], "decode_ids": [3, 512]}), r"\[512\] outside \[0, 512\): the vocabulary"),
        (json.dumps({"input_ids": [True, 2, 3]}), r"input_ids must be a non-empty list of integers"),
        (json.dumps({"input_ids": [1], "decode_ids": [False]}), r"decode_ids must be a non-empty list"),
        (json.dumps({"text": "hi", "image": ""}), r"p.jsonl:1: image must be a path string"),  # was "Is a directory"
        # past Python's int-string limit: json raises a plain ValueError, which was a traceback (an audit)
        ('{"input_ids": [5, ' + "9" * 5000 + "]}", r"p.jsonl:1: not a JSON object"),
        # the first list was dropped without a word: json keeps a key's last value
        ('{"input_ids": [5, 6], "input_ids": [7]}', r"p.jsonl:1: gives 'input_ids' twice"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, match):
    (tmp_path / "p.jsonl").write_text(line + "\n")
    with pytest.raises(VerifyInputError, match=match):
        load_prompts(tmp_path / "p.jsonl", None, 512)


def test_unicode_line_breaks_inside_a_string_and_lone_surrogates(tmp_path):
    """A JSON string holding U+2028 (or \x1c, \x85) was cut into two "lines" and refused as not JSON; a lone
    surrogate (the escape \\ud800) crashed the tokenizer with a traceback (an audit)."""
    tok = build_tokenizer(512)
    tok.save(str(tmp_path / "tokenizer.json"))
    text = "a\u2028b\x1cc\x85d"
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": text}, ensure_ascii=False) + "\r\n")
    prompts = load_prompts(tmp_path / "p.jsonl", tmp_path / "tokenizer.json", 512)
    assert len(prompts) == 1 and prompts[0].text == text
    (tmp_path / "s.jsonl").write_text('{"text": "x\\ud800"}\n')
    with pytest.raises(VerifyInputError, match=r"s.jsonl:1: text is not valid Unicode \(surrogates not allowed"):
        load_prompts(tmp_path / "s.jsonl", tmp_path / "tokenizer.json", 512)
    (tmp_path / "s.jsonl").write_text('{"text": "x", "image": "cat\\ud800.png"}\n')  # a traceback in realpath
    with pytest.raises(VerifyInputError, match=r"s.jsonl:1: image is not valid Unicode"):
        load_prompts(tmp_path / "s.jsonl", tmp_path / "tokenizer.json", 512)
    (tmp_path / "s.jsonl").write_text('{"text": "x", "image": "a\\u0000b.png"}\n')  # "embedded null byte"
    with pytest.raises(VerifyInputError, match=r"s.jsonl:1: image holds a NUL character"):
        load_prompts(tmp_path / "s.jsonl", tmp_path / "tokenizer.json", 512)
    (tmp_path / "s.jsonl").write_text('{"text": "a\\u0000b"}\n')  # in text it tokenizes (a review)
    assert load_prompts(tmp_path / "s.jsonl", tmp_path / "tokenizer.json", 512)[0].text == "a\0b"


def test_empty_file(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n# only a comment\n")
    with pytest.raises(VerifyInputError, match="no prompts"):
        load_prompts(tmp_path / "p.jsonl", None, 512)


def test_decode_ids_are_kept(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": [5, 6], "decode_ids": [9, 8, 7]}) + "\n")
    (prompt,) = load_prompts(tmp_path / "p.jsonl", None, 512)
    assert prompt.input_ids == (5, 6) and prompt.decode_ids == (9, 8, 7)


def test_an_image_path_is_recorded_absolute(tmp_path, monkeypatch):
    """A relative image path was kept relative to the folder reference-logits ran in and resolved again
    against the folder verify ran in: another image, or none (an audit). It is now the file's absolute path."""
    tok = build_tokenizer(512)
    (tmp_path / "pd").mkdir()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "pd" / "p.jsonl").write_text(json.dumps({"text": "describe", "image": "red.png"}) + "\n")
    monkeypatch.chdir(tmp_path / "pd")
    prompts = load_prompts(tmp_path / "pd" / "p.jsonl", tmp_path / "tokenizer.json", 512)
    assert prompts[0].image == str((tmp_path / "pd" / "red.png").resolve())
    monkeypatch.chdir(tmp_path)
    prompts = load_prompts(Path("pd/p.jsonl"), tmp_path / "tokenizer.json", 512)
    assert prompts[0].image == str((tmp_path / "pd" / "red.png").resolve())


def test_a_prompt_file_or_image_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """A FIFO as --prompts FILE, or as a prompt's image, waited for a writer forever (an audit)."""
    import os

    from dsv41_convert.model.image_processor import open_image

    os.mkfifo(tmp_path / "p.jsonl")
    with pytest.raises(VerifyInputError, match=r"p.jsonl: not a regular file \(a FIFO"):
        load_prompts(tmp_path / "p.jsonl", None, 512)
    os.mkfifo(tmp_path / "cat.png")
    with pytest.raises(ValueError, match=r"cat.png: not a regular file \(a FIFO"):
        open_image(tmp_path / "cat.png")


def test_an_image_path_in_a_loop_of_links_is_named(tmp_path):
    """Path.resolve() raised RuntimeError (Python 3.11): a traceback, exit 1 (an audit)."""
    tok = build_tokenizer(512)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.png").symlink_to(tmp_path / "b.png")
    (tmp_path / "b.png").symlink_to(tmp_path / "a.png")
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "hello", "image": "a.png"}) + "\n")
    with pytest.raises(VerifyInputError, match=r"p.jsonl:1: image a.png: "):
        load_prompts(tmp_path / "p.jsonl", tmp_path / "tokenizer.json", 512)


def test_a_decompression_bomb_is_an_input_error(tmp_path, monkeypatch):
    """PIL's DecompressionBombError is no ValueError: a 20000 x 20000 PNG was a traceback, exit 1 (an audit)."""
    from PIL import Image

    from dsv41_convert.model.image_processor import open_image

    Image.new("RGB", (64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 4096 pixels: over twice the limit, as the bomb was
    with pytest.raises(ValueError, match="decompression-bomb limit"):
        open_image(tmp_path / "big.png")


def test_a_model_with_engram_takes_only_its_tokenizers_ids(tmp_path):
    """A vocabulary padded past the tokenizer (576 rows, 512 ids): a model with Engram layers maps each id through
    the tokenizer's token map, so the prompts' ids stay below 512, and a prompt file's id past it is refused
    naming the tokenizer; a model without Engram, or a tokenizer as long as the vocabulary, keeps vocab_size."""
    from dsv41_convert.verify.prompts import prompt_id_bound

    tokenizer = tmp_path / "tokenizer.json"
    build_tokenizer(512).save(str(tokenizer))
    bound, bound_by = prompt_id_bound(576, True, tokenizer)
    assert bound == 512 and str(tokenizer) in bound_by
    assert prompt_id_bound(576, False, tokenizer) == (576, "the vocabulary")
    assert prompt_id_bound(512, True, tokenizer) == (512, "the vocabulary")
    assert prompt_id_bound(576, True, None) == (576, "the vocabulary")
    assert all(t < 512 - 8 for p in default_prompts(bound) for t in p.input_ids)
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": [5, 540]}) + "\n")
    assert load_prompts(tmp_path / "p.jsonl", tokenizer, 576)[0].input_ids == (5, 540)
    with pytest.raises(VerifyInputError, match=r"\[540\] outside \[0, 512\): the 512 ids of .*tokenizer.json"):
        load_prompts(tmp_path / "p.jsonl", tokenizer, bound, bound_by)


def test_the_built_in_prompts_need_an_id_range_below_the_reserved_tail():
    """Ids are drawn from [3, vocab_size - 8): a vocabulary of 11 leaves none (refused, not a torch error), one
    of 12 leaves the id 3 alone."""
    with pytest.raises(VerifyInputError, match=r"^vocab_size 11 is too small for the built-in prompts"):
        default_prompts(11)
    assert {t for p in default_prompts(12) for t in p.input_ids} == {3}


@pytest.mark.parametrize("key", ["input_ids", "decode_ids"])
def test_a_negative_token_id_is_refused(tmp_path, key):
    """A negative id indexes the embedding from its end: the prompt ran on another token without a word."""
    line = {"input_ids": [5, 6], key: [7, -1]} if key == "decode_ids" else {"input_ids": [5, -1]}
    (tmp_path / "p.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(VerifyInputError, match=r"p.jsonl:1: token ids \[-1\] outside \[0, 512\): the vocabulary"):
        load_prompts(tmp_path / "p.jsonl", None, 512)


def test_a_reference_files_ids_past_the_bound_are_refused_naming_the_prompt():
    """verify takes its prompts from the reference file: ids outside [0, bound) (prompt or decode ids) reached
    the ranks and ended them in an IndexError (an audit)."""
    from dsv41_convert.verify.prompts import refuse_recorded_ids_past

    refuse_recorded_ids_past([("default-0", [0, 5, 511])], 512, "the vocabulary", "ref.safetensors")
    runs = [("default-0", [1, 2]), ("default-1", [3, 600, -2, 4])]
    said = r"^ref.safetensors: default-1: token ids \[600, -2\] outside \[0, 512\): the vocabulary$"
    with pytest.raises(VerifyInputError, match=said):
        refuse_recorded_ids_past(runs, 512, "the vocabulary", "ref.safetensors")


def test_a_text_that_tokenizes_to_nothing_is_kept_only_beside_an_image(tmp_path):
    """A tokenizer whose pre-tokenizer drops whitespace gives " " no token: alone that prompt is empty (refused),
    beside an image it is the image's prompt."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": " ", "image": "a.png"}) + "\n")
    (prompt,) = load_prompts(tmp_path / "p.jsonl", tmp_path / "tokenizer.json", 512)
    assert prompt.input_ids == () and prompt.image == str((tmp_path / "a.png").resolve())
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": " "}) + "\n")
    with pytest.raises(VerifyInputError, match=r"p.jsonl:1: text tokenizes to no tokens"):
        load_prompts(tmp_path / "p.jsonl", tmp_path / "tokenizer.json", 512)


def test_a_utf8_prompt_file_reads_the_same_under_an_ascii_locale(tmp_path):
    """JSON is UTF-8 whatever the locale: under LC_ALL=C without Python's UTF-8 mode (a container, a cron job)
    a prompt file with `héllo` was refused as "not UTF-8 text at byte 11" (read in the locale's encoding)."""
    import os
    import subprocess
    import sys

    build_tokenizer(512).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "héllo wörld, 日本"}, ensure_ascii=False) + "\n", "utf-8")
    read = (
        "import sys; from dsv41_convert.verify.prompts import load_prompts; "
        "p = load_prompts(sys.argv[1], sys.argv[2], 512)[0]; "
        "print(p.text.encode('unicode_escape').decode(), p.input_ids)"
    )
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0", "PYTHONPATH": root}
    args = [str(tmp_path / "p.jsonl"), str(tmp_path / "tokenizer.json")]
    ascii_locale = subprocess.run([sys.executable, "-c", read, *args], capture_output=True, text=True, env=env)
    env.update(LC_ALL="C.UTF-8", PYTHONUTF8="1")
    utf8 = subprocess.run([sys.executable, "-c", read, *args], capture_output=True, text=True, env=env)
    assert ascii_locale.returncode == 0 and utf8.returncode == 0, ascii_locale.stderr + utf8.stderr
    assert ascii_locale.stdout == utf8.stdout and "\\xe9" in utf8.stdout


def test_a_placeholder_in_input_ids_is_told_what_takes_an_image(tmp_path):
    """A prompt holding image_token_id was told 'give the image as "image" ... and take the placeholder out';
    for an input_ids prompt that advice was refused next ("image goes with a text prompt, not with input_ids").
    The advice now fits the prompt: input_ids are told to become text; a text keeps the former advice."""
    from dsv41_convert.config import ModelArgs
    from dsv41_convert.synth.presets import PRESETS, hf_config
    from dsv41_convert.verify.reference import read_prompts

    args = ModelArgs.from_hf_dict(hf_config(PRESETS["tiny"], compressed_vocab_size=1))
    ph = args.image_token_id
    tok = build_tokenizer(args.vocab_size)
    tok.save(str(tmp_path / "tokenizer.json"))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"input_ids": [5, ph, 7]}) + "\n")
    with pytest.raises(VerifyInputError) as said:
        read_prompts(path, tmp_path / "tokenizer.json", args)
    assert 'give the prompt as "text"' in str(said.value) and "with input_ids" in str(said.value)
    path.write_text(json.dumps({"text": "hello " + tok.id_to_token(ph)}) + "\n")
    with pytest.raises(VerifyInputError, match=r'give the image as "image" \(its span goes after the text\)'):
        read_prompts(path, tmp_path / "tokenizer.json", args)
