"""numbers.byte_amounts: byte counts a message compares, never two that read the same."""

from dsv41_convert.numbers import byte_amounts


def test_gb_where_they_read_apart_bytes_where_they_would_not():
    assert byte_amounts(3_000_000_000, 1_250_000_000) == ["3.00 GB", "1.25 GB"]
    # "0.02 GB to write but only 0.02 GB free" and "0.00 GB short" (audits)
    assert byte_amounts(19_000_000, 17_000_000) == ["19,000,000 bytes", "17,000,000 bytes"]
    assert byte_amounts(2_000_000_000, 1_999_000_000, 1_000_000) == [
        "2,000,000,000 bytes", "1,999,000,000 bytes", "1,000,000 bytes"
    ]  # fmt: skip
    assert byte_amounts(2_000_000_000, 0) == ["2.00 GB", "0.00 GB"]  # nothing free reads 0.00 GB truly
