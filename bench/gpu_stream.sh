#!/usr/bin/env bash
# Issue 19 goal 3 and issue 21 on one GPU machine, in one call (from the repo root of this checkout):
#   bash bench/gpu_stream.sh OUTDIR [OLD_CHECKOUT]
# 1. the kernel cache: `shard --device cuda` of the tiny bf16 preset twice (cold, then warm cache), and
#    --device cpu; rank files compared with cmp; TileLang compile lines counted per run;
# 2. the GPU streaming test (tests/gpu/test_stream_gpu.py: a 1.5 GiB Engram-shaped table);
# 3. medium preset, bf16 source (13.1 GB): bench/bench_quant_stream.py (cp, then the stages) and the CLI,
#    and OLD_CHECKOUT's code (if given) on the same input, twice (cold, warm cache); outputs compared.
set -o pipefail
out=${1:-/tmp/out}
old=$2
mkdir -p "$out"
. .device/setup.sh
here=$PWD
timed() {  # label cmd...: wall ms of cmd, its stderr to $out/<label>.err
  local label=$1; shift
  local t0; t0=$(date +%s%N)
  "$@" > /dev/null 2> "$out/$label.err"; local rc=$?
  echo "$label $(( ($(date +%s%N) - t0) / 1000000 )) ms rc=$rc compiles=$(grep -ci 'compil' "$out/$label.err")" | tee -a "$out/times.txt"
}
cli() { python3 -m dsv41_convert.cli "$@"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; free -g | head -2
  python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)"; } | tee "$out/env.txt"
cli make-tiny /tmp/t --source-dtype bf16 > /dev/null 2>&1
timed tiny_cuda_cold cli shard /tmp/t /tmp/g1 --tp 2 --device cuda --json
timed tiny_cuda_warm cli shard /tmp/t /tmp/g2 --tp 2 --device cuda --json
timed tiny_cpu cli shard /tmp/t /tmp/c --tp 2 --device cpu --json
for r in 0 1; do cmp /tmp/c/model$r-mp2.safetensors /tmp/g1/model$r-mp2.safetensors \
  && cmp /tmp/c/model$r-mp2.safetensors /tmp/g2/model$r-mp2.safetensors && echo "tiny rank $r cuda == cpu"; done | tee -a "$out/times.txt"
du -sh ~/.cache/dsv41-convert/tilelang | tee -a "$out/times.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stream_gpu.py 2>&1 | tail -5 | tee "$out/gpu_test.txt"
cli make-tiny /tmp/m --preset medium --no-vision --source-dtype bf16 > /dev/null 2>&1
python3 bench/bench_quant_stream.py /tmp/m /tmp/new --tp 2 --device cuda --json "$out/stream.json" > /dev/null 2> "$out/stream.err"
cat "$out/stream.json"
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
timed medium_cuda_cli_new cli shard /tmp/m /tmp/new2 --tp 2 --device cuda --json
rm -rf /tmp/new2
if [ -n "$old" ]; then
  cd "$old" || exit 1
  export PYTHONPATH=/tmp/tlsite:$PWD
  timed medium_cuda_cli_old_cold cli shard /tmp/m /tmp/old1 --tp 2 --device cuda --json
  rm -rf /tmp/old1; sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
  timed medium_cuda_cli_old_warm cli shard /tmp/m /tmp/old2 --tp 2 --device cuda --json
  for r in 0 1; do cmp /tmp/old2/model$r-mp2.safetensors /tmp/new/model$r-mp2.safetensors && echo "medium rank $r new == old"; done | tee -a "$out/times.txt"
  cd "$here"
fi
