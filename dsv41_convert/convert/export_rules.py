"""The one table of `export`: what each tensor family becomes in each output format.

A tensor's family is its rule's `Op` (rules.py decides it from the name; nothing here looks at names),
its storage is what its header dtype holds, and the format is the one asked for:

    storage   header dtype
    float     BF16 / F32 (an unquantized value; validate.py refuses other float dtypes first)
    fp8       F8_E4M3 (with an F8_E8M0 `.scale` beside it: 32x32 blocks, per-32 rows for Engram)
    fp4       I8 (packed e2m1 pairs, with a per-32 F8_E8M0 `.scale`)

    format    output
    bf16      every quantized weight dequantized to BF16, every scale dropped; float tensors as the published
              checkpoint stores them (F32 where it does), the weights it quantizes as BF16
    fp8       the published scheme, but routed experts as F8_E4M3 with 32x32 scales (lossless from fp4)
    fp8-fp4   the published scheme: fp8 32x32 ue8m0 weights (wo_a included), MXFP4 experts as I8 with
              per-32 scales, Engram rows fp8 per-32, float tensors in their published dtype

A `.scale` follows its weight: copied where the weight is copied in a quantized form, otherwise
dropped (bf16) or made anew by the weight's quantizing action (in the same output file).
"""

from __future__ import annotations

from dsv41_convert.convert.rules import Op
from dsv41_convert.errors import PlanError

FORMATS = ("bf16", "fp8", "fp8-fp4")
EXPERT_DTYPE = {"bf16": "bf16", "fp8": "fp8", "fp8-fp4": "fp4"}  # what the routed experts are in each format
STORAGE = {"BF16": "float", "F32": "float", "F8_E4M3": "fp8", "I8": "fp4"}

# Actions (transform.py runs the computing ones; each output's dtype and shape is in export.py):
#   copy            the source bytes, unchanged
#   as_published    copy, or cast to the dtype the published checkpoint stores it in (rule.src[0])
#   as_bf16         copy, or cast to BF16 (an F32 fine-tune's weights in the bf16 format: they were kept F32
#                   under a config saying bfloat16, twice the bytes; an audit)
#   dequant_bf16    e4m3 x e8m0 block scale -> BF16       dequant_fp4   e2m1 x e8m0 -> BF16
#   fp4_to_fp8      the lossless MXFP4 -> e4m3 32x32 cast (a lossy block is an error naming the tensor)
#   quant_fp8       -> e4m3 + 32x32 ue8m0 scale           quant_rows_fp8  -> e4m3 + per-32 scale (Engram)
#   quant_fp4       -> MXFP4 (I8 pairs) + per-32 scale    requant_fp4     e4m3 decoded exactly, then quant_fp4
EXPORT_ACTIONS: dict[tuple[Op, str], dict[str, str]] = {
    (Op.KEEP, "float"): {"bf16": "as_published", "fp8": "as_published", "fp8-fp4": "as_published"},
    # mtp.K.embed/head (tied to the backbone's; shard drops them): kept, in their published dtype
    (Op.DROP, "float"): {"bf16": "as_published", "fp8": "as_published", "fp8-fp4": "as_published"},
    (Op.FP8, "fp8"): {"bf16": "dequant_bf16", "fp8": "copy", "fp8-fp4": "copy"},
    (Op.FP8, "float"): {"bf16": "as_bf16", "fp8": "quant_fp8", "fp8-fp4": "quant_fp8"},
    # wo_a: bf16 only in the rank files; an HF checkpoint stores it as the published one does
    (Op.DEQUANT_BF16, "fp8"): {"bf16": "dequant_bf16", "fp8": "copy", "fp8-fp4": "copy"},
    (Op.DEQUANT_BF16, "float"): {"bf16": "as_bf16", "fp8": "quant_fp8", "fp8-fp4": "quant_fp8"},
    (Op.AS_FP4, "fp4"): {"bf16": "dequant_fp4", "fp8": "fp4_to_fp8", "fp8-fp4": "copy"},
    (Op.AS_FP4, "fp8"): {"bf16": "dequant_bf16", "fp8": "copy", "fp8-fp4": "requant_fp4"},
    # a bf16 source's experts go straight to fp8 blocks: no detour through fp4's 3 bits
    (Op.AS_FP4, "float"): {"bf16": "as_bf16", "fp8": "quant_fp8", "fp8-fp4": "quant_fp4"},
    (Op.ENGRAM_ROWS, "fp8"): {"bf16": "dequant_bf16", "fp8": "copy", "fp8-fp4": "copy"},
    (Op.ENGRAM_ROWS, "float"): {"bf16": "as_bf16", "fp8": "quant_rows_fp8", "fp8-fp4": "quant_rows_fp8"},
}
SCALE_OPS = (Op.SCALE, Op.FOLD_INTO_WEIGHT)  # follow their weight


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise PlanError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")


def export_action(op: Op, dtype: str, fmt: str, where: str) -> str:
    """The action for a (non-scale) tensor of family `op` stored as header dtype `dtype`; `where` names it."""
    storage = STORAGE.get(dtype)
    actions = EXPORT_ACTIONS.get((op, storage)) if storage else None
    if actions is None:
        raise PlanError(f"{where}: {op.value} tensor stored as {dtype}: export has no rule for it; another revision?")
    return actions[fmt]


def keeps_scale(weight_action: str, weight_dtype: str) -> bool:
    """Whether the weight's `.scale` is copied: the weight stays quantized and is copied as it is."""
    return weight_action == "copy" and STORAGE.get(weight_dtype) in ("fp8", "fp4")
