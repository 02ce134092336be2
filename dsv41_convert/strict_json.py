"""JSON that people write (config.json, an index, prompt files), read strictly: a key given twice in one object
is refused. json, and every reader built on it, keeps the last value without a word."""

from __future__ import annotations

import json
from typing import Any


class RepeatedKey(ValueError):
    """A key given twice in one JSON object: args[0] is the key."""


def first_repeated(pairs: list[tuple[str, Any]]) -> str | None:
    """The first key that `pairs` (one JSON object's, in order) gives a second time, or None. Callers ask only
    where dict(pairs) came out shorter: a header's 100,000 objects are not each walked twice."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    return None


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: the object as a dict, or RepeatedKey naming a key it gives twice."""
    data = dict(pairs)
    if len(data) != len(pairs) and (key := first_repeated(pairs)) is not None:
        raise RepeatedKey(key)
    return data


def loads(text: str | bytes) -> Any:
    """json.loads, but RepeatedKey for a key given twice in any object of `text`."""
    return json.loads(text, object_pairs_hook=_refuse_repeated_keys)
