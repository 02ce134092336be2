"""Is a downloaded checkpoint folder whole? Checks that need no network.

Three layers, each one cheap enough to run on its own:
- the download record (`Record`): every file's size, sha256 (LFS files) and git blob id, as the Hub
  published them at download time, saved beside the files so `--verify-only` works offline;
- file checks against that record: present, right size, right hash (store/file_digest.py, shared with
  our own manifests' check);
- checkpoint checks from the files themselves: each safetensors header passes `safetensors_header`'s
  checks (its tensors tile 8 + header + data == the file size), and `model.safetensors.index.json`
  names exactly the tensors of each shard.

Nothing here talks to the Hub or prints; `download.py` does the fetching.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from dsv41_convert.errors import DownloadError, HeaderError
from dsv41_convert.progress import Progress
from dsv41_convert.store.file_digest import Problem, Recorded, differences, hash_threads
from dsv41_convert.store.index import EXPECTED, bad_shard_names, shard_name_problem
from dsv41_convert.store.safetensors_header import read_header

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a Hub revision. `sha256` is set for LFS files; `git_sha1` (the git blob id) for all."""

    path: str
    size: int
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass(frozen=True)
class Record:
    """What the Hub said about a revision when we downloaded it; saved as JSON beside the files."""

    repo_id: str
    revision: str  # as asked: a branch, tag or commit
    commit: str  # what it resolved to
    files: tuple[RemoteFile, ...]  # every file of the revision
    include: tuple[str, ...] = ()  # the selection downloaded (globs); verify checks the same by default
    exclude: tuple[str, ...] = ()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"format": 1, **asdict(self), "files": [asdict(f) for f in self.files]}
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)

    @staticmethod
    def load(path: Path) -> Record | None:
        """The record at `path`, or None if there is none. A record we cannot read is an error, not None."""
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            files = tuple(RemoteFile(**f) for f in data["files"])
            return Record(
                data["repo_id"],
                data["revision"],
                data["commit"],
                files,
                tuple(data.get("include", ())),
                tuple(data.get("exclude", ())),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DownloadError(
                f"{path}: unreadable download record ({exc}); download again, or delete it to check headers only"
            ) from exc


def check_files(
    root: Path,
    files: Iterable[RemoteFile],
    *,
    workers: int = 4,
    progress: Progress | None = None,
    where: str = "download record",
) -> list[Problem]:
    """Compare each file under `root` with its record: presence, size, then hash (sha256 if LFS, else the git
    blob id), at most `workers` files at a time and no more than file_digest.hash_threads gives. Problems come
    back in the order of `files`, naming the record as `where`; progress("verify", bytes checked, total)."""
    listed = {f.path: (root / f.path, Recorded(f.size, f.sha256, where, git_sha1=f.git_sha1)) for f in files}
    total = sum(rec.size for _, rec in listed.values())
    hashed: dict[str, int] = {}  # bytes hashed so far, per file
    verified = 0
    lock = threading.Lock()

    def tick(name: str, done: int, size: int) -> None:
        nonlocal verified
        with lock:
            verified += done - hashed.get(name, 0)
            hashed[name] = done
            progress("verify", verified, total)

    threads = min(max(1, workers), hash_threads(len(listed)))  # no more threads than cores: they would only wait
    found = differences(listed, threads, tick if progress is not None else None)
    if progress is not None:
        progress("verify", total, total)
    return [p for p in found.values() if p is not None]


# --- safetensors headers and the index ---


def _header_names(root: Path, rel: str) -> set[str]:
    """Tensor names of one shard after the full header check; raises HeaderError with what is wrong."""
    return set(read_header(root / rel).tensors)


def check_checkpoint(root: Path, paths: Iterable[str]) -> list[Problem]:
    """Headers and index of the safetensors files among `paths` (relative to `root`).

    - every `*.safetensors` in `paths` that exists: the header parses and its tensors tile the file;
    - if the index is among `paths`: each shard it names exists, and the tensor names the index gives
      that shard equal the names in the shard's header.
    A listed file that does not exist is left to `check_files` (it reports it as missing), except shards
    named by the index, which are reported here.
    """
    paths = list(paths)
    problems: list[Problem] = []
    names: dict[str, set[str] | None] = {}  # None: the header is broken, already reported
    for rel in paths:
        path = root / rel
        if not rel.endswith(".safetensors") or not path.is_file():
            continue
        try:
            names[rel] = _header_names(root, rel)
        except HeaderError as exc:
            names[rel] = None
            problems.append(_header_problem(root, rel, exc))
    if INDEX_NAME in paths and (root / INDEX_NAME).is_file():
        problems += _check_index(root, names)
    return problems


def _check_index(root: Path, names: dict[str, set[str] | None]) -> list[Problem]:
    try:
        weight_map = json.loads((root / INDEX_NAME).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [Problem(INDEX_NAME, "index", f"unreadable ({exc})", "JSON with a weight_map")]
    if not isinstance(weight_map, dict):
        return [Problem(INDEX_NAME, "index", "no weight_map object", "JSON with a weight_map")]
    bad = bad_shard_names(weight_map)
    problems = [Problem(INDEX_NAME, "index", f"shard name {b.found()}", EXPECTED) for b in bad]
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        if shard_name_problem(shard) is None:  # never open what a bad name points at
            by_shard.setdefault(shard, set()).add(tensor)
    for shard, want in sorted(by_shard.items()):
        if not (root / shard).is_file():
            problems.append(Problem(shard, "missing", "no file", f"a shard with {len(want)} tensors ({INDEX_NAME})"))
            continue
        if shard in names and names[shard] is None:
            continue
        have = names.get(shard)
        if have is None:
            try:
                have = _header_names(root, shard)
            except HeaderError as exc:
                problems.append(_header_problem(root, shard, exc))
                continue
        if have != want:
            extra, lost = sorted(have - want), sorted(want - have)
            problems.append(
                Problem(
                    shard,
                    "index",
                    f"{len(extra)} tensors not in the index {_few(extra)}",
                    f"{len(lost)} tensors the index puts here {_few(lost)}",
                )
            )
    return problems


def _header_problem(root: Path, rel: str, exc: HeaderError) -> Problem:
    found = str(exc).removeprefix(f"{root / rel}: ")
    return Problem(rel, "header", found, "a header whose tensors tile the file exactly (8 + header + data bytes)")


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return f"({shown}{', ...' if len(names) > 3 else ''})" if names else ""
