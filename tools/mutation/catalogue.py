"""The mutation catalogue: realistic faults planted one at a time, each with the tests that must catch it.

The data lives in catalogue.json beside this file, one entry per mutant:

    id           "<area>.<audit id>", e.g. "quant.M04"; unique
    file         path of a package file, relative to the repository root
    old, new     exact text replacement; `old` occurs exactly once in `file`
    desc         the bug the mutant models, in one line
    tests        pytest selection (files or node ids) that must fail under the mutant
    equivalent   reason, only where the audit found the mutant behaves as the original (listed, not run by default)
    import_fails true where the mutant breaks the import (an import-time check): a collection error counts as a kill
    interrupt_escapes  true where the mutant lets a KeyboardInterrupt out of the test, which ends pytest's session
                 (exit 2, interrupted): that counts as a kill
    audit        what the audit found against the suite before its new tests: killed | survived | equivalent;
                 "adapted" for a mutant rewritten onto code changed since its audit

"skipped" lists audit mutants whose old text no longer occurs exactly once in the package.
This module only reads and checks the data; tools/mutation/run.py plants and runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CATALOGUE = Path(__file__).with_name("catalogue.json")
AREAS = ("quant", "convert", "verify", "model", "cli", "hub", "config", "loadrun", "stream", "export", "launch", "feed")


@dataclass(frozen=True)
class Mutant:
    """One planted fault: replace `old` by `new` in `file`, and `tests` must fail."""

    id: str
    file: str
    old: str
    new: str
    desc: str
    tests: tuple[str, ...]
    equivalent: str | None = None
    import_fails: bool = False
    interrupt_escapes: bool = False
    audit: str = ""

    @property
    def area(self) -> str:
        return self.id.split(".", 1)[0]


def load(path: Path = CATALOGUE) -> list[Mutant]:
    """Every mutant in the catalogue, in file order."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return [
        Mutant(
            id=e["id"],
            file=e["file"],
            old=e["old"],
            new=e["new"],
            desc=e["desc"],
            tests=tuple(e["tests"]),
            equivalent=e.get("equivalent"),
            import_fails=e.get("import_fails", False),
            interrupt_escapes=e.get("interrupt_escapes", False),
            audit=e.get("audit", ""),
        )
        for e in data["mutants"]
    ]


def skipped(path: Path = CATALOGUE) -> list[dict[str, object]]:
    """Audit mutants left out because their old text no longer occurs exactly once."""
    return json.loads(path.read_text(encoding="utf-8")).get("skipped", [])


def problems(mutants: list[Mutant], root: Path) -> list[str]:
    """What is wrong with the catalogue against the tree at `root`; empty when it is honest.

    Checks: ids unique and area-prefixed, old != new, old occurs exactly once in its file, and each test
    selection names a file that exists.
    """
    out: list[str] = []
    seen: set[str] = set()
    texts: dict[str, str] = {}
    for m in mutants:
        if m.id in seen:
            out.append(f"{m.id}: id used twice")
        seen.add(m.id)
        if m.area not in AREAS:
            out.append(f"{m.id}: area {m.area!r} is not one of {', '.join(AREAS)}")
        if m.old == m.new:
            out.append(f"{m.id}: old and new text are the same")
        if not m.tests:
            out.append(f"{m.id}: no tests selected")
        path = root / m.file
        if m.file not in texts:
            texts[m.file] = path.read_text(encoding="utf-8") if path.is_file() else ""
        if (n := texts[m.file].count(m.old)) != 1:
            out.append(f"{m.id}: old text occurs {n} times in {m.file}, not once")
        for t in m.tests:
            if not (root / t.split("::", 1)[0]).is_file():
                out.append(f"{m.id}: test file of {t} not found")
    return out
