"""numbers.byte_amounts and numbers.counted: counts as a message says them (bytes never two that read the same)."""

import pytest

from dsv41_convert.numbers import byte_amounts, counted


def test_gb_where_they_read_apart_bytes_where_they_would_not():
    assert byte_amounts(3_000_000_000, 1_250_000_000) == ["3.00 GB", "1.25 GB"]
    # "0.02 GB to write but only 0.02 GB free" and "0.00 GB short" (audits)
    assert byte_amounts(19_000_000, 17_000_000) == ["19,000,000 bytes", "17,000,000 bytes"]
    assert byte_amounts(2_000_000_000, 1_999_000_000, 1_000_000) == [
        "2,000,000,000 bytes", "1,999,000,000 bytes", "1,000,000 bytes"
    ]  # fmt: skip
    assert byte_amounts(2_000_000_000, 0) == ["2.00 GB", "0.00 GB"]  # nothing free reads 0.00 GB truly


@pytest.mark.parametrize(
    ("n", "verbs", "said"),
    [
        (0, None, "0 files"),
        (1, None, "1 file"),
        (2, None, "2 files"),
        (1, ("matches", "match"), "1 file matches"),
        (3, ("matches", "match"), "3 files match"),
        (0, ("does", "do"), "0 files do"),
    ],
)
def test_counted_agrees_noun_and_verb_with_the_count(n, verbs, said):
    """Messages said "file(s)", "1 files match", "after 1 attempts": one rule for every count now."""
    assert counted(n, "file", verbs) == said
