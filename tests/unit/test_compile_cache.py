"""The TileLang kernel cache folder: $TILELANG_CACHE_DIR wins, else $XDG_CACHE_HOME, else ~/.cache; and the
kernels' shared module points TileLang at it (TileLang's own default, ~/.tilelang/cache, is never used)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv41_convert.kernels.compile_cache import CACHE_ENV, cache_dir, configure


def test_explicit_folder_wins():
    assert cache_dir({CACHE_ENV: "/x/tl", "XDG_CACHE_HOME": "/y", "HOME": "/h"}) == Path("/x/tl")


def test_xdg_cache_home_then_home():
    assert cache_dir({"XDG_CACHE_HOME": "/y", "HOME": "/h"}) == Path("/y/dsv41-convert/tilelang")
    assert cache_dir({"XDG_CACHE_HOME": "", "HOME": "/h"}) == Path("/h/.cache/dsv41-convert/tilelang")


def test_configure_sets_the_variable_tilelang_reads():
    env = {"HOME": "/h"}
    assert configure(env) == Path("/h/.cache/dsv41-convert/tilelang")
    assert env[CACHE_ENV] == "/h/.cache/dsv41-convert/tilelang"


@pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="needs tilelang")
def test_tilelang_uses_the_folder(tmp_path):
    """After the kernels' shared module is imported, TileLang's own setting names our folder."""
    env = {k: v for k, v in os.environ.items() if k != CACHE_ENV} | {"XDG_CACHE_HOME": str(tmp_path)}
    code = "import dsv41_convert.kernels.tl; from tilelang import env; print(env.TILELANG_CACHE_DIR)"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == str(tmp_path / "dsv41-convert" / "tilelang")
