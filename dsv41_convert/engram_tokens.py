"""Engram's compressed token map: every token id of the checkpoint's tokenizer folded onto the id space the
n-grams are hashed in (model/engram_hash.py hashes with it). No torch here: `plan` checks a source's tokenizer
against its config with it, and shard and export of the published layout never import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dsv41_convert.errors import ConfigError

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def _token_normalizer():
    from tokenizers import Regex, normalizers

    # a token that is only whitespace would strip to "" and merge with unrelated tokens; a
    # private-use placeholder carries its single space through Strip
    keep = "\ue000"
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), keep),
            normalizers.Strip(),
            normalizers.Replace(keep, " "),
        ]
    )


def compressed_token_map(tokenizer: Tokenizer) -> tuple[list[int], int]:
    """Fold every token id onto the compressed id space the n-grams are hashed in.

    Each id is decoded alone (special tokens kept, no clean-up); the text is normalized (NFKC, NFD,
    accents stripped, lowercased, whitespace runs collapsed, stripped) and ids with equal keys share
    a compressed id. A decode holding U+FFFD is a partial UTF-8 byte token and is keyed by its raw
    token string. Compressed ids are numbered in order of first appearance.

    -> (map: one compressed id per token id, number of compressed ids)
    """
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    normalizer = _token_normalizer()
    numbering: dict[str, int] = {}
    out = []
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        out.append(numbering.setdefault(key, len(numbering)))
    return out, len(numbering)


def load_token_map(tokenizer_json: Path, expected_size: int) -> list[int]:
    """The compressed token map of `tokenizer_json`, checked against engram_compressed_vocab_size; built once
    per process and file version (a verify rank checks its plan's tokenizer, then its model reads it: 0.26 s
    each for the published 129,280 ids, on top of the parse). The list is shared: read it, never change it."""
    path = Path(tokenizer_json)
    if not path.is_file():
        raise ConfigError(
            f"{tokenizer_json}: not found; this model has Engram layers, whose hashes need the checkpoint's "
            "tokenizer.json (shard copies it from the source: put the source's beside the weights)"
        )
    key = (*_version(path), expected_size)
    if key not in _MAPS:
        try:
            tokenizer = read_tokenizer(path)
        except Exception as exc:  # the tokenizers library raises its own untyped errors
            raise ConfigError(f"{tokenizer_json}: not a readable tokenizer.json ({exc})") from exc
        _MAPS.clear()  # one tokenizer per run
        _MAPS[key] = checked_token_map(tokenizer, expected_size, str(tokenizer_json))
    return _MAPS[key]


def read_tokenizer(path: Path) -> Tokenizer:
    """`tokenizers.Tokenizer.from_file(path)`, parsed once per process and file version (verify's prompt bound,
    its text prompts and the Engram token map read one file: 0.18 s a parse at the published size). Shared:
    never change it (no padding or truncation set on it). Raises what the tokenizers library raises."""
    from tokenizers import Tokenizer

    key = _version(Path(path))
    if key not in _TOKENIZERS:
        # the bytes, not the path: the library takes a path only as UTF-8 text, so a folder whose name is not
        # UTF-8 (a byte Linux allows) was "not a readable tokenizer.json"
        tokenizer = Tokenizer.from_buffer(Path(path).read_bytes())
        _TOKENIZERS.clear()
        _TOKENIZERS[key] = tokenizer
    return _TOKENIZERS[key]


def _version(path: Path) -> tuple:
    """What tells one version of the file at `path` from another: a rewrite moves its change time at least."""
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino


_MAPS: dict[tuple, list[int]] = {}
_TOKENIZERS: dict[tuple, Tokenizer] = {}


def checked_token_map(tokenizer: Tokenizer, expected_size: int, source: str = "tokenizer.json") -> list[int]:
    """`compressed_token_map`, raising ConfigError when its size is not `expected_size`."""
    token_map, size = compressed_token_map(tokenizer)
    if size != expected_size:
        raise ConfigError(
            f"{source}: its compressed Engram token map has {size} entries, but the config's "
            f"engram_compressed_vocab_size is {expected_size}; every hash multiplier depends on it, so "
            f"this tokenizer.json does not belong to this checkpoint (use the checkpoint's own tokenizer.json)"
        )
    return token_map


def resolve_token_map(tokenizer: Tokenizer | str | Path | list[int] | None, expected_size: int) -> list[int]:
    """The compressed token map from whichever form the caller holds (see NgramHashState)."""
    if tokenizer is None:
        raise ConfigError(
            "this model has Engram layers, whose hashes need the checkpoint's tokenizer.json; none was given"
        )
    if isinstance(tokenizer, (str, Path)):
        return load_token_map(Path(tokenizer), expected_size)
    if isinstance(tokenizer, list):
        if max(tokenizer, default=-1) + 1 != expected_size:
            raise ConfigError(
                f"token map holds {max(tokenizer, default=-1) + 1} compressed ids, "
                f"engram_compressed_vocab_size is {expected_size}"
            )
        return tokenizer
    return checked_token_map(tokenizer, expected_size)


def pad_compressed_id(token_map: list[int], pad_id: int, source: str = "the tokenizer") -> int:
    """The compressed id of engram_pad_id (what look-back reads before the sequence and across an image);
    ConfigError where `source` (the tokenizer the map came from) has no such id."""
    if not 0 <= pad_id < len(token_map):
        raise ConfigError(
            f"{source}: the Engram pad token id {pad_id} (config.json) is outside its {len(token_map)} ids"
        )
    return token_map[pad_id]
