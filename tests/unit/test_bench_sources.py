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


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E8M0", "BF16", "F32"])
def test_bench_shard_source_bytes_are_finite_in_every_dtype(monkeypatch, dtype):
    """`bench_shard.py` without --src wrote uniformly random bytes (NaN in every dtype), and shard refuses a
    non-finite value it copies (quant/byte_checks, session 23): every run ended in `found nan at index ...`.
    The pool is written at shifting offsets, so every alignment of it must be finite."""
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("bench_shard", None)
    from bench_shard import source_bytes

    from dsv41_convert.quant.byte_checks import first_nonfinite

    pool = source_bytes(1 << 20)
    assert len(pool) == 1 << 20
    for shift in range(4):
        assert first_nonfinite(pool[shift : shift + (1 << 19)], dtype) is None
