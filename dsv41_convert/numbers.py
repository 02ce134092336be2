"""Numbers as a user or a file writes them (the digits 0-9 only), and byte counts and e8m0 scale bytes as a
message says them."""

import re


def ascii_int(text: str) -> int:
    """int() of digits 0-9 with an optional minus sign; int() alone also takes "1_0" (10), "٤" (4) and " 3 ".

    Raises ValueError otherwise.
    """
    if not re.fullmatch(r"-?[0-9]+", text):
        raise ValueError(f"{text!r}: expected an integer written in the digits 0-9")
    return int(text)


def byte_amounts(*counts: int) -> list[str]:
    """`counts` as a message compares them: GB at two decimals, or bytes where two would read the same or one
    more than none would read 0.00 ("0.02 GB to write but only 0.02 GB free", "0.00 GB short": audits)."""
    in_gb = [f"{n / 1e9:.2f} GB" for n in counts]
    blurred = len(set(in_gb)) < len(in_gb) or any(
        n and said == "0.00 GB" for n, said in zip(counts, in_gb, strict=True)
    )
    return [f"{n:,} bytes" for n in counts] if blurred else in_gb


def e8m0_text(byte: int) -> str:
    """One e8m0 scale byte as a message says it: the scale it means, 2**(byte - 127) ("2**-3" for byte 124),
    "NaN" for 255. A report of the bytes alone ("127 vs 128") left the exponent arithmetic to the reader."""
    return "NaN" if byte == 255 else f"2**{byte - 127}"


def counted(n: int, noun: str, verbs: tuple[str, str] | None = None) -> str:
    """`n` and `noun` as a message counts them: "1 file", "3 files"; with `verbs` (singular, plural) the verb
    agrees too: counted(1, "tensor", ("does", "do")) is "1 tensor does". Nouns take an "s" ("1 files" and
    "file(s)" read wrong)."""
    words = f"{n} {noun}" + ("" if n == 1 else "s")
    return words if verbs is None else f"{words} {verbs[n != 1]}"
