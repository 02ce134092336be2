"""How close two sets of logits are: top-1 agreement, KL(ref || conv), cosine, max abs diff.

Every comparison is over rows of logits (one row per position, decode step or draft token); a
`Stats` record keeps the sums needed to merge rows from several prompts into an overall figure.
All arithmetic is float64 so that the metric itself adds no noise near zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Stats:
    """Agreement of `rows` logit rows.

    top1:       fraction of rows whose argmax agrees
    kl_mean:    mean over rows of KL(softmax(ref) || softmax(conv)), nats
    kl_max:     largest per-row KL
    cos_min:    smallest per-row cosine similarity of the raw logits
    max_abs:    largest |ref - conv| over every element
    """

    rows: int
    top1: float
    kl_mean: float
    kl_max: float
    cos_min: float
    max_abs: float

    def to_json(self) -> dict[str, float | int]:
        return {
            "rows": self.rows,
            "top1": self.top1,
            "kl_mean": self.kl_mean,
            "kl_max": self.kl_max,
            "cos_min": self.cos_min,
            "max_abs": self.max_abs,
        }


def compare(ref: Tensor, conv: Tensor) -> Stats:
    """Compare logits row by row.

    ref, conv: [..., V] float (same shape; leading dims are flattened into rows)
    -> Stats over those rows; an empty input gives rows=0 and perfect scores
    """
    if ref.shape != conv.shape:
        raise ValueError(f"compare: reference logits {list(ref.shape)} vs converted {list(conv.shape)}")
    if ref.numel() == 0:
        return Stats(0, 1.0, 0.0, 0.0, 1.0, 0.0)
    r = ref.reshape(-1, ref.shape[-1]).double()
    c = conv.reshape(-1, conv.shape[-1]).double()
    logp, logq = torch.log_softmax(r, -1), torch.log_softmax(c, -1)
    # a non-finite converted row (NaN / inf logits) counts as infinitely far
    kl = (logp.exp() * (logp - logq)).sum(-1)
    kl = torch.where(torch.isfinite(kl), kl.clamp_min(0.0), torch.full_like(kl, float("inf")))
    cos = torch.nn.functional.cosine_similarity(r, c, dim=-1)
    cos = torch.where(torch.isfinite(cos), cos.clamp(-1.0, 1.0), torch.full_like(cos, -1.0))
    cos = torch.where((r == c).all(-1), torch.ones_like(cos), cos)  # equal rows: exactly 1, not 1 - 1 ulp
    diff = (r - c).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    return Stats(
        rows=r.shape[0],
        top1=(r.argmax(-1) == c.argmax(-1)).double().mean().item(),
        kl_mean=kl.mean().item(),
        kl_max=kl.max().item(),
        cos_min=cos.min().item(),
        max_abs=diff.max().item(),
    )


def merge(parts: list[Stats]) -> Stats:
    """Overall Stats of several prompts: means weighted by rows, extremes over all."""
    parts = [p for p in parts if p.rows]
    if not parts:
        return Stats(0, 1.0, 0.0, 0.0, 1.0, 0.0)
    n = sum(p.rows for p in parts)
    return Stats(
        rows=n,
        top1=sum(p.top1 * p.rows for p in parts) / n,
        kl_mean=sum(p.kl_mean * p.rows for p in parts) / n,
        kl_max=max(p.kl_max for p in parts),
        cos_min=min(p.cos_min for p in parts),
        max_abs=max(p.max_abs for p in parts),
    )


def relative_error(ref: Tensor, conv: Tensor) -> float:
    """||conv - ref|| / ||ref|| over all elements (float64); inf for a shape change or non-finite values.

    ref, conv: any shape, any float dtype
    """
    if ref.shape != conv.shape:
        return float("inf")
    r, c = ref.double(), conv.double()
    err = torch.linalg.vector_norm(r - c).item()
    if err != err or err == float("inf"):
        return float("inf")
    norm = torch.linalg.vector_norm(r).item()
    return err / norm if norm > 0 else (0.0 if err == 0 else float("inf"))
