"""Rotary position embedding, with YaRN frequency scaling for the compressed-attention layers."""

from __future__ import annotations

import math

import torch


def precompute_freqs_cis(
    dim: int,
    seqlen: int,
    original_seq_len: int,
    base: float,
    factor: float,
    beta_fast: int,
    beta_slow: int,
) -> torch.Tensor:
    """e^(i * position * freq) for every position and frequency pair.

    original_seq_len > 0 turns on YaRN: frequencies that complete more than `beta_fast` turns
    over the training context keep their value, those completing fewer than `beta_slow` are
    divided by `factor`, and a linear ramp over the dims in between blends the two.
    -> [seqlen, dim/2]  complex64
    """
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:

        def dim_for_turns(turns: float) -> float:
            # the (fractional) dim whose wavelength fits `turns` times into the training context
            return dim * math.log(original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(base))

        lo = max(math.floor(dim_for_turns(beta_fast)), 0)
        hi = min(math.ceil(dim_for_turns(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / max(hi - lo, 1e-3)).clamp(0, 1)
        keep = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
        freqs = freqs / factor * (1 - keep) + freqs * keep
    angles = torch.outer(torch.arange(seqlen), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate `x` in place by its positions' angles; element pairs (2k, 2k+1) form one complex number.

    x:         [b, s, d] or [b, s, h, d]  bfloat16 (a view is fine: written back through copy_)
    freqs_cis: [s, d/2]                   complex64, the rows of x's positions
    inverse:   rotate by the conjugate (undo a rotation)
    -> x
    """
    z = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    rot = freqs_cis.conj() if inverse else freqs_cis
    if z.dim() == 3:
        rot = rot.view(1, z.size(1), z.size(-1))
    else:
        rot = rot.view(1, z.size(1), 1, z.size(-1))
    x.copy_(torch.view_as_real(z * rot).flatten(-2))
    return x
