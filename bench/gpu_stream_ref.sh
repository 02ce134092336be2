#!/usr/bin/env bash
# Issue 17, the CUDA half of layer streaming, on one GPU machine in one call (repo root of this checkout,
# tilelang on the path, e.g. after `. .device/setup.sh`):
#   bash bench/gpu_stream_ref.sh OUTDIR
# 1. medium preset (--no-vision): `reference-logits --device cuda` whole model (cold: compiles the kernels
#    into the kernel cache), then --stream-layers, the whole model and --stream-layers again, all warm;
#    wall time of each CLI process, its --json (gpu_peak_bytes, the streamed time split), compile lines;
#    `plan --tp 1 --json` memory.streamed; prefill logits of streamed == whole (bytes);
# 2. tests/gpu/test_streamed_cuda.py (tiny preset: streamed == whole model on CUDA, read-ahead, experts).
# Takes ~6 min on a fresh H200 (make-tiny ~50-110 s, the cold run ~140 s). Leaves 8 files in OUTDIR (the
# most a lent machine sends back): steps.txt, summary.txt, tests.log and the five --json outputs.
set -uo pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
cli="python3 -m dsv41_convert.cli"
w=/tmp/sr
rm -rf $w && mkdir -p $w
step() {  # name limit cmd...: wall seconds, exit code and compile lines of one command
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s.%N)
  timeout "$limit" "$@" > "$w/$name.json" 2> "$w/$name.err"; local rc=$?
  echo "$name rc=$rc wall=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s compiles=$(grep -ci compil "$w/$name.err")" \
    | tee -a "$out/steps.txt"
  [ $rc -eq 0 ] || tail -5 "$w/$name.err" | tee -a "$out/steps.txt"
  [ "$name" = make ] || cp "$w/$name.json" "$out/"
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
  python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)"; } | tee "$out/steps.txt"
step make 240 $cli make-tiny $w/med --preset medium --no-vision --seed 0 --json
step plan 60 $cli plan $w/med --tp 1 --json
step whole_cold 200 $cli reference-logits $w/med $w/whole.safetensors --device cuda --overwrite --json
step stream_a 90 $cli reference-logits $w/med $w/stream.safetensors --stream-layers --device cuda --overwrite --json
step whole_warm 90 $cli reference-logits $w/med $w/whole.safetensors --device cuda --overwrite --json
step stream_b 90 $cli reference-logits $w/med $w/stream.safetensors --stream-layers --device cuda --overwrite --json
python3 bench/gpu_stream_summary.py "$out" $w/whole.safetensors $w/stream.safetensors | tee "$out/summary.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_streamed_cuda.py -rfE > "$out/tests.log" 2>&1
tail -4 "$out/tests.log"
