"""The hashes huggingface_hub itself keeps of what it downloaded, for folders fetched without us.

A folder downloaded by `hf download` / `snapshot_download` has no record of ours, but huggingface_hub
leaves the Hub's ETag of every file it wrote, and the ETag is the file's digest: the sha256 of an LFS file
(every .safetensors shard), the git blob id of any other file.
- local dir: `FOLDER/.cache/huggingface/download/{path}.metadata`, three lines: commit, ETag, time;
- HF cache: `snapshots/{commit}/{path}` is a link to `blobs/{ETag}`.
Neither names the repo, so a folder checked this way is known whole but not known to be of the repo asked.
Nothing here writes: huggingface_hub's own reader removes metadata it finds malformed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dsv41_convert.hub.integrity import RemoteFile
from dsv41_convert.store.file_digest import SHA256_HEX

SHA1_HEX = re.compile(r"[0-9a-f]{40}")
METADATA_DIR = Path(".cache") / "huggingface" / "download"


@dataclass(frozen=True)
class HubMetadata:
    """What huggingface_hub recorded of a folder's files.

    files: one RemoteFile per file it has a digest for (size: the file's own, the digest decides);
    commit_of: path of each of those files -> the commit it was downloaded at (local dir: from its metadata;
    cache: the snapshot's);
    where: where the digests came from, in words."""

    files: tuple[RemoteFile, ...]
    commit_of: dict[str, str]
    where: str

    @property
    def commits(self) -> frozenset[str]:
        """The commits the files were downloaded at: several where `hf download --revision` runs of different
        commits wrote into one folder."""
        return frozenset(self.commit_of.values())


def hub_metadata(folder: Path, paths: Iterable[str]) -> HubMetadata:
    """Digests huggingface_hub left for `paths` (relative, '/'-separated) of `folder`; files without one are
    left out. A folder inside an HF cache's snapshots/ is read from its links, any other from .cache/."""
    folder = Path(folder)
    in_cache = folder.parent.name == "snapshots" and SHA1_HEX.fullmatch(folder.name) is not None
    files, commit_of = [], {}
    for path in paths:
        found = _from_link(folder, path) if in_cache else _from_metadata_file(folder, path)
        if found is None:
            continue
        commit, etag = found
        sha256, git_sha1 = (etag, None) if SHA256_HEX.fullmatch(etag) else (None, etag)
        files.append(RemoteFile(path, (folder / path).stat().st_size, sha256=sha256, git_sha1=git_sha1))
        commit_of[path] = commit or folder.name
    where = "the HF cache's blob names" if in_cache else f"huggingface_hub's {METADATA_DIR.as_posix()}/*.metadata"
    return HubMetadata(tuple(files), commit_of, where)


def _from_link(folder: Path, path: str) -> tuple[None, str] | None:
    """(None, ETag) of a snapshot file that links to blobs/{ETag}, else None (a copy, or no such file)."""
    try:
        target = os.readlink(folder / path)
    except OSError:
        return None
    etag = Path(target).name
    return (None, etag) if _is_digest(etag) and (folder / path).is_file() else None


def _from_metadata_file(folder: Path, path: str) -> tuple[str, str] | None:
    """(commit, ETag) from the file's .metadata, else None (none, unreadable, or not in the known format)."""
    try:
        lines = (folder / METADATA_DIR / f"{path}.metadata").read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if len(lines) < 2 or not SHA1_HEX.fullmatch(lines[0].strip()) or not _is_digest(lines[1].strip()):
        return None
    return lines[0].strip(), lines[1].strip()


def _is_digest(etag: str) -> bool:
    return SHA256_HEX.fullmatch(etag) is not None or SHA1_HEX.fullmatch(etag) is not None
