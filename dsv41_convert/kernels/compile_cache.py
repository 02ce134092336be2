"""Where compiled TileLang kernels persist between runs, so each is compiled once per machine and version.

TileLang 0.1.15 has a disk cache of its own (tilelang/cache/kernel_cache.py): each compiled kernel is a
folder `<dir>/<tilelang version>/<os>-<arch>/kernels/<key>/` (the generated CUDA, the shared library,
the parameters), where key = sha256 of the kernel's TIR script (its static shapes, dtypes and body),
the target (the GPU architecture, e.g. sm_90a for an H100/H200), the pass configs, the execution backend
and the tilelang version. A later process with the same key loads the library instead of compiling.
Its default folder, ~/.tilelang/cache, is outside the user's cache folder; dsv41-convert points it at
$XDG_CACHE_HOME/dsv41-convert/tilelang (~/.cache/dsv41-convert/tilelang) before tilelang is imported,
unless TILELANG_CACHE_DIR is set. `rm -rf` of that folder is always safe (kernels compile again).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

CACHE_ENV = "TILELANG_CACHE_DIR"


def cache_dir(env: MutableMapping[str, str] = os.environ) -> Path:
    """The folder TileLang's kernel cache uses: $TILELANG_CACHE_DIR, else under the user's cache folder."""
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "dsv41-convert" / "tilelang"


def configure(env: MutableMapping[str, str] = os.environ) -> Path:
    """Point TileLang's kernel cache at `cache_dir()` (call before tilelang first compiles). -> the folder"""
    folder = cache_dir(env)
    env[CACHE_ENV] = str(folder)
    return folder
