#!/usr/bin/env bash
# Issue 9 on a 2-GPU machine (nvidia-h200-x2): shard with the TileLang quantizers and verify at tp 2 with NCCL.
# Usage: bash bench/gpu_tp2.sh OUTDIR   (run from the repo root, with `. .device/setup.sh` done first)
set -uo pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cli="python3 -m dsv41_convert.cli"
step() { local name=$1; shift; local t0=$(date +%s.%N); "$@" > "$out/$name.out" 2> "$out/$name.err"; local rc=$?;
  echo "$name rc=$rc $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s" | tee -a "$out/steps.txt"; tail -3 "$out/$name.err"; return 0; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpus.csv"
nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -lms 200 > "$out/gpumem.csv" &
smi=$!
w=/tmp/w; rm -rf $w; mkdir -p $w
# tiny: bf16 source quantized on the GPU must equal the CPU quantization byte for byte
step tiny_make $cli make-tiny $w/tiny --seed 0
step tiny_make_bf16 $cli make-tiny $w/tiny16 --seed 0 --source-dtype bf16
step tiny_shard_cpu $cli shard $w/tiny16 $w/t16_cpu --tp 2 --device cpu --json
step tiny_shard_cuda $cli shard $w/tiny16 $w/t16_cuda --tp 2 --device cuda --json
for r in 0 1; do cmp $w/t16_cpu/model$r-mp2.safetensors $w/t16_cuda/model$r-mp2.safetensors && echo "bf16->fp8 rank $r: cuda == cpu" | tee -a "$out/steps.txt"; done
step tiny_shard $cli shard $w/tiny $w/tiny_mp2 --tp 2 --device cuda --json
step tiny_verify $cli verify $w/tiny_mp2 --reference $w/tiny --tp 2 --device cuda --json
# medium: the real hidden sizes
step med_make $cli make-tiny $w/med --preset medium --no-vision --seed 0
step med_shard8 $cli shard $w/med $w/med_mp8 --tp 8 --device cuda --json
step med_shard2 $cli shard $w/med $w/med_mp2 --tp 2 --device cuda --json
step med_verify timeout "${MED_VERIFY_TIMEOUT:-320}" $cli verify $w/med_mp2 --reference $w/med --tp 2 --device cuda --json
kill $smi
python3 - "$out" <<'PY'
import csv, sys, collections
peak = collections.defaultdict(int)
for row in csv.reader(open(sys.argv[1] + "/gpumem.csv")):
    if len(row) == 3:
        peak[row[1].strip()] = max(peak[row[1].strip()], int(row[2].split()[0]))
print("peak GPU memory (MiB) per GPU:", dict(peak))
PY
