"""TileLang's compile log must not reach stdout, where `--json` output goes."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("tilelang")


def test_tilelang_log_goes_to_stderr(capfd):
    from dsv41_convert.kernels import tl  # noqa: F401  (importing it moves the handler)

    logging.getLogger("tilelang.jit.kernel").info("TileLang begins to compile kernel `probe_`")
    out, err = capfd.readouterr()
    assert "probe_" not in out and "probe_" in err
