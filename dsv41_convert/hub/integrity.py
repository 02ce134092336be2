"""Is a downloaded checkpoint folder whole? Checks that need no network.

Four layers, each one cheap enough to run on its own:
- the download record (`Record`): every file's size, sha256 (LFS files) and git blob id, as the Hub
  published them at download time, saved beside the files so `--verify-only` works offline;
- file checks against that record: present, right size, right hash (store/file_digest.py, shared with
  our own manifests' check);
- checkpoint checks from the files themselves: each safetensors header passes `safetensors_header`'s
  checks (its tensors tile 8 + header + data == the file size), and `model.safetensors.index.json`
  names exactly the tensors of each shard;
- with `whole=True`, that the folder is a whole checkpoint as `shard` reads it (`_check_whole`):
  config.json, the weights, an index wherever there are several shards, every shard it names and no
  other `*.safetensors` beside it, no tensor in two files. Without a record, it is how `--verify-only`
  finds a file that is gone.

Nothing here talks to the Hub or prints; `download.py` does the fetching.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from huggingface_hub.utils import filter_repo_objects

from dsv41_convert.errors import DownloadError, HeaderError, first_few
from dsv41_convert.file_kinds import DANGLING, SPECIAL
from dsv41_convert.numbers import counted
from dsv41_convert.progress import Progress
from dsv41_convert.store.file_digest import Problem, Recorded, differences, hash_threads
from dsv41_convert.store.index import EXPECTED, bad_shard_names, held_twice, shard_name_problem
from dsv41_convert.store.manifest import atomic_write_changed
from dsv41_convert.store.safetensors_header import read_header

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
SHARD_OF = re.compile(r"(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.safetensors")  # as transformers names shards
WEIGHTS = f"the weights: one *.safetensors file, or shards with {INDEX_NAME}"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a Hub revision. `sha256` is set for LFS files; `git_sha1` (the git blob id) for all."""

    path: str
    size: int
    sha256: str | None = None
    git_sha1: str | None = None


def repo_path_problem(path: object) -> str | None:
    """Why `path`, a file name of a Hub revision, may not be written under a download's folder, or None: it
    must be relative and stay inside (a listing from a broken or hostile HF_ENDPOINT named an absolute path,
    which `--local-dir` / path then was, and --overwrite replaced a file outside the folder: an audit)."""
    if not isinstance(path, str) or not path:
        return "not a file name"
    if path.startswith("/") or "\0" in path:
        return "not a relative path"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "an empty, . or .. part: a path out of the folder or into it twice"
    return None


@dataclass(frozen=True)
class Selection:
    """The files one download run asked for: --include and --exclude globs (none: every file)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def wants(self, path: str) -> bool:
        return bool(
            list(
                filter_repo_objects(
                    [path], allow_patterns=list(self.include) or None, ignore_patterns=list(self.exclude) or None
                )
            )
        )

    def matches_nothing(self, where: str, among: str = "", then: str = "") -> DownloadError:
        """The error for globs that select no file at `where` (`among`: what they were matched against; `then`:
        what that means for the command)."""
        return DownloadError(
            f"{where}: no file matches --include {list(self.include)} --exclude {list(self.exclude)}"
            + (f" ({among})" if among else "")
            + then
        )


EVERY_FILE = Selection()


def wanted(path: str, selections: Iterable[Selection]) -> bool:
    """Whether any of `selections` asks for `path`."""
    return any(s.wants(path) for s in selections)


def selected(files: Iterable[RemoteFile], selections: tuple[Selection, ...]) -> list[RemoteFile]:
    """The files any of `selections` asks for, in their order."""
    return [f for f in files if wanted(f.path, selections)]


@dataclass(frozen=True)
class Record:
    """What the Hub said about a revision when we downloaded it; saved as JSON beside the files."""

    repo_id: str
    revision: str  # as asked: a branch, tag or commit
    commit: str  # what it resolved to
    files: tuple[RemoteFile, ...]  # every file of the revision
    # what the runs at this commit into the folder asked for; verify checks the files any of them wants
    selections: tuple[Selection, ...] = (EVERY_FILE,)
    # files a run put in the folder and found right (theirs to replace); None: a record from before
    # 2026-12-05, which counted every selected file as fetched
    fetched: tuple[str, ...] | None = None
    # the other names earlier runs into the folder gave this commit (a tag, then its hash): each still names it
    names: tuple[str, ...] = ()

    def save(self, path: Path) -> None:
        data = {
            "format": 2,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "selections": [asdict(s) for s in self.selections],
            "files": [asdict(f) for f in self.files],
        }
        if self.fetched is not None:
            data["fetched"] = sorted(self.fetched)
        if self.names:
            data["names"] = list(self.names)
        # a temporary of this process's own: the ranks of a torchrun launch resolve one repo into one HF cache
        # at once, and with one temporary name they renamed it from under each other (FileNotFoundError) or
        # installed it empty (an audit)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_changed(path, (json.dumps(data, indent=1) + "\n").encode())

    @staticmethod
    def load(path: Path) -> Record | None:
        """The record at `path`, or None if there is none. A record we cannot read is an error, not None.
        One of format 1 (a single selection as "include" / "exclude") reads as that selection."""
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            files = tuple(RemoteFile(**f) for f in data["files"])
            if "selections" in data:
                selections = tuple(Selection(tuple(s["include"]), tuple(s["exclude"])) for s in data["selections"])
            else:
                selections = (Selection(tuple(data.get("include", ())), tuple(data.get("exclude", ()))),)
            if not selections or not all(isinstance(g, str) for s in selections for g in s.include + s.exclude):
                raise ValueError("no selection, or a glob that is not a string")
            for f in files:
                if (why := repo_path_problem(f.path)) is not None:
                    raise ValueError(f"file {f.path!r}: {why}")
            fetched = data.get("fetched")
            if fetched is not None and not (isinstance(fetched, list) and all(isinstance(p, str) for p in fetched)):
                raise ValueError("fetched is not a list of file names")
            for name in fetched or ():  # removed by --overwrite at another revision: never a path out of the folder
                if (why := repo_path_problem(name)) is not None:
                    raise ValueError(f"fetched {name!r}: {why}")
            names = data.get("names", [])
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise ValueError("names is not a list of revision names")
            return Record(
                data["repo_id"], data["revision"], data["commit"], files, selections,
                None if fetched is None else tuple(fetched), tuple(names),
            )  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DownloadError(
                f"{path}: unreadable download record ({exc}); delete it: the next `download` checks every file "
                "there against the Hub and records them again (`--verify-only` without it checks headers only)"
            ) from exc

    def selected(self) -> list[RemoteFile]:
        """The files of the revision any of the record's selections asks for."""
        return selected(self.files, self.selections)

    def ours(self) -> set[str]:
        """The paths runs at this commit put in the folder (an older record: every selected file)."""
        return {f.path for f in self.selected()} if self.fetched is None else set(self.fetched)


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


def check_checkpoint(root: Path, paths: Iterable[str], *, whole: bool = False) -> list[Problem]:
    """Headers and index of the safetensors files among `paths` (relative to `root`).

    - every `*.safetensors` in `paths` that exists: the header parses and its tensors tile the file;
    - if the index is among `paths`: each shard it names exists, and the tensor names the index gives
      that shard equal the names in the shard's header;
    - whole=True: also that `root` is a whole checkpoint (`_check_whole`).
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
    has_index = INDEX_NAME in paths and (root / INDEX_NAME).is_file()
    weight_map = None
    if has_index:
        found, weight_map = _check_index(root, names)
        problems += found
    if whole:
        problems += _check_whole(root, paths, names, has_index, weight_map)
    return problems


def _check_index(root: Path, names: dict[str, set[str] | None]) -> tuple[list[Problem], dict | None]:
    """-> (problems, the weight_map, or None where it is unreadable)"""
    try:
        weight_map = json.loads((root / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [Problem(INDEX_NAME, "index", f"unreadable ({exc})", "JSON with a weight_map")], None
    if not isinstance(weight_map, dict):
        return [Problem(INDEX_NAME, "index", "no weight_map object", "JSON with a weight_map")], None
    bad = bad_shard_names(weight_map)
    problems = [Problem(INDEX_NAME, "index", f"shard name {b.found()}", EXPECTED) for b in bad]
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        if shard_name_problem(shard) is None:  # never open what a bad name points at
            by_shard.setdefault(shard, set()).add(tensor)
    for shard, want in sorted(by_shard.items()):
        if not (root / shard).is_file():
            problems.append(
                Problem(shard, "missing", "no file", f"a shard with {counted(len(want), 'tensor')} ({INDEX_NAME})")
            )
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
            found = counted(len(have), "tensor") + (
                f", {len(extra)} of them not in the index {_few(extra)}" if extra else ""
            )
            expected = f"the {counted(len(want), 'tensor')} the index puts here" + (
                f", {len(lost)} of them absent from the file {_few(lost)}" if lost else ""
            )
            problems.append(Problem(shard, "index", found, expected))
    return problems, weight_map


def _check_whole(
    root: Path, paths: list[str], names: dict[str, set[str] | None], has_index: bool, weight_map: dict | None
) -> list[Problem]:
    """Is `root` a whole checkpoint, as far as the files themselves can tell? One problem per file, naming it:

    - config.json is missing;
    - no `*.safetensors` file and no index: no weights;
    - with the index: a `*.safetensors` file it does not name (extra; a shard it names but that is gone is
      `_check_index`'s);
    - without it: several shards (or one whose name says "of n" > 1), each shard the names' k-of-n count
      that is not there, and a shard of another count;
    - a tensor in two files (duplicate; `shard` refuses it);
    - anything but a file at a `*.safetensors` name at the top of `root` that the index does not name (a folder,
      a link to no file, a FIFO): `shard` reads every such entry and refuses it, where the files' lists passed
      it ("no other *.safetensors", exit 0: an audit).
    The shards are the `*.safetensors` of `paths` at the top of `root`, which is what `shard` reads. What it
    cannot find: a shard dropped from both the index and the folder, a tensor dropped from both the index
    and its shard, and any file but config.json and the weights that is gone (the tokenizer).
    """
    problems = []
    if not (root / CONFIG_NAME).is_file():
        problems.append(Problem(CONFIG_NAME, "missing", "no file", "the model's config.json (plan and shard read it)"))
    top = sorted(p for p in paths if "/" not in p and p.endswith(".safetensors") and (root / p).is_file())
    if not top and not has_index:
        problems.append(Problem("model.safetensors", "missing", "no *.safetensors file", WEIGHTS))
    named = set() if weight_map is None else {shard for shard in weight_map.values() if isinstance(shard, str)}
    for entry in sorted(root.glob("*.safetensors")):  # every entry so named, as `shard` lists them
        what = _not_a_file(entry)
        if what is not None and entry.name not in named:  # a shard the index names: _check_index says it is missing
            problems.append(
                Problem(
                    entry.name,
                    "extra",
                    what,
                    f"a shard file or nothing of that name: `shard` reads every *.safetensors here; move {entry.name} "
                    "out",
                )
            )
    if weight_map is not None:
        for rel in top:
            if rel not in named:
                problems.append(
                    Problem(
                        rel,
                        "extra",
                        f"a *.safetensors file {INDEX_NAME} does not name{_held(names[rel])}",
                        f"only the shards the index names: `shard` reads every *.safetensors here; move {rel} out",
                    )
                )
    elif not has_index:
        problems += _check_shard_names(top)
        several = [m for m in map(SHARD_OF.fullmatch, top) if m and int(m["n"]) > 1]
        if len(top) > 1 or several:
            problems.append(
                Problem(
                    INDEX_NAME,
                    "missing",
                    f"no file, beside {counted(len(top), 'shard')}",
                    "the index, which says which shard holds each tensor (only a single-file checkpoint has none)",
                )
            )
    return problems + _duplicates(top, names)


def _not_a_file(path: Path) -> str | None:
    """What stands at `path` in place of a regular file (links followed); None for a file or nothing there."""
    if path.is_file():
        return None
    if path.is_dir():
        return "a folder"
    if path.is_symlink() and not path.exists():
        return DANGLING
    return SPECIAL if path.exists() else None


def _check_shard_names(top: list[str]) -> list[Problem]:
    """Without an index, the shard names are the count: of `{stem}-{k}-of-{n}.safetensors`, each k of 1..n
    present, and no shard of another stem or n (the set with the most files is the checkpoint's)."""
    numbered = {rel: m for rel in top if (m := SHARD_OF.fullmatch(rel))}
    if not numbered:
        return []
    sets = Counter((m["stem"], m["n"]) for m in numbered.values())
    (stem, n), _ = max(sets.items(), key=lambda kv: (kv[1], kv[0]))
    problems = []
    for rel, m in numbered.items():
        if (m["stem"], m["n"]) != (stem, n) or not 1 <= int(m["k"]) <= int(n):
            problems.append(
                Problem(
                    rel, "extra", f"shard {int(m['k'])} of {int(m['n'])}", f"shards 1 to {int(n)} of {stem}-*-of-{n}"
                )
            )
    for k in range(1, int(n) + 1):
        rel = f"{stem}-{k:05d}-of-{n}.safetensors"
        if rel not in numbered:
            problems.append(
                Problem(rel, "missing", "no file", f"shard {k} of the {int(n)} the other shards' names count")
            )
    return problems


def _duplicates(top: list[str], names: dict[str, set[str] | None]) -> list[Problem]:
    """One problem per file holding tensors an earlier file (in name order) already holds."""
    return [
        Problem(
            rel,
            "duplicate",
            "; ".join(
                f"{counted(len(ts), 'tensor')} also in {other} {_few(sorted(ts))}" for other, ts in sorted(by.items())
            ),
            "each tensor in one file (`shard` refuses a tensor held twice); a stray copy?",
        )
        for rel, by in held_twice((rel, names.get(rel)) for rel in top).items()
    ]


def _header_problem(root: Path, rel: str, exc: HeaderError) -> Problem:
    found = str(exc).removeprefix(f"{root / rel}: ")
    return Problem(rel, "header", found, "a header whose tensors tile the file exactly (8 + header + data bytes)")


def _held(names: set[str] | None) -> str:
    return "" if names is None else f" ({counted(len(names), 'tensor')})"  # None: its header is broken, said already


def _few(names: list[str]) -> str:
    return f"({first_few(names)})" if names else ""
