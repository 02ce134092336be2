#!/usr/bin/env bash
# Issue 21, the GPU parts of 18 and 19 goal 3, on one lent H200 in one call (from this checkout's root,
# with tilelang and this checkout on PYTHONPATH, as root so the page cache can be dropped):
#   bash bench/h200_round.sh OUTDIR
# Untimed, side by side: make-tiny medium (fp8) then `reference-logits --device $D` (cold: compiles);
# make-tiny medium --source-dtype bf16; the tiny bf16 preset sharded on cuda twice and on cpu (rank files
# compared), then the GPU tests of the stream and of export. Then, one at a time, the page cache dropped
# before each: the disk's read speed (cat, 1 and 4 readers); bench_quant_stream.py (cp, then shard tp 2
# --device $D with its stages); `reference-logits` again (a fresh process, same kernel cache);
# `export --format fp8-fp4` of the bf16 source on cuda and on cpu (--workers auto), outputs compared.
# OUTDIR gets summary.txt (the table), stream.json, log.txt (each step's last lines), env.txt.
set -o pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
[ -f .device/setup.sh ] && . .device/setup.sh
P=${PRESET:-medium}  # PRESET=tiny DEV=cpu DROP=0 W=/tmp/x: a dry run of the script without a GPU
D=${DEV:-cuda}
W=${W:-/tmp/h200w}
rm -rf "$W" && mkdir -p "$W/logs"
logs=$W/logs
export BENCH_DROP_CACHES=${DROP:-1}
start=$(date +%s)
LIMIT=${LIMIT:-300}  # seconds: the last step (export on cpu) gets what is left of it
el() { echo $(($(date +%s) - start)); }
say() { echo "[$(el) s] $*" | tee -a "$out/summary.txt"; }
run() {  # label cmd...: one timed line into the summary, the stderr's tail into log.txt
  local label=$1; shift
  local line; line=$(python3 bench/timed_run.py "$label" "$logs" -- "$@")
  say "$line"
  { echo "== $label"; tail -n 15 "$logs/$label.err"; } >> "$out/log.txt"
}
drop() { sync; [ "$BENCH_DROP_CACHES" = 1 ] && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; free -g | head -2; df -h /tmp | tail -1
  python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)"; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
C="python3 -m dsv41_convert.cli"

( $C make-tiny $W/p --preset $P --no-vision > /dev/null 2> "$logs/mk_p.err"
  say "make-tiny $P fp8 done"
  run ref_cold_1 timeout 240 $C reference-logits $W/p $W/ref1.safetensors --device $D ) &
pid_ref=$!
( $C make-tiny $W/m --preset $P --no-vision --source-dtype bf16 > /dev/null 2> "$logs/mk_m.err"
  say "make-tiny $P bf16 done: $(du -sb $W/m | cut -f1) bytes" ) &
pid_m=$!

$C make-tiny $W/t --source-dtype bf16 > /dev/null 2>&1
run tiny_cuda_1 $C shard $W/t $W/g1 --tp 2 --device $D --json
run tiny_cuda_2 $C shard $W/t $W/g2 --tp 2 --device $D --json
run tiny_cpu $C shard $W/t $W/c --tp 2 --device cpu --json
for r in 0 1; do cmp $W/c/model$r-mp2.safetensors $W/g1/model$r-mp2.safetensors \
  && cmp $W/c/model$r-mp2.safetensors $W/g2/model$r-mp2.safetensors && say "tiny rank $r: cuda == cpu (cmp)"; done
[ "$D" = cuda ] && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stream_gpu.py tests/gpu/test_export_cuda.py \
  > "$logs/pytest.txt" 2>&1
say "gpu tests: $(tail -n 1 "$logs/pytest.txt")"
{ echo "== pytest"; tail -n 30 "$logs/pytest.txt"; } >> "$out/log.txt"

wait $pid_m
shards=$(ls $W/m/*.safetensors | head -6)
drop; s=$(date +%s%N); cat $shards > /dev/null; w=$(( ($(date +%s%N) - s) / 1000000 ))
say "disk read, 1 reader: $(du -cb $shards | tail -1 | cut -f1) bytes in $w ms"
drop; s=$(date +%s%N); printf '%s\n' $shards | xargs -P 4 -I{} cat {} > /dev/null; w=$(( ($(date +%s%N) - s) / 1000000 ))
say "disk read, 4 readers: same bytes in $w ms"
timeout 200 python3 bench/bench_quant_stream.py $W/m $W/new --tp 2 --device $D --json "$out/stream.json" \
  > /dev/null 2> "$logs/stream.err"
say "stream: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('cp_s','shard_s','shard_vs_cp_per_byte_read','source_read_gb_per_s','cpu_s','stages_s','peak_host_rss_gib','peak_gpu_gib','warmup_file_s')})" "$out/stream.json" 2>&1)"
{ echo "== stream"; tail -n 15 "$logs/stream.err"; } >> "$out/log.txt"
rm -rf $W/new $W/new.cp $W/new.warm

drop
run export_cuda $C export $W/m $W/xg --format fp8-fp4 --device $D --json
wait $pid_ref
drop
run ref_warm_2 $C reference-logits $W/p $W/ref2.safetensors --device $D
say "kernel cache: $(du -sh ~/.cache/dsv41-convert/tilelang 2>&1 | cut -f1)"
left=$((LIMIT - $(el)))
if [ $left -gt 30 ]; then
  drop
  run export_cpu timeout $left $C export $W/m $W/xc --format fp8-fp4 --device cpu --workers auto --json
else
  say "export_cpu skipped: $left s left of $LIMIT"
fi
n=0; bad=0; missing=0
for f in $W/xg/*; do
  g=$W/xc/$(basename "$f")
  if [ ! -f "$g" ]; then missing=$((missing + 1)); continue; fi
  n=$((n + 1)); cmp -s "$f" "$g" || { bad=$((bad + 1)); say "differs: $(basename "$f")"; }
done
say "export cuda vs cpu: $n files compared, $bad differ, $missing not written on cpu; cpu workers: $(grep -o '"workers": [0-9]*' "$logs/export_cpu.out" 2>/dev/null)"
say "done"
