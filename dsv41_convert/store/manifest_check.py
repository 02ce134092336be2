"""`check OUT`: compare every file listed in OUT/manifest.json with its recorded size and sha256.

No model is run and no tensor is parsed: this is the cheap integrity check of a converted folder
(a truncated copy, a flipped byte, a file from another run). Sizes are compared first, so a wrong-size
file is reported without hashing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from dsv41_convert.config import INT64_MAX
from dsv41_convert.errors import CHECK_FAILED, NOT_JSON, VerifyInputError, first_few
from dsv41_convert.file_kinds import refuse_non_file
from dsv41_convert.numbers import counted
from dsv41_convert.progress import Progress
from dsv41_convert.store.file_digest import Recorded, mismatches
from dsv41_convert.store.index import INDEX_NAME
from dsv41_convert.store.manifest import DONE_DIR, FORMAT, FRAGMENT_GLOB, MANIFEST, REQUIRED_SIDECARS
from dsv41_convert.store.rank_names import RANK_FILE, rank_file_name

INDEX_MOST = 1 << 28  # bytes of an index read for its shard names (the published one's is 8 MB)


@dataclass
class CheckResult:
    folder: str
    checked: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # one line per bad file, naming it
    unchecked: list[str] = field(default_factory=list)  # other entries of the folder (`NAME/` a folder): see others
    not_listed: int = 0  # the first lines of problems: what the manifest should list and does not (unlisted)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def mismatched(self) -> int:
        """How many listed files are missing or differ from their record (the problems past `not_listed`)."""
        return len(self.problems) - self.not_listed

    def to_json(self) -> dict[str, Any]:
        """`check --json`'s document; its `exit_code` as verify's carries one (a torchrun launch's reader takes a
        document without one for a success)."""
        return {
            "folder": self.folder,
            "ok": self.ok,
            "exit_code": 0 if self.ok else CHECK_FAILED,
            "checked": self.checked,
            "problems": self.problems,
            "unchecked": self.unchecked,
        }


def read_manifest(folder: Path) -> dict[str, Any]:
    """OUT/manifest.json, checked for shape; VerifyInputError names what is wrong."""
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise VerifyInputError(f"{folder}: {'not a folder' if Path(folder).exists() else 'no such folder'}")
    refuse_non_file(path, VerifyInputError)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise VerifyInputError(f"{path}: not found; {_without_manifest(Path(folder))}") from exc
    except (OSError, *NOT_JSON) as exc:
        raise VerifyInputError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise VerifyInputError(f"{path}: format {found!r}, expected {FORMAT!r}")
    files = data.get("files")
    if not isinstance(files, dict) or not files:
        raise VerifyInputError(f"{path}: no `files` object listing the output files")
    for name, rec in files.items():
        ok = is_record(rec)
        if not ok or not name or "/" in name or name.startswith("."):
            raise VerifyInputError(f"{path}: entry {name!r} is not a plain file name with size and sha256")
    return data


def is_record(rec: Any) -> bool:
    """Whether `rec` is a file's record of a manifest or a fragment: {"size": a file size, "sha256": str}. A size
    below 0 was reported as a file that differs (exit 1), and one past any file's (10**400) ended `check` and
    `manifest` in a traceback (OverflowError) showing its progress (an audit): either is a damaged manifest."""
    size, digest = (rec.get("size"), rec.get("sha256")) if isinstance(rec, dict) else (None, None)
    return type(size) is int and 0 <= size <= INT64_MAX and isinstance(digest, str)


def our_manifest(folder: Path) -> dict[str, Any] | None:
    """OUT/manifest.json as read_manifest reads it, or None where there is none, or it is not one of ours or
    not well formed: for a question it may not answer (did a run of ours write here? what sha256 does it
    record?), never for a check."""
    try:
        return read_manifest(folder)
    except VerifyInputError:
        return None


def _without_manifest(folder: Path) -> str:
    """Why a folder may have no manifest.json: a run stopped half-way, or shares of the ranks not yet merged."""
    partial = sorted(p.name for p in folder.glob("*.partial"))
    if partial:
        return (
            f"an unfinished conversion ({counted(len(partial), '.partial file')}: {first_few(partial, 2)}); "
            "continue it with `shard` or `export` and --resume"
        )
    if any(folder.glob(FRAGMENT_GLOB)):
        export = _exported_by(folder)
        if export is not None:  # `manifest` refuses an export's fragments (manifest_merge._not_an_export)
            finish = finish_export(folder, *export)
            return f"it holds fragments of shares of an export: gather every share's shards and fragments; {finish}"
        return "it holds fragments of shares of the ranks: gather every share, then run `dsv41-convert manifest`"
    if (folder / DONE_DIR).is_dir():
        return (
            f"an unfinished conversion ({MANIFEST} is the last file a run writes); continue it with `shard` or "
            "`export` and --resume"
        )
    return f"was {folder} written by `dsv41-convert shard` or `export`?"


def finish_export(out: Path, fmt: str, src: str) -> str:
    """What finishes an export whose shares left fragments in `out` (`fmt`: its --format, `src`: its source)."""
    return f"finish the export with `dsv41-convert export {src} {out} --format {fmt} --resume`"


def _exported_by(folder: Path) -> tuple[str, str] | None:
    """(--format, source path) of the first fragment in `folder` that an export's share wrote, None where none
    did (an unreadable fragment is `manifest`'s to name)."""
    for path in sorted(folder.glob(FRAGMENT_GLOB)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, *NOT_JSON):
            continue
        options = data.get("options") if isinstance(data, dict) else None
        fmt = options.get("format") if isinstance(options, dict) else None
        if isinstance(fmt, str):
            source = data.get("source")
            src = source.get("path") if isinstance(source, dict) else None
            return fmt, src if isinstance(src, str) and src else "SRC"
    return None


def check_folder(
    folder: Path,
    progress: Progress | None = None,
    threads: int | None = None,
    tp: int | None = None,
    besides: frozenset[str] = frozenset(),
    manifest: dict[str, Any] | None = None,
) -> CheckResult:
    """Check sizes, then sha256, of every file in the manifest, `threads` files at a time (None: one per
    usable core, file_digest.hash_threads). tp: the rank files of that tp are the ones checked (verify --tp
    picked them): those of another tp beside them are not this conversion's problem. besides: names of files
    the caller knows are no part of the conversion (verify's reference file, kept in the folder).
    manifest: read_manifest(folder), where the caller read it already (`check`, before its progress display,
    so that a folder without one is refused before the display's title); None reads it here.
    -> CheckResult (ok when no problems), files in name order."""
    folder = Path(folder)
    manifest = read_manifest(folder) if manifest is None else manifest
    files = manifest["files"]
    listed = {
        name: (folder / name, Recorded(rec["size"], rec["sha256"], "manifest")) for name, rec in sorted(files.items())
    }
    result = CheckResult(str(folder))
    result.problems += unlisted(folder, manifest, tp, besides)
    result.not_listed = len(result.problems)
    result.unchecked = others(folder, manifest, besides)
    for name, problem in mismatches(listed, threads, progress).items():
        (result.problems if problem else result.checked).append(problem or name)
    return result


def others(folder: Path, manifest: dict[str, Any], besides: frozenset[str] = frozenset()) -> list[str]:
    """The folder's other entries, neither listed, nor .safetensors (unlisted's), nor the runs' own records
    (hidden ones, the shares' manifest fragments), nor named `besides`: files put beside the conversion (a
    generation_config.json, a model card, a chat template folder as `NAME/`), which a loader may read but the
    manifest cannot vouch for."""
    files = manifest["files"]
    return [
        f"{p.name}/" if p.is_dir() else p.name
        for p in sorted(folder.iterdir())
        if p.name not in files
        and p.name not in (MANIFEST, *besides)
        and not p.name.startswith(".")
        and p.suffix != ".safetensors"
        and not fnmatch(p.name, FRAGMENT_GLOB)
    ]


def unlisted(
    folder: Path, manifest: dict[str, Any], checked_tp: int | None = None, besides: frozenset[str] = frozenset()
) -> list[str]:
    """What the manifest should list and does not: a rank file of its own tp and the configs beside them (a shard
    manifest), an export's config.json and index, and any .safetensors file in the folder (another
    conversion's, or one copied in): verify would load or ask about it, so a folder holding it is not the
    conversion the manifest describes. checked_tp: rank files of another tp are left out (a verify run picked
    that tp's set), and so are the files named `besides`."""
    files = manifest["files"]
    tp = recorded_tp(manifest)
    problems = []
    if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0:
        problems += _missing_ranks(folder, files, tp)
    run, always = _always_written(manifest, tp)
    problems += [
        f"{name}: {run} writes it, not listed in {MANIFEST}"
        + ("" if (folder / name).exists() else " nor in the folder")
        for name in always
        if name not in files
    ]
    problems += _index_shards_unlisted(folder, files) if INDEX_NAME in files else []
    problems += [
        f"{p.name}: in the folder but not in {MANIFEST} (another conversion's file?)"
        for p in sorted(folder.glob("*.safetensors"))
        if p.name not in files
        and p.name not in besides
        and not any(x.startswith(f"{p.name}:") for x in problems)
        and not (checked_tp and (m := RANK_FILE.fullmatch(p.name)) and int(m[2]) != checked_tp)
    ]
    return problems


def _index_shards_unlisted(folder: Path, files: dict[str, Any]) -> list[str]:
    """A line for each shard the listed index's weight_map names that `files` does not list: an export's
    manifest edited to drop a shard (the shard removed too) passed `check`, exit 0, while a loader reading the
    index looks for that shard (a helper's hunt). An index that is no regular file, larger than INDEX_MOST or
    no JSON object with a weight_map object adds nothing here: its own size and sha256 check speaks for it."""
    path = folder / INDEX_NAME
    try:
        if not path.is_file() or path.stat().st_size > INDEX_MOST:
            return []
        weight_map = json.loads(path.read_bytes()).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return []
    named = {f for f in weight_map.values() if isinstance(f, str)} if isinstance(weight_map, dict) else set()
    return [
        f"{name}: {INDEX_NAME} names it, not listed in {MANIFEST}"
        + ("" if (folder / name).exists() else " nor in the folder")
        for name in sorted(named - set(files))
    ]


def _always_written(manifest: dict[str, Any], tp: Any) -> tuple[str, tuple[str, ...]]:
    """(which run, the files besides its weights that it always writes) for a shard or export manifest, else
    ("", ()): a manifest edited to drop config.json let `check` pass a config.json changed after the run (an
    audit)."""
    if tp is not None:
        return "a shard conversion", REQUIRED_SIDECARS
    options = manifest.get("options")
    if isinstance(options, dict) and isinstance(options.get("format"), str):
        return "an export", ("config.json", INDEX_NAME)
    return "", ()


def recorded_tp(manifest: dict[str, Any]) -> Any:
    """The tp a manifest's options record (a shard manifest), as written: None where there is none."""
    options = manifest.get("options")
    return options.get("tp") if isinstance(options, dict) else None


def _missing_ranks(folder: Path, files: dict[str, Any], tp: int, each: int = 16) -> list[str]:
    """A line for each rank file of a tp-`tp` conversion that `files` does not list; past `each` of them, one
    line (a manifest saying tp 1000000000 is not a billion lines, nor a billion steps)."""
    listed = sum(1 for name in files if (m := RANK_FILE.fullmatch(name)) and int(m[2]) == tp and int(m[1]) < tp)
    if tp - listed > each:
        first = [name for r in range(min(tp, len(files) + 3)) if (name := rank_file_name(r, tp)) not in files][:3]
        return [f"{MANIFEST} says tp {tp} but lists {listed} of its rank files ({', '.join(first)}, ... missing)"]
    return [
        f"{name}: a tp-{tp} conversion's rank file ({MANIFEST} says tp {tp}), "
        + ("not listed in it" if (folder / name).exists() else "neither listed in it nor in the folder")
        for r in range(tp)
        if (name := rank_file_name(r, tp)) not in files
    ]
