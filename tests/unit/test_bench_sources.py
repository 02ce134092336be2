"""The benchmarks' own checkpoints are ones the tool accepts: bench_shard's config broke silently when the
config checks grew (a DSpark noise token beyond its 32768-token vocabulary: an audit found `write_source`
raising ConfigError, so `bench_shard.py` without --src could not run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dsv41_convert.config import ModelArgs

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("n_layers", [3, 6])
def test_bench_shard_config_is_a_model_the_tool_runs(monkeypatch, n_layers):
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_shard", None)
    from bench_shard import bench_config

    args = ModelArgs.from_hf_dict(bench_config(n_layers, 16), "bench_shard config")
    assert args.n_layers == n_layers and args.dspark_noise_token_id < args.vocab_size
