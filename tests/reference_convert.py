"""An independent, all-in-RAM statement of what upstream convert.py makes of a checkpoint, for tests.

Written from upstream's documented behaviour (SPEC.md §3), not from our rules table: it loads every
tensor with safetensors, picks the split by the second-to-last name component as upstream does, and
builds every rank's dict in memory. A bf16/fp32 source is first quantized, whole tensor at a time, into
the published format (fp8 32x32 linears, MXFP4 experts, per-32 Engram rows; wo_a stays bf16).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from quant_reference import fp8_blocks_ref, mxfp4_ref_packed
from safetensors.torch import load_file

SPLIT_DIM = {"embed": 0, "head": 0, "wq_b": 0, "wo_a": 0, "wo_b": 1, "attn_sink": 0, "weights_proj": 0}
FP8_LINEAR = re.compile(
    r".*\.(attn\.(wq_a|wq_b|wkv|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]|engram\.wkv|main_proj)\.weight"
)
ROUTED = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")
FLOAT32_NAMES = re.compile(r".*(attn_sink|gate\.bias|gate\.bias_vl|hc_\w+)")
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)


def load_source(src: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def quantize_like_published(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bf16/fp32 source in the published file format (whole tensors, by tests/quant_reference.py's
    loops over blocks, not the converter's encoders)."""
    out = {}
    for name, t in tensors.items():
        stem = name.removesuffix(".weight")
        if ROUTED.match(name) and name.endswith(".weight"):
            out[name], out[stem + ".scale"] = mxfp4_ref_packed(t)
        elif name.endswith("engram.embed.weight"):
            out[name], out[stem + ".scale"] = fp8_blocks_ref(t, (1, 32))
        elif FP8_LINEAR.fullmatch(name):
            out[name], out[stem + ".scale"] = fp8_blocks_ref(t, (32, 32))
        elif name.endswith("wo_a.weight"):
            out[name] = t.to(torch.bfloat16)
        else:
            out[name] = t.to(torch.float32 if FLOAT32_NAMES.fullmatch(name) else torch.bfloat16)
    return out


def fp4_to_e4m3(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's lossless cast, restated: each 32x32 block scale is its largest fp4 scale / 2**6, but at
    least 2**-127, the least e8m0 value. Upstream divides in float32 and stores the quotient, so for a
    block whose largest scale is below 2**-121 its offsets are against a scale it cannot store (every value
    2**k too large); the converter keeps the offsets against the stored byte, and so does this."""
    b = packed.view(torch.uint8)
    vals = torch.stack([E2M1[(b & 15).long()], E2M1[(b >> 4).long()]], dim=-1).flatten(1)  # [O, I]
    rows, cols = vals.shape
    s = scale.float()  # [O, I/32]
    block = (s.reshape(rows // 32, 32, cols // 32).amax(dim=1) / 64.0).clamp_min(2.0**-127)  # [O/32, I/32]
    per_elem_block = block.repeat_interleave(32, 0).repeat_interleave(32, 1)
    per_elem_scale = s.repeat_interleave(32, 1)
    w = vals * (per_elem_scale / per_elem_block)
    return w.to(torch.float8_e4m3fn), block.to(torch.float8_e8m0fnu)


def reference_convert(src: Path, tp: int, expert_dtype: str = "fp4") -> list[dict[str, torch.Tensor]]:
    """Every rank's state dict, as upstream convert.py would write it."""
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_source(src)
    if "quantization_config" not in cfg:
        tensors = quantize_like_published(tensors)
    counts = [0, 0]
    for name in tensors:
        m = ROUTED.match(name)
        if m:
            counts[m.group(1) == "mtp"] = max(counts[m.group(1) == "mtp"], int(m.group(2)) + 1)
    counts[1] = counts[1] or counts[0]
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] == "mtp" and ".".join(parts[2:]) in ("embed.weight", "head.weight"):
            continue
        key = parts[-1] if ("hc_" in name or "attn_sink" in name or "image_" in name) else parts[-2]
        m = ROUTED.match(name)
        for r in range(tp):
            if m:
                per = counts[m.group(1) == "mtp"] // tp
                if int(m.group(2)) // per == r:
                    ranks[r][name] = t
            elif ".engram.embed." in name:
                k = -(-t.shape[0] // tp)
                piece = t[r * k : (r + 1) * k]
                fill = torch.full((k - piece.shape[0], t.shape[1]), 1 if name.endswith("scale") else 0).to(t.dtype)
                ranks[r][name] = torch.cat([piece, fill])
            elif key in SPLIT_DIM:
                d = SPLIT_DIM[key]
                k = t.shape[d] // tp
                ranks[r][name] = t.narrow(d, r * k, k).contiguous()
            else:
                ranks[r][name] = t
    for sd in ranks:
        for name in list(sd):
            if name.endswith("wo_a.weight") and name.replace("weight", "scale") in sd:
                w, s = sd[name], sd.pop(name.replace("weight", "scale"))
                bo, bi = w.shape[0] // s.shape[0], w.shape[1] // s.shape[1]
                full = s.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)
                sd[name] = (w.float() * full).bfloat16()
            elif ROUTED.match(name) and name.endswith(".weight") and sd[name].dtype == torch.int8:
                if expert_dtype == "fp8":
                    sname = name.removesuffix(".weight") + ".scale"
                    sd[name], sd[sname] = fp4_to_e4m3(sd[name], sd[sname])
                else:
                    sd[name] = sd[name].view(torch.float4_e2m1fn_x2)
    return ranks
