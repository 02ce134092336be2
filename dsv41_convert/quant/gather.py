"""Lookups in quant/'s byte tables (numpy's take), a run of rows at a time.

The index of one run (intp: take converts any other index dtype to intp first, a hidden copy) stays in the
core's cache, and take writes straight into the caller's result. One index over a whole 2 MiB row block
went out to memory and back: the fp8 -> bf16 decode took 1.27x the CPU, the fp4 one 1.14x, the fp4 -> fp8 cast
of a whole expert (int32) 1.27x (docs/BENCHMARKS.md, "export", session 46).
"""

from __future__ import annotations

import numpy as np

GATHER_INDEX = 1 << 16  # index elements per take (512 KiB of intp); dev box: 2**15-2**16 best, 2**18 1.1x


def row_step(per_row: int) -> int:
    """Rows per run where each row needs `per_row` index elements: about GATHER_INDEX a run, at least one row."""
    return max(1, GATHER_INDEX // max(1, per_row))


def take_into(table: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """out[...] = table[idx] without a temporary.

    table: [n] any dtype;  idx: [...] intp, every entry in [0, n);  out: idx's shape, table's dtype
    (mode "clip" changes no index in range; "raise" would copy `out` first)
    """
    table.take(idx, out=out, mode="clip")
