"""TileLang as every kernel module imports it: its log lines go to stderr, since stdout carries `--json`.

TileLang logs each compile at INFO through tqdm.write, which prints to stdout.
"""

import logging
import sys

import tilelang
import tilelang.language as T


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

__all__ = ["T", "tilelang"]
