#!/usr/bin/env bash
# bench/gemm_ws.py on the GPU machine, one process per variant with its own time limit (a hang names
# itself); JSON per variant into $OUT (or /tmp). From the checkout's root, tilelang on the path:
#   [ROWS=16,128] bash bench/gemm_ws.sh [VARIANT ...]
cd "$(dirname "$0")" || exit 1
out=${OUT:-/tmp}
variants=${*:-fp4ws64p2 fp4ws64p2s6 fp4ws64 fp4ws128 fp8ws128 fp8ws64}
timeout 200 python3 gemm_ws.py --compile-only --variants "${variants// /,}" 2>&1 | grep -v "INFO" | tail -5
for v in $variants; do
  echo "=== $v"
  timeout 60 python3 gemm_ws.py --variants "$v" --rows "${ROWS:-16,64,128,256,512,4096}" --json "$out/$v.json" 2>&1 | grep -v "INFO" | tail -30
  echo "exit ${PIPESTATUS[0]} (124: timed out)"
done
