#!/usr/bin/env bash
# Issue 21, the GPU parts of 18 and 19 goal 3, on one lent H200 (from this checkout's root, with tilelang
# and this checkout on PYTHONPATH, as root so the page cache can be dropped):
#   STEPS="tiny tests stream export ref" bash bench/h200_round.sh OUTDIR
# STEPS picks what runs (default: all five, ~8-10 minutes on a fresh machine; two calls fit a 7-minute
# budget better, e.g. STEPS="tiny stream export" then STEPS="ref"); anything but tiny and tests needs
# make-tiny of the medium preset with --source-dtype bf16 (13.1 GB; ~2-3 min), started first, in the
# background.
#   tiny    the tiny bf16 preset, `shard --tp 2` on cuda twice (empty, then warm kernel cache) and on cpu;
#           rank files compared (cmp); TileLang compile log lines counted per run;
#   tests   tests/gpu/test_stream_gpu.py and tests/gpu/test_export_cuda.py (untimed, beside make-tiny);
#   gputests  every GPU test (`pytest -n 8 tests/gpu`, untimed, beside make-tiny);
#   stream  the disk's read speed (cat, 1 and 4 readers), then bench_quant_stream.py: cp, then shard tp 2
#           --device cuda with its stages (kernels compiled in its warm-up file), peak RSS of the whole
#           process and of the timed run alone, pinned bytes;
#   cli     `shard --tp 2` of the medium source as a fresh process (after stream: kernels cached): wall,
#           CPU, peak RSS; with OLD=<another checkout's root> the same with that code, for comparison;
#   export  `export --format fp8-fp4` of the bf16 source on cuda (CUDA_RUNS times, default 1), then on
#           cpu (--workers auto), outputs compared; the cuda output is the medium preset's published
#           layout, the source of `ref` and `exbench`;
#   ref     `reference-logits --device cuda` of that output, twice, fresh processes, one kernel cache;
#   pub     the published layout of the preset straight from make-tiny into the folder `export` would
#           write (~2 min on 16 cores, no GPU): the source of `exbench` without the bf16 preset and export;
#   exbench bench_export.py on the host's CPUs with that output as the published source, `--workers
#           auto`: cp, then export to EXFORMATS (default bf16,fp8,fp8-fp4), and `shard --tp $SHARD_TP` if
#           set, each followed by cp of its own output (the same bytes written); with OLD=<checkout> the
#           old code in the same rounds, bytes compared; its JSON (with each run's timeline summary:
#           first file's start, the last worker alone at the end, stage seconds) and table into
#           export_bench.txt.
#   shardio bench_shard_cpu.py with that output as the source: cp, then `shard --tp $SHARD_TP` (8) with
#           --workers $WORKERS (auto), buffered and --direct-io, this code and OLD (required), cold source,
#           $ROUNDS (2) rounds: the host's answer to which write mode should be the default (session 9).
#           CACHED=1: the source stays in the page cache; IO_EXPORT=FORMAT times `export --format FORMAT`
#           instead of shard (into shard_io_FORMAT.txt).
# Used 2026-12-02 (session 10): OLD=<6180d08> STEPS="pub shardio" (190 s; docs/BENCHMARKS.md, "shard",
# session 10: O_DIRECT became the default from it). shardio passes --buffered-io where OLD knows it.
# Used 2026-12-01: OLD=<8554f92> STEPS="gputests export exbench" SHARD_TP=8 and
# CUDA_RUNS=2 EXFORMATS=fp8,bf16 STEPS="export exbench" (docs/BENCHMARKS.md, export: the H200 host).
# and (session 8) OLD=<7ed5013> EXFORMATS=fp8,bf16 SHARD_TP=8 STEPS="pub exbench".
# The page cache is dropped before each timed step. OUTDIR gets summary.txt (one line a result),
# stream.json, log.txt (each step's last log lines), env.txt: four files, within what a lent machine
# returns. A dry run without a GPU: PRESET=tiny DEV=cpu DROP=0 W=/tmp/x bash bench/h200_round.sh OUT.
set -o pipefail
out=${1:-/tmp/out}
mkdir -p "$out"
[ -f .device/setup.sh ] && . .device/setup.sh
STEPS=${STEPS:-tiny tests stream export ref}
P=${PRESET:-medium}
D=${DEV:-cuda}
W=${W:-/tmp/h200w}
LIMIT=${LIMIT:-600}  # seconds: the cpu export gets what is left of it
mkdir -p "$W/logs"
logs=$W/logs
export BENCH_DROP_CACHES=${DROP:-1}
start=$(date +%s)
el() { echo $(($(date +%s) - start)); }
say() { echo "[$(el) s] $*" | tee -a "$out/summary.txt"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
run() {  # label cmd...: one timed line into the summary, the stderr's tail into log.txt
  local label=$1; shift
  local line; line=$(python3 bench/timed_run.py "$label" "$logs" -- "$@")
  say "$line"
  { echo "== $label"; tail -n 15 "$logs/$label.err"; } >> "$out/log.txt"
}
drop() { sync; [ "$BENCH_DROP_CACHES" = 1 ] && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; free -g | head -2; df -h /tmp | tail -1
  python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)"
  echo "steps: $STEPS"; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
C="python3 -m dsv41_convert.cli"

pid_m=
if has stream || has cli || has export || has ref; then
  if [ ! -f "$W/m/model.safetensors.index.json" ]; then
    ( $C make-tiny $W/m --preset $P --no-vision --source-dtype bf16 --overwrite > /dev/null 2> "$logs/mk_m.err"
      say "make-tiny $P bf16: $(du -sb $W/m | cut -f1) bytes" ) &
    pid_m=$!
  fi
fi

if has pub && [ ! -f "$W/xg/config.json" ]; then
  $C make-tiny $W/xg --preset $P --no-vision > /dev/null 2> "$logs/mk_pub.err"
  say "make-tiny $P published layout: $(du -sb $W/xg | cut -f1) bytes"
fi

if has tiny; then
  rm -rf $W/t $W/g1 $W/g2 $W/c
  $C make-tiny $W/t --source-dtype bf16 > /dev/null 2>&1
  run tiny_cuda_1 $C shard $W/t $W/g1 --tp 2 --device $D --json
  run tiny_cuda_2 $C shard $W/t $W/g2 --tp 2 --device $D --json
  run tiny_cpu $C shard $W/t $W/c --tp 2 --device cpu --json
  for r in 0 1; do cmp $W/c/model$r-mp2.safetensors $W/g1/model$r-mp2.safetensors \
    && cmp $W/c/model$r-mp2.safetensors $W/g2/model$r-mp2.safetensors && say "tiny rank $r: cuda == cpu (cmp)"; done
fi
if has tests && [ "$D" = cuda ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_stream_gpu.py tests/gpu/test_export_cuda.py \
    > "$logs/pytest.txt" 2>&1
  say "gpu tests: $(tail -n 1 "$logs/pytest.txt")"
  { echo "== pytest"; tail -n 30 "$logs/pytest.txt"; } >> "$out/log.txt"
fi
if has gputests && [ "$D" = cuda ]; then
  timeout ${GPUTESTS_LIMIT:-260} python3 -m pytest -q -p no:cacheprovider -n 8 tests/gpu > "$logs/pytest_all.txt" 2>&1
  say "all gpu tests: $(tail -n 1 "$logs/pytest_all.txt")"
  { echo "== pytest tests/gpu"; grep -E "FAILED|ERROR|passed|failed" "$logs/pytest_all.txt" | tail -n 30; } >> "$out/log.txt"
fi
[ -n "$pid_m" ] && wait $pid_m

if has stream; then
  shards=$(ls $W/m/*.safetensors | head -6)
  drop; s=$(date +%s%N); cat $shards > /dev/null; w=$(( ($(date +%s%N) - s) / 1000000 ))
  say "disk read, 1 reader: $(du -cb $shards | tail -1 | cut -f1) bytes in $w ms"
  drop; s=$(date +%s%N); printf '%s\n' $shards | xargs -P 4 -I{} cat {} > /dev/null; w=$(( ($(date +%s%N) - s) / 1000000 ))
  say "disk read, 4 readers: same bytes in $w ms"
  timeout 240 python3 bench/bench_quant_stream.py $W/m $W/new --tp 2 --device $D --json "$out/stream.json" \
    > /dev/null 2> "$logs/stream.err"
  say "stream: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('cp_s','shard_s','shard_vs_cp_per_byte_read','source_read_gb_per_s','cpu_s','stages_s','peak_host_rss_gib','host_rss_before_timed_gib','peak_host_rss_timed_gib','pinned','peak_gpu_gib','warmup_file_s')})" "$out/stream.json" 2>&1)"
  { echo "== stream"; tail -n 15 "$logs/stream.err"; } >> "$out/log.txt"
  rm -rf $W/new $W/new.cp $W/new.warm
fi

if has cli; then  # fresh processes, kernels already in the cache (run after stream)
  rm -rf $W/cli; drop
  run cli_shard $C shard $W/m $W/cli --tp 2 --device $D --json
  rm -rf $W/cli
  if [ -n "$OLD" ]; then
    drop
    # -P: `-m` would put this checkout (the working directory) before $OLD on the path
    run cli_shard_old env PYTHONPATH=$OLD:$PYTHONPATH python3 -P -m dsv41_convert.cli shard $W/m $W/cli --tp 2 \
      --device $D --json
    rm -rf $W/cli
  fi
fi

if has export || { has ref && [ ! -f "$W/xg/config.json" ]; }; then
  for k in $(seq 1 ${CUDA_RUNS:-1}); do  # CUDA_RUNS=2: the second run finds the kernels compiled
    rm -rf $W/xg
    drop
    run export_cuda_$k $C export $W/m $W/xg --format fp8-fp4 --device $D --json
  done
fi
pid_ref=
if has ref; then  # the first run compiles the model's kernels; the cpu export may run beside it
  ( rm -f $W/ref1.safetensors; drop; run ref_1 $C reference-logits $W/xg $W/ref1.safetensors --device $D ) &
  pid_ref=$!
fi
if has export; then
  [ -n "$pid_ref" ] && say "(export_cpu below runs beside the first reference-logits)"
  rm -rf $W/xc
  left=$((LIMIT - $(el)))
  [ -z "$pid_ref" ] && drop
  run export_cpu timeout $left $C export $W/m $W/xc --format fp8-fp4 --device cpu --workers auto --json
  n=0; bad=0; missing=0
  for f in $W/xg/model*.safetensors* $W/xg/config.json $W/xg/tokenizer*; do  # manifest.json names the device
    g=$W/xc/$(basename "$f")
    if [ ! -f "$g" ]; then missing=$((missing + 1)); continue; fi
    n=$((n + 1)); cmp -s "$f" "$g" || { bad=$((bad + 1)); say "differs: $(basename "$f")"; }
  done
  say "export cuda vs cpu: $n files compared, $bad differ, $missing not written on cpu; cpu workers: $(grep -o '"workers": [0-9]*' "$logs/export_cpu.out" 2>/dev/null)"
  rm -rf $W/xc
fi
if has ref; then
  wait $pid_ref
  rm -f $W/ref2.safetensors
  drop
  run ref_2 $C reference-logits $W/xg $W/ref2.safetensors --device $D
  cmp -s $W/ref1.safetensors $W/ref2.safetensors && say "ref_1 == ref_2 (cmp)" || say "ref_1 != ref_2"
  say "kernel cache: $(du -sh ~/.cache/dsv41-convert/tilelang 2>&1 | cut -f1)"
fi
if has shardio && [ -z "$OLD" ]; then  # bench_shard_cpu.py --old "" would compare this code with itself
  say "shardio needs OLD=<another checkout's root> (this code against it): not run"
elif has shardio; then  # buffered against --direct-io on the host's CPUs, cold source, OLD required
  left=$((LIMIT - $(el)))
  timeout $left python3 bench/bench_shard_cpu.py $W/xg $W/sio --old "$OLD" --tp ${SHARD_TP:-8} \
    --workers ${WORKERS:-auto} --rounds ${ROUNDS:-2} $([ "${CACHED:-0}" = 1 ] || echo --cold) \
    ${IO_EXPORT:+--export $IO_EXPORT} > "$out/shard_io${IO_EXPORT:+_$IO_EXPORT}.txt" 2> "$logs/shardio.err"
  say "shard io bench: exit $? (shard_io${IO_EXPORT:+_$IO_EXPORT}.txt)"
  { echo "== shardio"; tail -n 15 "$logs/shardio.err"; } >> "$out/log.txt"
fi
if has exbench; then
  left=$((LIMIT - $(el)))
  timeout $left python3 bench/bench_export.py $W/eb --src $W/xg --workers auto ${SHARD_TP:+--shard-tp $SHARD_TP} \
    --formats ${EXFORMATS:-bf16,fp8,fp8-fp4} ${OLD:+--old $OLD} > "$out/export_bench.txt" 2> "$logs/exbench.err"
  say "export bench: exit $? (export_bench.txt)"
  { echo "== exbench"; tail -n 15 "$logs/exbench.err"; } >> "$out/log.txt"
fi
say "done"
