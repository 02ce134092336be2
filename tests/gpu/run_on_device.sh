#!/usr/bin/env bash
# The one command the GPU machine runs for issue 7: GPU tests, then the kernel benchmarks.
# Usage there (repo root, tilelang packed by ../shared/tools/device-tilelang-pack):
#   bash tests/gpu/run_on_device.sh "$OUT"
set -o pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
. .device/setup.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/env.txt"
python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)" | tee -a "$out/env.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu -rfE 2>&1 | tee "$out/tests.log"
timeout "${BENCH_TIMEOUT:-320}" python3 bench/bench_kernels.py --compile --json "$out/bench.json" --md "$out/bench.md" \
  2>&1 | tee "$out/bench.log"
