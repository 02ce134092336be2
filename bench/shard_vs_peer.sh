#!/usr/bin/env bash
# `shard SRC --tp N` (default options) against a peer converter's script, one output folder at a time (for a
# source too large to keep two outputs on the disk), each run from an empty page cache (root: drop_caches),
# order alternating by round, `cp` of the source + sync after each round. Wall and CPU by /usr/bin/time.
#   bash bench/shard_vs_peer.sh SRC PEER_SCRIPT [TP] [ROUNDS]
# PEER_SCRIPT takes upstream convert.py's options (--hf-ckpt-path, --save-path, --model-parallel), e.g. the
# community per-rank converter (docs/BENCHMARKS.md, shard, session 18). OUT is $WORK (default /tmp/svp-out).
set -uo pipefail
src=${1:?SRC} peer_script=${2:?PEER_SCRIPT} tp=${3:-8} rounds=${4:-3}
out=${WORK:-/tmp/svp-out}
ours() { dsv41-convert shard "$src" "$out" --tp "$tp" > /dev/null; }
peer() { python "$peer_script" --hf-ckpt-path "$src" --save-path "$out" --model-parallel "$tp" --expert-dtype fp4 > /dev/null && sync; }
fresh() { rm -rf "$out"; sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "not root: page cache kept" >&2; }
one() {
  fresh
  /usr/bin/time -f "$1 round $2: wall %e s user %U s sys %S s largest process RSS %M KB" \
    bash -c "$(declare -f ours peer); src='$src' out='$out' tp='$tp' peer_script='$peer_script'; $1" 2>&1 | tail -1
  echo "  wrote $(du -sb "$out" | cut -f1) bytes"
}
date -u
for r in $(seq "$rounds"); do
  if [ $((r % 2)) = 1 ]; then one ours "$r"; one peer "$r"; else one peer "$r"; one ours "$r"; fi
  fresh
  /usr/bin/time -f "cp source round $r: wall %e s" bash -c "mkdir '$out' && cp '$src'/*.safetensors '$out'/ && sync" 2>&1 | tail -1
done
rm -rf "$out"
date -u
