"""The synthetic tokenizer and its Engram compressed token map."""

from __future__ import annotations

import re
import unicodedata

import pytest
from tokenizers import Tokenizer

from dsv41_convert.model.engram_hash import compressed_token_map
from dsv41_convert.synth.presets import PRESETS
from dsv41_convert.synth.tokenizer import (
    BOS,
    EOS,
    IMAGE,
    NOISE,
    PAD,
    build_tokenizer,
    tokenizer_config,
)


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
