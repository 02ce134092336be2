"""What the layer-streamed model (streamed.py) takes and gives: the weight provider it reads, the prompts,
the per-prompt results and the per-unit timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor


class WeightProvider(Protocol):
    """Tensors of the tp-1 state dict by name (the model's dtypes; bf16 stands for a float32 weight)."""

    def __call__(self, names: Sequence[str]) -> dict[str, Tensor]:
        """The named tensors; called from several threads at once on CUDA (stream_feed.CudaFeed)."""
        ...

    def rows(self, names: Sequence[str], rows: Tensor) -> dict[str, Tensor]:
        """Rows `rows` ([n] int64, sorted, unique) of row-split tables (Engram weight and scale)."""
        ...


@dataclass
class StreamPrompt:
    """One prompt: input_ids [S] int64, decode_ids [J] int64 (step t feeds decode_ids[t]; the drafts
    after step t start from decode_ids[t + 1]), token_types [S] and images as Transformer.forward takes them."""

    input_ids: Tensor
    decode_ids: Tensor
    token_types: Tensor | None = None
    images: list | None = None


@dataclass
class StreamResult:
    """Per prompt, the fields of verify.runner.PromptRun (float32 logits on the CPU)."""

    logits_all: Tensor  # [S, V]
    last: Tensor  # [V]
    decode_logits: Tensor  # [J - 1, V]
    draft_logits: Tensor | None  # [J - 1, K, V]
    hidden: dict[str, Tensor] = field(default_factory=dict)  # key -> [S, ...] bfloat16
    draft_confidence: Tensor | None = None  # [J - 1, K] float32, the confidence head beside the drafts


@dataclass
class UnitTiming:
    """Per unit, summed over the passes: seconds spent reading weights (provider calls; on CUDA summed over
    the reader threads), moving them to the device (staging in pinned memory + the host-to-device copies),
    computing, and waiting for weights (the reading and moving that compute did not hide; on the CPU all
    of it). The unit's wall time is compute_s + wait_s. param_bytes: the most parameter bytes the unit
    held at once (dense weights + the routed experts read; unread experts hold nothing)."""

    unit: str
    read_s: float = 0.0
    transfer_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_read: int = 0
    experts_read: int = 0
    param_bytes: int = 0
