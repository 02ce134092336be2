"""JSON that people write (config.json, an index, prompt files), read strictly: a key given twice in one object
is refused. json, and every reader built on it, keeps the last value without a word."""

from __future__ import annotations

import json
from typing import Any


class RepeatedKey(ValueError):
    """A key given twice in one JSON object: args[0] is the key."""


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: the object as a dict, or RepeatedKey naming a key it gives twice."""
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        raise RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return data


def loads(text: str | bytes) -> Any:
    """json.loads, but RepeatedKey for a key given twice in any object of `text`."""
    return json.loads(text, object_pairs_hook=_refuse_repeated_keys)
