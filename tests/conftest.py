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
