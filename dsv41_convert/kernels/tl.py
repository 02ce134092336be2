"""TileLang as every kernel module imports it, with the names they share: dtype aliases and the pass
configs. Its kernel cache persists in the folder compile_cache.py names. Its log lines go to stderr,
since stdout carries `--json` (TileLang logs each compile at INFO through tqdm.write, which prints to
stdout).
"""

import logging
import sys

import tilelang
import tilelang.language as T
import torch

from dsv41_convert.kernels import compile_cache

compile_cache.configure()  # TileLang reads TILELANG_CACHE_DIR at its first compile, not at import

# dtype aliases
F32 = "float32"
BF16 = "bfloat16"
E4M3 = "float8_e4m3fn"
U8 = "uint8"
I32 = "int32"  # bit patterns as int32: every value used fits, and TVM folds signed arithmetic safely
TL_DTYPES = {torch.bfloat16: BF16, torch.float16: "float16", torch.float32: F32}

# pass configs of every kernel: IEEE division, accurate expf, no reassociation (the references are
# torch's IEEE arithmetic)
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}


class _Stderr(logging.Handler):
    """Writes each record to the sys.stderr of the moment (not the one current at import)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def _log_to_stderr() -> None:
    logger = logging.getLogger("tilelang")
    for handler in list(logger.handlers):
        if not isinstance(handler, _Stderr):
            logger.removeHandler(handler)
            stderr = _Stderr()
            stderr.setFormatter(handler.formatter)
            logger.addHandler(stderr)


_log_to_stderr()

__all__ = ["BF16", "E4M3", "F32", "I32", "PASS_CONFIGS", "TL_DTYPES", "U8", "T", "tilelang"]
