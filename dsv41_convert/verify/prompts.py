"""The prompts verify runs: built-in defaults, or a JSONL file.

Each JSONL line is one prompt, an object with exactly one of
    {"input_ids": [int, ...]}          token ids, used as given
    {"text": "..."}                    tokenized with CONVERTED's tokenizer.json (no special tokens added)
and optionally "image": "path" (text prompts only; the image span is placed after the text, built by
dsv41_convert.model.image_processor) and "decode_ids": [int, ...], the tokens the decode steps feed
(used by the layer-streamed reference, which fixes them before its one pass over the weights; see
verify/streamed.py for the rule when they are absent). Blank lines and lines starting with '#' are skipped.

The defaults are token ids, so they need no tokenizer: three prompts of 40 tokens each, longer than
the tiny preset's 16-token sliding window and its 4-token candidate blocks, so compressed attention,
the indexer and the candidate selection all take part. The ids are drawn from a fixed generator and
avoid the top of the vocabulary (the image and DSpark noise tokens live there). A model with Engram layers
takes only the ids its tokenizer has (prompt_id_bound): its token map covers no more.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dsv41_convert import strict_json
from dsv41_convert.engram_tokens import read_tokenizer
from dsv41_convert.errors import NOT_JSON, VerifyInputError
from dsv41_convert.file_kinds import refuse_non_file

DEFAULT_LENGTH = 40
DEFAULT_COUNT = 3
RESERVED_TAIL = 8  # ids this close to the vocab end are special in the published tokenizer layout


@dataclass(frozen=True)
class Prompt:
    """One prompt: its ids, and where it came from (for the report)."""

    input_ids: tuple[int, ...]
    label: str
    text: str | None = None
    image: str | None = None  # path of an image placed after the text
    decode_ids: tuple[int, ...] | None = None  # tokens the decode steps feed (streamed reference)
    origin: str = ""  # FILE:LINE of a prompt file's line, for messages


def default_prompts(vocab_size: int, count: int = DEFAULT_COUNT, length: int = DEFAULT_LENGTH) -> list[Prompt]:
    """`count` prompts of `length` ids in [3, vocab_size - RESERVED_TAIL), the same for every vocab size
    prefix (a fixed generator per prompt)."""
    high = vocab_size - RESERVED_TAIL
    if high <= 3:
        raise VerifyInputError(f"vocab_size {vocab_size} is too small for the built-in prompts")
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(3, high, (length,), generator=g).tolist()
        out.append(Prompt(tuple(ids), f"default-{i}"))
    return out


def _require_unicode(value: object, what: str, path: bool = False) -> None:
    """VerifyInputError where `value` is a string that is not valid Unicode (it crashed the tokenizer or the
    path functions with a traceback: an audit), or, for a `path`, holds a NUL (a review: text may)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise VerifyInputError(f"{what} is not valid Unicode ({exc.reason} at {exc.start})") from exc
        if path and "\0" in value:
            raise VerifyInputError(f"{what} holds a NUL character, which no file name holds")


def prompt_id_bound(vocab_size: int, engram: bool, tokenizer_path: Path | None) -> tuple[int, str]:
    """The ids a prompt may hold, [0, bound), and what bounds them: the vocabulary, or for a model with Engram
    layers (`engram`) the tokenizer where it has fewer ids: the Engram hash maps each id through a token map
    built from the tokenizer, which covers no more (a vocabulary padded past the tokenizer, as a fine-tune's
    resize_token_embeddings(..., pad_to_multiple_of=64) leaves it: the built-in prompts drew ids past it and
    the model ended in an IndexError; an audit)."""
    if not engram or tokenizer_path is None or not Path(tokenizer_path).is_file():
        return vocab_size, "the vocabulary"
    have = _tokenizer(tokenizer_path, str(tokenizer_path)).get_vocab_size(with_added_tokens=True)
    if have >= vocab_size:
        return vocab_size, "the vocabulary"
    return have, f"the {have} ids of {tokenizer_path}, which the Engram token map covers (vocab_size is {vocab_size})"


def ids_outside(ids, bound: int) -> list[int]:
    """The ids of `ids` (ints, or an int tensor) outside [0, bound), in order."""
    return [t for t in (int(i) for i in ids) if not 0 <= t < bound]


def refuse_recorded_ids_past(runs: list[tuple[str, list[int]]], bound: int, bound_by: str, path: str) -> None:
    """VerifyInputError naming `path` and the prompt where a reference file's ids (prompt and decode ids, per
    label) lie past `bound` (prompt_id_bound): they reached the ranks and ended them there (an audit)."""
    for label, ids in runs:
        bad = ids_outside(ids, bound)
        if bad:
            raise VerifyInputError(f"{path}: {label}: token ids {bad[:5]} outside [0, {bound}): {bound_by}")


def load_prompts(
    path: Path, tokenizer_path: Path | None, vocab_size: int, bound_by: str = "the vocabulary"
) -> list[Prompt]:
    """Read a JSONL prompt file; text lines need `tokenizer_path` (a tokenizer.json).

    Raises VerifyInputError naming the file and line for malformed lines, unknown keys, ids outside
    [0, vocab_size) (`bound_by` says what that bound is: prompt_id_bound), and text without a tokenizer.
    """
    path = Path(path)
    refuse_non_file(path, VerifyInputError)  # a FIFO waited for a writer forever (an audit)
    try:
        # JSON is UTF-8 whatever the locale; its lines end at \n only (splitlines broke U+2028 inside a string)
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as exc:
        raise VerifyInputError(f"{path}: cannot read the prompt file ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise VerifyInputError(f"{path}: not UTF-8 text at byte {exc.start}; the prompt file is JSON lines") from exc
    tokenizer = None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{n}"
        try:
            obj = strict_json.loads(line)
        except strict_json.RepeatedKey as exc:
            raise VerifyInputError(f"{where}: gives {exc.args[0]!r} twice; keep the one you mean") from None
        except NOT_JSON as exc:
            raise VerifyInputError(f"{where}: not a JSON object ({exc})") from exc
        if not isinstance(obj, dict):
            raise VerifyInputError(f"{where}: expected a JSON object, found {type(obj).__name__}")
        unknown = sorted(set(obj) - {"input_ids", "text", "image", "decode_ids"})
        if unknown:
            raise VerifyInputError(
                f"{where}: unknown keys {unknown}; expected input_ids or text, optionally image and decode_ids"
            )
        decode_ids = obj.get("decode_ids")
        if decode_ids is not None and (
            not isinstance(decode_ids, list) or not decode_ids or not all(_token_id(t) for t in decode_ids)
        ):
            raise VerifyInputError(f"{where}: decode_ids must be a non-empty list of integers")
        if ("input_ids" in obj) == ("text" in obj):
            raise VerifyInputError(f"{where}: give exactly one of input_ids and text")
        image = obj.get("image")
        if image is not None and (not isinstance(image, str) or not image):  # "" was the prompt file's folder
            raise VerifyInputError(f"{where}: image must be a path string")
        for key in ("text", "image"):  # a lone surrogate, which JSON's \ud800 escape can spell
            _require_unicode(obj.get(key), f"{where}: {key}", path=key == "image")
        if image is not None:
            # absolute: the reference file records it, and verify may run in another folder
            try:
                image = str(((path.parent / image) if not Path(image).is_absolute() else Path(image)).resolve())
            except (OSError, RuntimeError) as exc:  # a loop of links: RuntimeError on Python 3.11
                raise VerifyInputError(f"{where}: image {image}: {exc}") from exc
        if "input_ids" in obj:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not ids or not all(_token_id(t) for t in ids):
                raise VerifyInputError(f"{where}: input_ids must be a non-empty list of integers")
            if image is not None:
                raise VerifyInputError(f"{where}: image goes with a text prompt, not with input_ids")
            prompts.append(Prompt(tuple(ids), f"line-{n}", origin=where))
        else:
            text = obj["text"]
            if not isinstance(text, str) or not text:
                raise VerifyInputError(f"{where}: text must be a non-empty string")
            if tokenizer is None:
                tokenizer = _tokenizer(tokenizer_path, where)
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            if not ids and image is None:
                raise VerifyInputError(f"{where}: text tokenizes to no tokens")
            prompts.append(Prompt(tuple(ids), f"line-{n}", text=text, image=image, origin=where))
        if decode_ids is not None:
            prompts[-1] = replace(prompts[-1], decode_ids=tuple(decode_ids))
        bad = ids_outside((*prompts[-1].input_ids, *(decode_ids or ())), vocab_size)
        if bad:
            raise VerifyInputError(f"{where}: token ids {bad[:5]} outside [0, {vocab_size}): {bound_by}")
    if not prompts:
        raise VerifyInputError(f"{path}: no prompts in the file")
    return prompts


def _tokenizer(path: Path | None, where: str):
    if path is None or not Path(path).is_file():
        missing = "the source has none" if path is None else f"not found at {path}"
        raise VerifyInputError(f"{where}: a text prompt needs tokenizer.json beside the weights; {missing}")
    try:
        return read_tokenizer(Path(path))
    except Exception as exc:  # tokenizers raises plain Exception subclasses for a bad file
        raise VerifyInputError(f"{path}: not a readable tokenizer.json ({exc})") from exc


def _token_id(value: object) -> bool:
    """A JSON integer (true and false are bools to JSON, ints to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)
