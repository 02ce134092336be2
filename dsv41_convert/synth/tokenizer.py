"""A small, real tokenizer.json for synthetic checkpoints.

The tokenizer is a byte-level BPE (any text tokenizes and decodes back) with exactly `vocab_size`
ids. The five special tokens sit at the ids config.json names for them (`special_token_ids`); the
ordinary tokens fill the other ids in order:

    the 256 byte symbols
    merges: first learned from a built-in word list, then filler merges (an existing token + one
    lowercase letter) until the vocab is full

With the default ids (bos, eos, pad = 0, 1, 2; image, DSpark noise = vocab-2, vocab-1, as the tiny and
medium presets have them) the bytes are ids 3..258. The published config puts image at 129264 and
noise at 128799, inside the ordinary range.

Vocab and merges are built here, in a fixed order, so the file is identical for identical
arguments (no trainer, no hash-map order).

The Engram compressed token map of this tokenizer is `engram_tokens.compressed_token_map`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from dsv41_convert import interrupts

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
IMAGE, NOISE = "<｜deepseek_image｜>", "<｜dspark_noise｜>"
SPECIALS = (BOS, EOS, PAD, IMAGE, NOISE)

# config.json key -> special token; ("text_config", key) for a key of the nested text config.
# pad_token_id is the vocab's PAD though the published tokenizer_config.json pads with EOS's text
# (see tokenizer_config); engram_pad_token_id is the same id.
CONFIG_TOKEN_IDS: dict[tuple[str, ...], str] = {
    ("bos_token_id",): BOS,
    ("eos_token_id",): EOS,
    ("pad_token_id",): PAD,
    ("image_token_id",): IMAGE,
    ("text_config", "engram_pad_token_id"): PAD,
    ("text_config", "dspark_noise_token_id"): NOISE,
}

# text the merges are learned from: common English words, digits and code-ish fragments
_CORPUS = """
the of and to in is was for that on with as by at from his her he she it they we you this which
be are were been have has had not but or an all one two three four five six seven eight nine ten
there their what when where who how can will would could should about into over after before
model layer token weight scale expert attention window index candidate source shard tensor value
hello world small large number first second third last time year people way day man woman child
water light sound music story house school state city country system program question answer
Hello World The This That There When Where What How Model Layer Token
0 1 2 3 4 5 6 7 8 9 10 12 16 32 64 100 128 256 512 1000 2024 2025 2026
def return import class self None True False print for while if else elif range len
( ) [ ] { } , . : ; ! ? ' " - + * / = == != <= >= -> # @ % & | ^ ~
"""

_FILL_LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def byte_symbols() -> list[str]:
    """The byte-level alphabet: byte b -> one printable character (printable Latin-1 bytes map to
    themselves, the rest to U+0100 upwards, in byte order), as the ByteLevel pre-tokenizer uses."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _learned_merges(alphabet: list[str], budget: int) -> list[tuple[str, str]]:
    """Greedy BPE over the built-in corpus; ties go to the lexicographically smallest pair."""
    byte_of = dict(enumerate(alphabet))
    words: Counter[tuple[str, ...]] = Counter()
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for line in _CORPUS.strip().splitlines():
        for piece, _ in pre.pre_tokenize_str(" " + line):
            words[tuple(piece)] += 1
    del byte_of
    merges: list[tuple[str, str]] = []
    while len(merges) < budget:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def default_special_ids(vocab_size: int) -> dict[str, int]:
    """The special-token ids of the tiny and medium presets: bos, eos, pad first, image and noise last."""
    return {BOS: 0, EOS: 1, PAD: 2, IMAGE: vocab_size - 2, NOISE: vocab_size - 1}


def special_token_ids(config: Mapping[str, Any]) -> dict[str, int]:
    """token text -> id of every special token a nested config.json names (CONFIG_TOKEN_IDS).

    Raises ValueError when a key is missing or two keys give one token different ids."""
    ids: dict[str, int] = {}
    for keys, token in CONFIG_TOKEN_IDS.items():
        node: Any = config
        for key in keys:
            if not isinstance(node, Mapping) or key not in node:
                raise ValueError(f"config.json has no {'.'.join(keys)}: it names the id of {token}")
            node = node[key]
        if ids.setdefault(token, node) != node:
            raise ValueError(f"config.json: {'.'.join(keys)} = {node}, but {token} is already id {ids[token]}")
    return ids


def build_tokenizer(vocab_size: int, folded: int = 0, specials: Mapping[str, int] | None = None) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids (layout in the module docstring).

    folded:   the last `folded` filler merges add an upper-case twin of an earlier filler token (token +
              letter.upper()), which the Engram token map folds onto that token: the knob that sets the
              compressed vocab size (see fit_compressed_size).
    specials: token text -> id for each of SPECIALS (special_token_ids of a config.json); None gives
              default_special_ids(vocab_size)."""
    specials = dict(default_special_ids(vocab_size) if specials is None else specials)
    if set(specials) != set(SPECIALS):
        raise ValueError(f"special tokens {sorted(specials)}: want exactly {sorted(SPECIALS)}")
    bad = {t: i for t, i in specials.items() if not 0 <= i < vocab_size}
    if bad or len(set(specials.values())) != len(specials):
        raise ValueError(f"special token ids {specials}: want {len(specials)} distinct ids in 0..{vocab_size - 1}")
    n_merges = vocab_size - len(SPECIALS) - 256
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} < {len(SPECIALS) + 256} (specials + bytes)")
    alphabet = byte_symbols()
    ordinary: dict[str, None] = dict.fromkeys(alphabet)  # insertion-ordered set; ids are given at the end
    merges: list[tuple[str, str]] = []
    for a, b in _learned_merges(alphabet, n_merges):
        if a + b not in ordinary:
            ordinary[a + b] = None
            merges.append((a, b))
    tokens = list(ordinary)
    filled: list[tuple[str, str]] = []
    plain = n_merges - folded
    i = 0
    while len(merges) < plain:  # filler: token + letter, breadth first over the growing vocab
        base = tokens[i]
        i += 1
        for c in _FILL_LETTERS:
            if len(merges) == plain:
                break
            if base + c not in ordinary:
                ordinary[base + c] = None
                tokens.append(base + c)
                merges.append((base, c))
                filled.append((base, c))
    twins = iter(filled)
    while len(merges) < n_merges:
        base, c = next(twins)
        if base + c.upper() not in ordinary:
            ordinary[base + c.upper()] = None
            merges.append((base, c.upper()))
    taken = set(specials.values())
    free = (k for k in range(vocab_size) if k not in taken)
    vocab = dict(zip(ordinary, free, strict=True)) | specials
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json as published: its pad_token is the end-of-sentence text, though config.json's
    pad_token_id is 2 (the vocabulary's own pad token); with the published model_max_length the bytes of
    json.dumps(..., indent=2, ensure_ascii=False) are the published file's."""

    def added(content: str) -> dict[str, Any]:
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": True,
            "rstrip": False,
            "single_word": False,
        }

    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": added(BOS),
        "clean_up_tokenization_spaces": False,
        "eos_token": added(EOS),
        "legacy": True,
        "model_max_length": model_max_length,
        "pad_token": added(EOS),
        "sp_model_kwargs": {},
        "unk_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def fit_compressed_size(vocab_size: int, compressed_size: int, specials: Mapping[str, int] | None = None) -> Tokenizer:
    """A build_tokenizer(vocab_size, folded, specials) whose Engram token map has exactly `compressed_size`
    ids (a real config's engram_compressed_vocab_size); raises ValueError when no fold count gets there."""
    from dsv41_convert.engram_tokens import compressed_token_map

    folded = 0
    for _ in range(8):
        interrupts.check()  # each try takes about a second at the real vocab size
        tok = build_tokenizer(vocab_size, folded, specials)
        _, size = compressed_token_map(tok)
        if size == compressed_size:
            return tok
        folded += size - compressed_size
        if folded < 0:
            break
    raise ValueError(f"no {vocab_size}-id tokenizer here folds to {compressed_size} Engram ids (last: {size})")
