"""Shared fixtures. GPU tests skip themselves where CUDA or tilelang is missing."""

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available() and importlib.util.find_spec("tilelang") is not None
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs CUDA and tilelang")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
