"""Import a script of this checkout's bench/ folder afresh, as the tests of the bench scripts need it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def fresh_bench_module(monkeypatch, name: str) -> ModuleType:
    """-> bench/NAME.py imported anew (not the copy an earlier test imported and patched); bench/ is on
    sys.path until the test ends, so the script's own imports of its neighbours work."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop(name, None)
    return importlib.import_module(name)
