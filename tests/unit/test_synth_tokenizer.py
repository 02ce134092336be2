"""The synthetic tokenizer and its Engram compressed token map."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterator
from typing import Any

import pytest
from reference_data import TOKENIZER_CONFIG
from tokenizers import Tokenizer

from dsv41_convert.engram_tokens import compressed_token_map
from dsv41_convert.synth.hollow import hollow_tokenizer, real_config
from dsv41_convert.synth.presets import PRESETS
from dsv41_convert.synth.tokenizer import (
    BOS,
    EOS,
    IMAGE,
    NOISE,
    PAD,
    build_tokenizer,
    special_token_ids,
    tokenizer_config,
)
from dsv41_convert.synth.write import preset_files


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer(PRESETS["tiny"].vocab_size)


def test_vocab_layout(tok):
    v = PRESETS["tiny"].vocab_size
    assert tok.get_vocab_size(with_added_tokens=True) == v
    assert [tok.token_to_id(t) for t in (BOS, EOS, PAD)] == [0, 1, 2]
    assert tok.token_to_id(IMAGE) == PRESETS["tiny"].image_token_id == v - 2
    assert tok.token_to_id(NOISE) == PRESETS["tiny"].dspark_noise_token_id == v - 1
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(v))


@pytest.mark.parametrize(
    "text",
    [
        "Hello World, the model has 128 experts!",
        "  two  spaces\n\ttab",
        "Ünïcödé ✓ 日本語 🙂",
        "def f(x):\n    return x",
    ],
)
def test_any_text_round_trips(tok, text):
    ids = tok.encode(text).ids
    assert max(ids) < tok.get_vocab_size()
    assert tok.decode(ids) == text


def test_special_tokens_encode_to_their_ids(tok):
    assert tok.encode(f"{BOS}hi{IMAGE}{NOISE}").ids[0] == 0
    ids = tok.encode(f"a{IMAGE}{NOISE}").ids
    assert ids[-2:] == [tok.get_vocab_size() - 2, tok.get_vocab_size() - 1]


def test_learned_merges_give_words(tok):
    assert tok.encode(" the").tokens == ["Ġthe"]
    assert len(tok.encode(" model layer token").ids) <= 6


def test_deterministic_and_sized():
    a, b = build_tokenizer(512), build_tokenizer(512)
    assert a.to_str() == b.to_str()
    assert build_tokenizer(16384).get_vocab_size(with_added_tokens=True) == 16384
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(100)


def _independent_key(tok: Tokenizer, token_id: int) -> str:
    """The Engram key written with unicodedata instead of tokenizers' normalizers (same rules)."""
    text = tok.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text:
        return tok.id_to_token(token_id)
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(c for c in s if unicodedata.category(c) != "Mn").lower()
    s = re.sub(r"[ \t\r\n]+", " ", s)
    s = " " if s == " " else s.strip()
    return s or text


def test_compressed_map_against_an_independent_implementation(tok):
    lookup, size = compressed_token_map(tok)
    keys: dict[str, int] = {}
    expect = [keys.setdefault(_independent_key(tok, i), len(keys)) for i in range(tok.get_vocab_size())]
    assert lookup == expect
    assert size == len(keys) == max(lookup) + 1


def test_compressed_map_rules(tok):
    lookup, _ = compressed_token_map(tok)
    ids = {t: tok.token_to_id(t) for t in ("Ġt", "t", "ĠT", "T", "Ġ", "Ċ", "ĉ")}
    assert lookup[ids["Ġt"]] == lookup[ids["t"]] == lookup[ids["ĠT"]] == lookup[ids["T"]]
    # whitespace-only tokens share the single-space key instead of collapsing to the empty string
    assert lookup[ids["Ġ"]] == lookup[ids["Ċ"]] == lookup[ids["ĉ"]]
    assert lookup[ids["Ġ"]] != lookup[ids["t"]]
    # lone UTF-8 continuation / lead bytes are partial characters: each keeps its own key
    partial = [i for i in range(3, 259) if "\ufffd" in tok.decode([i])]
    assert len(partial) == 128
    assert len({lookup[i] for i in partial}) == 128
    assert lookup[:3] == [0, 1, 2]


def test_tokenizer_config_is_shaped_as_published():
    cfg = tokenizer_config(1024)
    # the published file pads with the end-of-sentence text (config.json's pad_token_id 2 is the vocab's PAD)
    assert (cfg["bos_token"]["content"], cfg["eos_token"]["content"], cfg["pad_token"]["content"]) == (BOS, EOS, EOS)
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["model_max_length"] == 1024


def test_tokenizer_config_bytes_are_the_published_files():
    """With the published model_max_length, json.dumps(tokenizer_config(...), indent=2, ensure_ascii=False) is
    the published tokenizer_config.json byte for byte (its docstring's promise): a changed flag (an added
    token's `normalized`) or key order gave make-tiny a tokenizer_config.json the real one is not."""
    published = TOKENIZER_CONFIG.read_bytes()
    length = json.loads(published)["model_max_length"]
    ours = json.dumps(tokenizer_config(length), indent=2, ensure_ascii=False).encode("utf-8")
    assert ours == published


def _token_ids(node: Any, path: str = "") -> Iterator[tuple[str, int]]:
    """(dotted key, id) of every *_token_id anywhere in a nested config.json."""
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _token_ids(value, f"{path}{key}.")
        elif key.endswith("_token_id"):
            yield f"{path}{key}", value


def _expected_tokens() -> dict[str, str]:
    """config.json key -> the token it must name: bos/eos as the published tokenizer_config.json spells them;
    the pad ids are the vocab's PAD (id 2 in the published vocab and SPEC's engram_pad_id; the published
    tokenizer_config pads with the EOS text instead); image and noise as synth.tokenizer names them."""
    published = json.loads(TOKENIZER_CONFIG.read_text(encoding="utf-8"))
    return {
        "bos_token_id": published["bos_token"]["content"],
        "eos_token_id": published["eos_token"]["content"],
        "pad_token_id": PAD,
        "image_token_id": "<｜deepseek_image｜>",
        "text_config.engram_pad_token_id": PAD,
        "text_config.dspark_noise_token_id": "<｜dspark_noise｜>",
    }


def _files(preset: str) -> tuple[dict[str, Any], Tokenizer]:
    if preset == "full":  # what make-tiny --preset full --sparse writes
        config = real_config()
        return config, hollow_tokenizer(config)
    return preset_files(PRESETS[preset])


@pytest.mark.parametrize("preset", ["tiny", "medium", "full"])
def test_every_config_token_id_names_its_token(preset):
    """The hollow copy put image and noise at vocab-2 / vocab-1 while its config says 129264 / 128799."""
    config, tok = _files(preset)
    expected = _expected_tokens()
    found = dict(_token_ids(config))
    assert set(found) == set(expected), "a *_token_id this test does not know: add what it must decode to"
    if preset == "full":
        assert (found["image_token_id"], found["text_config.dspark_noise_token_id"]) == (129264, 128799)
    for key, token_id in found.items():
        assert tok.id_to_token(token_id) == expected[key], key
        assert tok.decode([token_id], skip_special_tokens=False) == expected[key], key
        assert tok.encode(expected[key]).ids == [token_id], key


def test_specials_inside_the_vocab_keep_it_whole():
    """Specials at ids among the ordinary tokens: every id used once, text still round-trips."""
    specials = {BOS: 0, EOS: 1, PAD: 2, IMAGE: 300, NOISE: 257}
    tok = build_tokenizer(512, specials=specials)
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(512))
    assert {t: tok.token_to_id(t) for t in specials} == specials
    text = "Hello World, the model has 128 experts!"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode(f"a{IMAGE}b{NOISE}").ids[1::2] == [300, 257]


@pytest.mark.parametrize(
    ("specials", "match"),
    [
        ({BOS: 0, EOS: 1, PAD: 2, IMAGE: 7}, r"want exactly"),
        ({BOS: 0, EOS: 1, PAD: 2, IMAGE: 7, NOISE: 7}, r"distinct"),
        ({BOS: 0, EOS: 1, PAD: 2, IMAGE: 7, NOISE: 512}, r"0\.\.511"),
    ],
)
def test_bad_special_ids_are_refused(specials, match):
    with pytest.raises(ValueError, match=match):
        build_tokenizer(512, specials=specials)


def test_special_ids_come_from_the_config():
    config = real_config()
    assert special_token_ids(config) == {BOS: 0, EOS: 1, PAD: 2, IMAGE: 129264, NOISE: 128799}
    config["text_config"]["engram_pad_token_id"] = 5
    with pytest.raises(ValueError, match=r"engram_pad_token_id = 5"):
        special_token_ids(config)
    config = real_config()
    del config["image_token_id"]
    with pytest.raises(ValueError, match=r"no image_token_id"):
        special_token_ids(config)
