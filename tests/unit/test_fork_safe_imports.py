"""Importing the package starts no thread: verify's ranks and shard's workers are forked from a server that
imported these modules, and a child forked after torch's OpenMP pool started hangs in its first parallel op
(verify --tp 2 --threads 2 waited forever on a table built at import by a 65536-element op)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")

COUNT = textwrap.dedent(
    """
    import importlib, os, pkgutil, sys
    import torch
    import dsv41_convert
    def threads():
        return len(os.listdir("/proc/self/task"))
    base = threads()
    for mod in pkgutil.walk_packages(dsv41_convert.__path__, "dsv41_convert."):
        before = threads()
        importlib.import_module(mod.name)
        if threads() != before:
            print(f"{mod.name}: {before} -> {threads()} threads")
            sys.exit(1)
    print(f"{base} threads before and after")
    """
)


def without_omp_limit() -> dict[str, str]:
    """The environment without conftest's OMP_NUM_THREADS=1, under which no pool ever starts (and the hang
    was never seen by the tests)."""
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


def test_no_module_of_the_package_starts_a_thread_at_import():
    done = subprocess.run(
        [sys.executable, "-c", COUNT], capture_output=True, text=True, timeout=300, env=without_omp_limit()
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_table_built_at_first_use_is_the_one_import_built():
    """The lazy tables give what encode_e2m1 / the float decode give (the tables are their caches)."""
    import torch

    from dsv41_convert.quant import fp4

    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.bfloat16)
    assert torch.equal(fp4._e2m1_of_bf16(), fp4.encode_e2m1(bits))
    packed = torch.randint(0, 256, (4, 16), dtype=torch.uint8)
    s = torch.randint(100, 150, (4, 1), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    fast = fp4.decode_mxfp4(packed, s, 32, torch.bfloat16)
    assert torch.equal(fast.view(torch.int16), fp4._decode_mxfp4_float(packed, s, 32, torch.bfloat16).view(torch.int16))


@pytest.mark.slow
def test_reference_on_two_ranks_of_two_threads_finishes(tmp_path):
    """The hang itself: reference-logits --tp 2 --threads 2 (what the default picks on a host with 4 or more
    cores) without OMP_NUM_THREADS; it waited forever, it takes seconds."""
    src, out = tmp_path / "src", tmp_path / "ref.safetensors"
    cli = [sys.executable, "-m", "dsv41_convert.cli"]
    subprocess.run([*cli, "make-tiny", str(src)], check=True, capture_output=True)  # with its real tokenizer
    cmd = [*cli, "reference-logits", str(src), str(out)]
    done = subprocess.run(
        [*cmd, "--tp", "2", "--threads", "2", "--decode-steps", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        env=without_omp_limit(),
    )
    assert done.returncode == 0 and out.is_file(), done.stderr[-2000:]
