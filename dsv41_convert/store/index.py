"""The names a safetensors index (model.safetensors.index.json) may give its shards.

An index's weight_map maps each tensor to a shard file. The shards are files beside the index, so a
value is a plain file name: not absolute, no folder part ("/" or "\\"), not "." or "..". Anything else
would make a reader open a file outside the checkpoint folder (`../elsewhere/x.safetensors`,
`/etc/passwd`), which a corrupt or hostile index must not be able to do. The check is on the name only:
a shard that is a symbolic link (the Hugging Face cache's snapshots/<rev>/<file> -> ../../blobs/<sha>)
is a plain name and is read through its link as before.
"""

from __future__ import annotations

import ntpath
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass, replace

from dsv41_convert.numbers import counted

INDEX_NAME = "model.safetensors.index.json"
EXPECTED = "a shard must be a file beside the index, so this index is corrupt or was tampered with"


def shard_name_problem(name: object) -> str | None:
    """Why `name` (a weight_map value) cannot name a shard beside the index, as a phrase that follows the
    name ("points outside the checkpoint folder"); None if it can."""
    if not isinstance(name, str) or not name:
        return "is not a file name"
    if posixpath.isabs(name) or ntpath.isabs(name) or ntpath.splitdrive(name)[0]:
        return "is an absolute path, outside the checkpoint folder"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return "points outside the checkpoint folder"
    if name == ".":
        return "names the folder itself"
    if len(parts) > 1:
        return "is a path with folders, not a file name beside the index"
    if "\0" in name:
        return "holds a NUL byte"
    if not name.endswith(".safetensors"):
        return "is not a .safetensors file"
    return None


@dataclass(frozen=True)
class BadShardName:
    """A weight_map value that cannot name a shard: the value, why, and the tensors mapped to it."""

    name: str  # repr of the value, for messages
    why: str  # phrase following the name
    example: str  # one tensor the index maps to it
    count: int  # how many

    def found(self) -> str:
        return f"{self.name} for {counted(self.count, 'tensor')} (e.g. {self.example}), which {self.why}"

    def describe(self) -> str:
        return f"{INDEX_NAME}: weight_map names {self.found()}; {EXPECTED}"


def bad_shard_names(weight_map: dict) -> list[BadShardName]:
    """Every value of `weight_map` that `shard_name_problem` refuses, once each, in index order."""
    found: dict[str, BadShardName] = {}
    checked: dict[str, str | None] = {}  # ~100k tensors name ~50 files: each file name is checked once
    for tensor, file in weight_map.items():
        if type(file) is str:
            why = checked[file] if file in checked else checked.setdefault(file, shard_name_problem(file))
        else:
            why = shard_name_problem(file)
        if why is None:
            continue
        key = repr(file)
        seen = found.get(key)
        found[key] = BadShardName(key, why, tensor, 1) if seen is None else replace(seen, count=seen.count + 1)
    return list(found.values())


def held_twice(files: Iterable[tuple[str, Iterable[str] | None]]) -> dict[str, dict[str, list[str]]]:
    """Tensors that more than one file holds (each tensor of a checkpoint belongs in one file).

    files: (file, its tensor names; None for an unreadable header), in the order that decides which file
           holds a tensor first
    -> file -> the earlier file that holds them first -> those tensors, in the file's order
    """
    first: dict[str, str] = {}  # tensor -> the first file holding it
    twice: dict[str, dict[str, list[str]]] = {}
    for file, names in files:
        for name in names or ():
            other = first.setdefault(name, file)
            if other != file:
                twice.setdefault(file, {}).setdefault(other, []).append(name)
    return twice
