"""`shard SRC OUT --tp N` of an all-zero source (`make-tiny --preset full --sparse`) without writing its zeros.

Every output byte of such a conversion is known without reading the source: each tensor is a copy of
zeros (fp8 weights and their e8m0 scales, packed fp4 experts) or wo_a's dequantization of them (0 x 2^-127
= bf16 +0.0), and the only other bytes are the rank files' headers and the Engram tables' padding rows
(pad_byte: the e8m0 scale 1.0, 0x7f). So the rank files are written as their headers, the padding rows,
and holes, with shard's own config.json, hf_config.json and tokenizer files: the tp-N conversion of the
510 GB layout in seconds and ~50 MB of disk, for `verify` and `reference-logits` at real scale. No
manifest (shard would hash 537 GB of zeros for it). tests/integration/test_hollow_ranks.py holds it to
shard's output bit for bit on a zeroed tiny source.
"""

from __future__ import annotations

from pathlib import Path

from dsv41_convert.convert.execute import write_sidecars
from dsv41_convert.convert.plan import ConversionPlan, OutTensor, build_plan, pad_byte
from dsv41_convert.convert.write import row_bytes

ZERO_IN_ZERO_OUT = {"copy", "as_fp4", "dequant_bf16"}  # the actions of an fp8 source at --expert-dtype fp4


def write_hollow_ranks(src: Path, out: Path, tp: int) -> ConversionPlan:
    """Rank files of an all-zero fp8/fp4 `src` at `tp` into the new folder `out`, as `shard` writes them
    (fp4 experts), holes for every zero. -> the plan they follow"""
    plan = build_plan(src, tp, "fp4")
    out.mkdir(parents=True)
    for f in plan.files:
        with open(out / f.file, "wb") as fh:
            fh.write(f.header)
            for t in f.parts:
                if type(t) is not OutTensor:
                    continue  # an ExpertRun: copies of zeros
                assert t.action in ZERO_IN_ZERO_OUT, f"{t.name}: {t.action} of zeros is not known to be zeros"
                fill = pad_byte(t.dtype) if t.pad_rows else 0
                if fill:
                    size = t.pad_rows * row_bytes(t.dtype, t.shape)
                    fh.seek(t.end - size)
                    for at in range(0, size, 1 << 24):
                        fh.write(bytes([fill]) * min(1 << 24, size - at))
            fh.truncate(f.nbytes)
    write_sidecars(plan, src, out)
    return plan
