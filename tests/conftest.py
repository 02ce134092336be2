"""Shared fixtures. GPU tests skip themselves where CUDA or tilelang is missing."""

import importlib.util
import os

import pytest
import torch

# Tiny models on a 2-core machine: one intra-op thread is many times faster than two contending ones,
# and spawned ranks inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available() and importlib.util.find_spec("tilelang") is not None
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs CUDA and tilelang")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_torch_thread_again():
    """Every test starts at the one intra-op thread set above: commands run in process (reference-logits,
    verify at tp 1, the demo) set their own count and keep it, and logits are bit-equal only at equal counts
    (the sums' order), so a count left by one test made a later one's comparison depend on the order."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
