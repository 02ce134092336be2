#!/usr/bin/env bash
# The one command the GPU machine runs for issue 7: GPU tests, then the kernel benchmarks.
# Usage there (repo root, tilelang packed in .device by ../shared/tools/device-tilelang-pack):
#   bash tests/gpu/run_on_device.sh "$OUT"            # tests + bench (torch.compile of 3 references)
#   ENGINE=1 COMPILE_ALL=1 bash tests/gpu/run_on_device.sh "$OUT"   # also the cuda-vs-cpu shard check
set -o pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
. .device/setup.sh
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, tilelang; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'tilelang', tilelang.__version__)"
  nvcc --version | tail -1; } 2>&1 | tee "$out/env.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu -rfE 2>&1 | tail -40 | tee "$out/tests.log"
if [ -n "$ENGINE" ]; then
  { python3 -m dsv41_convert.cli make-tiny /tmp/t --source-dtype bf16 \
    && python3 -m dsv41_convert.cli shard /tmp/t /tmp/c --tp 2 --device cpu \
    && python3 -m dsv41_convert.cli shard /tmp/t /tmp/g --tp 2 --device cuda \
    && cmp /tmp/c/model0-mp2.safetensors /tmp/g/model0-mp2.safetensors \
    && cmp /tmp/c/model1-mp2.safetensors /tmp/g/model1-mp2.safetensors && echo CUDA_SHARD_IDENTICAL; } 2>&1 \
    | tail -15 | tee "$out/engine.log"
fi
timeout "${BENCH_TIMEOUT:-300}" python3 bench/bench_kernels.py --compile ${COMPILE_ALL:+--compile-all} \
  --json "$out/bench.json" --md "$out/bench.md" 2>&1 | grep -v "TileLang" | tee "$out/bench.log" | tail -60
