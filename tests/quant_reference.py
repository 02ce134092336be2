"""Independent statements of the weight number formats, for tests: every value from its bit fields, every
rounding by search over the code values (float64, exact), every block looped over in Python. Written from
SPEC.md §4, not from dsv41_convert.quant; slow, for small tensors.

    q, s = fp8_blocks_ref(w, (32, 32))   # e4m3 codes and ue8m0 scales, as torch tensors
    p, s = mxfp4_ref_packed(w)           # MXFP4: e2m1 pairs (low nibble first) as int8, per-32 ue8m0 scales
"""

from __future__ import annotations

import math

import numpy as np
import torch


def e4m3_value(byte: int) -> float:
    """Value of an e4m3fn byte from its fields: 1 sign, 4 exponent (bias 7), 3 mantissa; S.1111.111 is NaN."""
    sign, exp, man = byte >> 7, (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    mag = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -mag if sign else mag


E4M3_POS = np.array([e4m3_value(b) for b in range(0x7F)])  # bytes 0..126, increasing, max 448


def e4m3_ref(x: np.ndarray) -> np.ndarray:
    """Bytes of RNE(x) in e4m3, saturating at 448; x is float64 and already exact. Ties go to the even byte."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(E4M3_POS, mag), 1, len(E4M3_POS) - 1)
    lo = hi - 1
    dlo, dhi = mag - E4M3_POS[lo], E4M3_POS[hi] - mag
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (pick | (np.signbit(x) << 7)).astype(np.uint8)


def ceil_exp(v: np.ndarray) -> np.ndarray:
    """Exact ceil(log2(v)) for positive finite values."""
    m, e = np.frexp(np.asarray(v, dtype=np.float64))
    return np.where(m == 0.5, e - 1, e)


def encode_ref(w: np.ndarray, bo: int, bi: int, ue8m0: bool = True):
    """Loop-over-blocks reference: amax floored at f32(1e-4), scale from f32(amax * f32(1/448))."""
    out, inp = w.shape
    nob, nib = -(-out // bo), -(-inp // bi)
    q = np.zeros(w.shape, dtype=np.uint8)
    s = np.zeros((nob, nib), dtype=np.float64)
    for r in range(nob):
        for c in range(nib):
            blk = w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi].astype(np.float32)
            amax = max(np.float32(np.abs(blk).max()), np.float32(1e-4))
            prod = np.float32(amax) * np.float32(1 / 448)
            if ue8m0:
                scale = 2.0 ** int(ceil_exp(prod))
                vals = blk.astype(np.float64) / scale  # a power of two: exact
            else:
                scale = float(prod)
                vals = (blk / np.float32(prod)).astype(np.float64)  # float32 division, as the code does
            s[r, c] = scale
            q[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] = e4m3_ref(vals)
    return q, s


def e2m1_value(code: int) -> float:
    """Value of a 4-bit code from its fields: 1 sign, 2 exponent (bias 1), 1 mantissa; exponent 0 is subnormal."""
    sign, exp, man = code >> 3, (code >> 1) & 0x3, code & 0x1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return -mag if sign else mag


MAGS = np.array([e2m1_value(c) for c in range(8)])


def e2m1_ref(x: np.ndarray) -> np.ndarray:
    """Codes of RNE(x) in e2m1 (clamped at 6): nearest magnitude, ties to the even code, sign from signbit."""
    x = np.asarray(x, dtype=np.float64)
    mag = np.minimum(np.abs(x), 6.0)
    dist = np.abs(mag[..., None] - MAGS)
    best = dist.min(-1, keepdims=True)
    tied = dist == best
    # among the (at most two) nearest codes prefer the even one
    code = np.where(tied[..., ::2].any(-1), np.argmax(tied & (np.arange(8) % 2 == 0), -1), np.argmax(tied, -1))
    return (code | (np.signbit(x) << 3)).astype(np.uint8)


def mxfp4_ref(w: np.ndarray, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """(codes [..., in], scale exponents [..., ceil(in/block)]) by looping over the groups of each row."""
    rows = w.reshape(-1, w.shape[-1]).astype(np.float32)
    n = -(-rows.shape[1] // block)
    codes = np.zeros(rows.shape, dtype=np.uint8)
    exps = np.zeros((rows.shape[0], n), dtype=np.int64)
    for r in range(rows.shape[0]):
        for g in range(n):
            grp = rows[r, g * block : (g + 1) * block]
            amax = max(np.float32(np.abs(grp).max()), np.float32(6 * 2.0**-126))
            e = int(ceil_exp(np.float32(amax) * np.float32(1 / 6)))
            exps[r, g] = e
            codes[r, g * block : (g + 1) * block] = e2m1_ref(grp.astype(np.float64) / 2.0**e)
    return codes.reshape(w.shape), exps.reshape((*w.shape[:-1], n))


def act_ref(x: torch.Tensor, block: int, ue8m0: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-row activation quantization (upstream kernel.py act_quant) -> (e4m3 bytes [x.shape], float32 scales
    [..., n/block]): amax floored at f32(1e-4), f32(amax * f32(1/448)) (rounded up to a power of two with
    `ue8m0`), values divided in float32, RNE, saturating at 448."""
    g = x.detach().float().numpy().reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(g).max(-1), np.float32(1e-4))
    s = (amax * np.float32(1 / 448)).astype(np.float32)
    if ue8m0:
        s = np.exp2(ceil_exp(s)).astype(np.float32)
    v = (g / s[..., None]).astype(np.float32)  # float32 division, rounded once, as the kernel does
    return e4m3_ref(v).reshape(x.shape), s


def fp4_act_ref(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per-row fp4 activation quantization (upstream kernel.py fp4_act_quant) -> (e2m1 codes [x.shape], float32
    scales [..., n/block]): with `e4m3_scale` scale = e4m3(f32(max(amax, 6 * 2**-9) / 6)), else the power of two
    at or above f32(max(amax, 6 * 2**-126) * f32(1/6)); values divided in float32, RNE, clamped at 6."""
    g = x.detach().float().numpy().reshape(*x.shape[:-1], -1, block)
    amax = np.abs(g).max(-1)
    if e4m3_scale:
        q = (np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6)).astype(np.float32)
        s = E4M3_POS[e4m3_ref(q)].astype(np.float32)  # q > 0: the byte is the table index
    else:
        s = np.exp2(ceil_exp(np.maximum(amax, np.float32(6 * 2.0**-126)) * np.float32(1 / 6))).astype(np.float32)
    v = (g / s[..., None]).astype(np.float32)
    return e2m1_ref(v).reshape(x.shape), s


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """float64 values of e4m3 bytes (no NaN byte among them)."""
    return np.where(codes & 0x80, -1.0, 1.0) * E4M3_POS[codes & 0x7F]


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    """float64 values of 4-bit e2m1 codes."""
    return np.where(codes & 0x8, -1.0, 1.0) * MAGS[codes & 0x7]


def fp8_blocks_ref(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """encode_ref as the published files hold it.

    w: [out, in]                                float (finite)
    -> [out, in]                                float8_e4m3fn
       [ceil(out/bo), ceil(in/bi)]              float8_e8m0fnu
    """
    q, s = encode_ref(w.float().numpy(), *block)
    scale_bytes = (np.log2(s).astype(np.int64) + 127).astype(np.uint8)
    return torch.from_numpy(q).view(torch.float8_e4m3fn), torch.from_numpy(scale_bytes).view(torch.float8_e8m0fnu)


def mxfp4_ref_packed(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp4_ref as the published files hold it.

    w: [out, in]                                float (finite), in even
    -> [out, in/2]                              int8 (e2m1 pairs, element 2j in the low nibble)
       [out, ceil(in/block)]                    float8_e8m0fnu
    """
    codes, exps = mxfp4_ref(w.float().numpy(), block)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    scale_bytes = (exps + 127).astype(np.uint8)
    return torch.from_numpy(packed).view(torch.int8), torch.from_numpy(scale_bytes).view(torch.float8_e8m0fnu)
