"""`check OUT`: compare every file listed in OUT/manifest.json with its recorded size and sha256.

No model is run and no tensor is parsed: this is the cheap integrity check of a converted folder
(a truncated copy, a flipped byte, a file from another run). Sizes are compared first, so a wrong-size
file is reported without hashing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.progress import Progress
from dsv41_convert.store.manifest import FORMAT, MANIFEST, sha256_file


@dataclass
class CheckResult:
    folder: str
    checked: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # one line per bad file, naming it

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {"folder": self.folder, "ok": self.ok, "checked": self.checked, "problems": self.problems}


def read_manifest(folder: Path) -> dict[str, Any]:
    """OUT/manifest.json, checked for shape; VerifyInputError names what is wrong."""
    path = Path(folder) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise VerifyInputError(f"{path}: not found; was {folder} written by `dsv41-convert shard`?") from exc
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VerifyInputError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise VerifyInputError(f"{path}: format {found!r}, expected {FORMAT!r}")
    files = data.get("files")
    if not isinstance(files, dict) or not files:
        raise VerifyInputError(f"{path}: no `files` object listing the output files")
    for name, rec in files.items():
        ok = isinstance(rec, dict) and isinstance(rec.get("size"), int) and isinstance(rec.get("sha256"), str)
        if not ok or "/" in name or name.startswith("."):
            raise VerifyInputError(f"{path}: entry {name!r} is not a plain file name with size and sha256")
    return data


def check_folder(folder: Path, progress: Progress | None = None) -> CheckResult:
    """Check sizes, then sha256, of every file in the manifest. -> CheckResult (ok when no problems)."""
    folder = Path(folder)
    files = read_manifest(folder)["files"]
    result = CheckResult(str(folder))
    for name, rec in sorted(files.items()):
        path = folder / name
        if progress is not None:
            progress(name, 0, rec["size"])
        if not path.is_file():
            result.problems.append(f"{name}: missing (manifest lists {rec['size']} bytes)")
            continue
        size = path.stat().st_size
        if size != rec["size"]:
            result.problems.append(f"{name}: {size} bytes, manifest says {rec['size']}; truncated or replaced?")
            continue
        digest = sha256_file(path)
        if digest != rec["sha256"]:
            result.problems.append(f"{name}: sha256 {digest[:16]}..., manifest says {rec['sha256'][:16]}...; corrupt?")
        else:
            result.checked.append(name)
        if progress is not None:
            progress(name, size, size)
    return result
