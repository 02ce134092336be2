#!/usr/bin/env bash
# One call on the lent H200 after a round of work: every GPU test, then the CUDA paths of the CLI that the
# tests do not time (streamed vs whole-model reference, decisive verify), tiny then medium preset.
# Usage there (repo root): . .device/setup.sh; bash bench/gpu_round.sh "$OUT"
set -uo pipefail
out=${1:?OUTDIR}
mkdir -p "$out"
cli="python3 -m dsv41_convert.cli"
step() { local name=$1; shift; local t0=$(date +%s.%N); "$@" > "$out/$name.out" 2> "$out/$name.err"; local rc=$?;
  echo "$name rc=$rc $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s" | tee -a "$out/steps.txt"; tail -2 "$out/$name.err"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, tilelang; print('torch', torch.__version__, 'tilelang', tilelang.__version__)"; } | tee "$out/env.txt"
timeout "${TEST_TIMEOUT:-260}" python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu -rfE 2>&1 | tail -30 > "$out/tests.log"
tail -3 "$out/tests.log"
w=/tmp/gr; rm -rf $w; mkdir -p $w
step tiny_make $cli make-tiny $w/tiny --seed 0
step tiny_shard2 $cli shard $w/tiny $w/tiny_mp2 --tp 2
step tiny_ref_whole $cli reference-logits $w/tiny $w/ref_whole.safetensors --device cuda --json
step tiny_ref_stream $cli reference-logits $w/tiny $w/ref_stream.safetensors --stream-layers --device cuda --json
step tiny_verify_replay $cli verify $w/tiny_mp2 --reference-logits $w/ref_whole.safetensors --device cuda --json
python3 - "$w" <<'PY' 2>&1 | tee -a "$out/steps.txt"
import sys
from safetensors.torch import load_file
a, b = (load_file(f"{sys.argv[1]}/ref_{k}.safetensors") for k in ("whole", "stream"))
# the whole model decodes greedily, --stream-layers feeds fixed ids: the decode sections differ by design
# (tests/gpu/test_streamed_cuda.py feeds both the same ids and compares them too)
fed = {"decode_ids", "decode_logits", "draft_logits", "draft_confidence"}
same = [k for k in a if k in b and a[k].shape == b[k].shape and a[k].view(-1).view(__import__("torch").uint8).equal(b[k].view(-1).view(__import__("torch").uint8))]
print("streamed == whole on cuda (bytes):", len(same), "sections; differ:", sorted(k for k in a if k in b and k not in same and k not in fed) or "none", "(decode sections not compared)")
PY
step med_make $cli make-tiny $w/med --preset medium --no-vision --seed 0
step med_ref_stream timeout 200 $cli reference-logits $w/med $w/med_stream.safetensors --stream-layers --device cuda --json
step med_ref_whole timeout 150 $cli reference-logits $w/med $w/med_whole.safetensors --device cuda --json
cat "$out/steps.txt"
