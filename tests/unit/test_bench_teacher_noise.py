"""`python bench/teacher_noise.py --faults` (docs/BENCHMARKS.md, docs/VERIFY.md) reaches the verify matrix: it
put only tests/integration on the path, and the matrix's imports reach tests/cli_run.py, so --faults ended in
`ModuleNotFoundError: No module named 'cli_run'` after the correct runs. A fresh interpreter, as the script
runs (pytest's own path would hide it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_the_faults_of_the_verify_matrix_import_outside_pytest():
    code = (
        f"import sys; sys.path.insert(0, {str(BENCH)!r}); import teacher_noise; "
        "print(len(teacher_noise.verify_matrix().FAULTS))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) > 0
