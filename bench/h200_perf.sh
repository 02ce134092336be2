#!/usr/bin/env bash
# The second H200 call of issues 19/21 (from this checkout's root): bash bench/h200_perf.sh OUTDIR OLD_CHECKOUT
# 1. bf16 medium source, tp 2, --device cuda: bench_quant_stream.py with the read-ahead hint at 256 MiB
#    (the default) and 2 GiB;
# 2. published (fp8/fp4) medium source, tp 8, CPU path: bench_shard.py (cold source, cp alternating)
#    with 1 worker and --workers auto, this code and OLD_CHECKOUT's.
set -o pipefail
out=${1:-/tmp/out}
old=$2
mkdir -p "$out"
. .device/setup.sh
here=$PWD
cli() { python3 -m dsv41_convert.cli "$@"; }
cli make-tiny /tmp/m --preset medium --no-vision --source-dtype bf16 > /dev/null 2>&1
for mib in 256 2048; do
  python3 bench/bench_quant_stream.py /tmp/m /tmp/new --tp 2 --device cuda --prefetch-mib $mib \
    --json "$out/stream_$mib.json" > /dev/null 2> "$out/stream_$mib.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['prefetch_mib'], d['cp_s'], d['shard_s'], d['shard_vs_cp_per_byte_read'], d['stages_s'], d['peak_host_rss_gib'], d['peak_gpu_gib'])" "$out/stream_$mib.json"
done
rm -rf /tmp/m /tmp/new
cli make-tiny /tmp/p --preset medium --no-vision > /dev/null 2>&1
for w in 1 auto; do
  for code in "$here" "$old"; do
    [ -z "$code" ] && continue
    [ "$code" = "$old" ] && [ "$w" = auto ] && ww=4 || ww=$w  # the old code has no auto: 4 (a quarter of 16 cores)
    (cd /tmp && PYTHONPATH=/tmp/tlsite:$code python3 "$here/bench/bench_shard.py" /tmp/b --src /tmp/p --skip-in-ram \
      --workers $ww --repeat 1 > "$out/shard_$(basename "$code")_$w.json" 2> "$out/shard_$(basename "$code")_$w.err")
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], d['cp_runs_s'], d['shard_runs_s'], d['shard_vs_cp_per_byte'], d['shard_cpu_s_runs'], d['shard']['max_process_rss_gib'])" "$out/shard_$(basename "$code")_$w.json"
  done
done
