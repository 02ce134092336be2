"""Numbers as a user or a file writes them: the digits 0-9 only."""

import re


def ascii_int(text: str) -> int:
    """int() of digits 0-9 with an optional minus sign; int() alone also takes "1_0" (10), "٤" (4) and " 3 ".

    Raises ValueError otherwise.
    """
    if not re.fullmatch(r"-?[0-9]+", text):
        raise ValueError(f"{text!r}: expected an integer written in the digits 0-9")
    return int(text)
