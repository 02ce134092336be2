"""errors.py's helpers for messages: a list cut to its first few, a message that names its rank."""

from __future__ import annotations

import pytest

from dsv41_convert.errors import first_few, names_a_rank


def test_first_few_says_more_only_where_there_are_more():
    assert first_few([]) == ""
    assert first_few(["a", "b", "c"]) == "a, b, c"
    assert first_few(["a", "b", "c", "d"]) == "a, b, c, ..."
    assert first_few(["a", "b"], shown=1) == "a, ..."
    assert first_few(["a"], shown=1) == "a"


@pytest.mark.parametrize(
    ("message", "names"),
    [
        ("rank 0: x", True),
        ("rank 12 of 16: RuntimeError: y", True),
        ("ranks 0 and 1: differ", False),
        ("rank 1 differs", False),
        ("the rank 1: file", False),
        ("rank one: x", False),
    ],
)
def test_names_a_rank_only_at_the_start(message, names):
    assert names_a_rank(message) is names
