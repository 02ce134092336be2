"""Torch references of the model kernels: the specification of each op, and the CPU path.

Same names and signatures as upstream `kernel.py`, so `model/` calls either through
`kernels.dispatch.ops_for(device)`. Activation quantization (`act_quant`, `fp4_act_quant`) is in
`dsv41_convert.quant.act`; this file holds the ops that consume quantized data.

Exactness (what a TileLang kernel may differ in, and why):
- `fp8_gemm`, `fp4_gemm`: each 32-wide K block is one fp32 matmul of exactly representable values
  (e4m3 x e4m3 and e2m1 x e4m3 products are exact in fp32); the block partials are scaled by
  powers of two (exact) and added to the accumulator one K block at a time, in K order. Only the
  summation order inside a K block is left to the matmul, so a kernel may differ by a few fp32
  ulp before the bf16 rounding: at most 1 bf16 ulp of the output, rarely.
- `sparse_attn`: online softmax over blocks of 64 indices, running max starting at -1e30, the
  probabilities rounded to bf16 against the running max before P.V, the sink only in the
  denominator. A kernel differs in dot-product order and `exp`: ~1 bf16 ulp of the output.
- `hc_split_sinkhorn`: the same fp32 operations in the same order; only `exp`/`sigmoid` may differ
  in the last fp32 ulp on another device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv41_convert.kernels.scratch import scratch
from dsv41_convert.quant.fp4 import decode_e2m1_pairs

SPARSE_ATTN_BLOCK = 64  # indices per online-softmax step, as the kernel tiles them
FP4_GROUP = 32  # fp4 weight: one e8m0 scale per 32 values along K


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def decode_fp4_pairs(b: Tensor) -> Tensor:
    """Unpack two e2m1 values per byte, the even element in the low nibble.

    b: [..., K/2]  float4_e2m1fn_x2 (logical [..., K])
    -> [..., K]    float32
    """
    return decode_e2m1_pairs(b)


@torch.no_grad()  # weights are Parameters; nothing differentiates through a quantized GEMM (nor do the kernels)
def _widen(b: Tensor, block_k: int) -> Tensor:
    """The exact fp32 value of every weight element, one K block after the other (each block's [N, block_k]
    contiguous), in this thread's scratch buffer (see scratch.py): valid until the next GEMM of this
    thread, so only `_blockwise_gemm` may hold it.

    b: [N, K] float8_e4m3fn, or [N, K/2] float4_e2m1fn_x2 (logical [N, K])
    -> [K/block_k, N, block_k] float32
    """
    n = b.size(0)
    if b.dtype == torch.float4_e2m1fn_x2:
        nb = b.size(1) * 2 // block_k
        out = scratch((nb, n, block_k), torch.float32, b.device)
        blocks = b.view(torch.uint8).reshape(n, nb, block_k // 2).transpose(0, 1).contiguous()  # bytes, K blocks first
        return decode_e2m1_pairs(blocks, out=out)
    nb = b.size(1) // block_k
    return scratch((nb, n, block_k), torch.float32, b.device).copy_(b.reshape(n, nb, block_k).transpose(0, 1))


@torch.no_grad()  # mm(out=) and the in-place scaling refuse operands that require grad (scales are Parameters)
def _blockwise_gemm(a: Tensor, a_s: Tensor, b_blocks: Tensor, b_s: Tensor, block_k: int) -> Tensor:
    """sum over K blocks k of (a_k @ b_k^T) * a_s[:, k] * b_s[:, k], added in K order.

    a:        [M, K] float32 (exact e4m3 values)                  a_s: [M, K/block_k] float32
    b_blocks: [K/block_k, N, block_k] float32 (exact weight values, see `_widen`)
    b_s:      [N, K/block_k] float32
    -> [M, N] float32

    The specification is the plain loop over the [N, K] weight b:
    `acc += (a[:, cols] @ b[:, cols].T) * a_s[:, k:k+1] * b_s[:, k]`. Here each block's matmul takes the
    same values from a contiguous block (the weight read once, in order; only the leading dimension
    differs), writes into one reused buffer, and the scaling is done in place: same operations, same
    order, same bits (tests/unit/test_ref_gemm_exact.py keeps the loop and compares bytes). The order
    inside a block's matmul is the BLAS kernel's.
    """
    m = a.size(0)
    n_blocks, n, _ = b_blocks.shape
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    partial = torch.empty(m, n, dtype=torch.float32, device=a.device)
    b_s_kn = b_s.T.contiguous()  # [K/block_k, N]: the scales of one K block, contiguous
    for k in range(n_blocks):
        torch.mm(a[:, k * block_k : (k + 1) * block_k], b_blocks[k].T, out=partial)
        # in place, the same fp32 operations in the same order as acc += partial * a_s[:, k] * b_s[:, k]
        acc.add_(partial.mul_(a_s[:, k : k + 1]).mul_(b_s_kn[k]))
    return acc


def fp8_gemm(
    a: Tensor,
    a_s: Tensor,
    b: Tensor,
    b_s: Tensor,
    scale_dtype: torch.dtype = torch.float32,
    block_size: int = 128,
) -> Tensor:
    """a @ b^T with per-block scales on both sides.

    a:   [..., K]                              float8_e4m3fn (activations, quantized per row block)
    a_s: [..., K/block_size]                   scale_dtype (float8_e8m0fnu or float32)
    b:   [N, K]                                float8_e4m3fn (weight)
    b_s: [ceil(N/block_size), K/block_size]    scale_dtype, one per block_size x block_size tile
    -> [..., N]                                bfloat16
    """
    k_total, n = a.size(-1), b.size(0)
    _check(a.dtype == torch.float8_e4m3fn and b.dtype == torch.float8_e4m3fn, f"fp8_gemm: dtypes {a.dtype}, {b.dtype}")
    _check(block_size in (32, 128) and k_total % block_size == 0, f"fp8_gemm: K={k_total}, block {block_size}")
    _check(b.size(1) == k_total, f"fp8_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} differ in K")
    m = a.numel() // k_total
    nb = (n + block_size - 1) // block_size
    _check(a_s.numel() == m * (k_total // block_size), f"fp8_gemm: a_s {tuple(a_s.shape)} for a {tuple(a.shape)}")
    _check(tuple(b_s.shape) == (nb, k_total // block_size), f"fp8_gemm: b_s {tuple(b_s.shape)} for b {tuple(b.shape)}")
    b_s_rows = b_s.float().repeat_interleave(block_size, dim=0)[:n]  # tile scale -> one per output row
    c = _blockwise_gemm(
        a.reshape(m, k_total).float(), a_s.reshape(m, -1).float(), _widen(b, block_size), b_s_rows, block_size
    )
    return c.to(torch.bfloat16).view(*a.shape[:-1], n)


def fp4_gemm(
    a: Tensor,
    a_s: Tensor,
    b: Tensor,
    b_s: Tensor,
    scale_dtype: torch.dtype = torch.float32,
    act_block_size: int = 128,
) -> Tensor:
    """e4m3 activations times packed e2m1 weights (MXFP4, one e8m0 scale per 32 along K).

    a:   [..., K]                  float8_e4m3fn
    a_s: [..., K/act_block_size]   scale_dtype
    b:   [N, K/2]                  float4_e2m1fn_x2 (logical [N, K])
    b_s: [N, K/32]                 float8_e8m0fnu
    -> [..., N]                    bfloat16
    """
    k_total, n = a.size(-1), b.size(0)
    _check(a.dtype == torch.float8_e4m3fn, f"fp4_gemm: activation dtype {a.dtype}")
    _check(b.dtype == torch.float4_e2m1fn_x2, f"fp4_gemm: weight dtype {b.dtype}")
    _check(act_block_size in (32, 128) and k_total % act_block_size == 0, f"fp4_gemm: K={k_total}")
    _check(b.size(1) * 2 == k_total, f"fp4_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} (packed) differ in K")
    m = a.numel() // k_total
    _check(a_s.numel() == m * (k_total // act_block_size), f"fp4_gemm: a_s {tuple(a_s.shape)} for a {tuple(a.shape)}")
    _check(tuple(b_s.shape) == (n, k_total // FP4_GROUP), f"fp4_gemm: b_s {tuple(b_s.shape)} for b {tuple(b.shape)}")
    # the weight group is the finer one: walk K in 32s, each activation scale covering act_block/32 of them
    a_s32 = a_s.reshape(m, -1).float().repeat_interleave(act_block_size // FP4_GROUP, dim=1)
    c = _blockwise_gemm(a.reshape(m, k_total).float(), a_s32, _widen(b, FP4_GROUP), b_s.float(), FP4_GROUP)
    return c.to(torch.bfloat16).view(*a.shape[:-1], n)


def sparse_attn(q: Tensor, kv: Tensor, attn_sink: Tensor, topk_idxs: Tensor, softmax_scale: float) -> Tensor:
    """Attention of every query over its own list of KV rows; one KV head that is both K and V.

    q:         [b, m, h, d]  bfloat16
    kv:        [b, n, d]     bfloat16
    attn_sink: [h]           float32, a logit with no value: it only adds exp(sink) to the denominator
    topk_idxs: [b, m, topk]  int32, rows of kv; -1 = nothing (a row of only -1 gives 0)
    -> [b, m, h, d]          bfloat16
    """
    b, m, h, d = q.shape
    _check(
        kv.dim() == 3 and kv.size(0) == b and kv.size(2) == d, f"sparse_attn: q {tuple(q.shape)}, kv {tuple(kv.shape)}"
    )
    _check(
        tuple(topk_idxs.shape[:2]) == (b, m), f"sparse_attn: topk_idxs {tuple(topk_idxs.shape)} for q {tuple(q.shape)}"
    )
    _check(attn_sink.numel() == h, f"sparse_attn: attn_sink {tuple(attn_sink.shape)} for {h} heads")
    dev = q.device
    scale = torch.tensor(softmax_scale, dtype=torch.float32, device=dev)
    q32, kv32 = q.float(), kv.float()
    out = torch.zeros(b, m, h, d, dtype=torch.float32, device=dev)
    denom = torch.zeros(b, m, h, dtype=torch.float32, device=dev)
    run_max = torch.full((b, m, h), -1e30, dtype=torch.float32, device=dev)  # finite: all-masked rows stay 0
    batch = torch.arange(b, device=dev).view(b, 1, 1)
    for start in range(0, topk_idxs.size(-1), SPARSE_ATTN_BLOCK):
        idx = topk_idxs[:, :, start : start + SPARSE_ATTN_BLOCK].long()
        valid = idx != -1  # [b, m, blk]
        rows = kv32[batch, idx.clamp_min(0)] * valid.unsqueeze(-1)  # [b, m, blk, d]
        logits = torch.einsum("bmhd,bmkd->bmhk", q32, rows)
        logits = torch.where(valid.unsqueeze(2), logits, -torch.inf) * scale
        new_max = torch.maximum(run_max, logits.amax(dim=-1))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(logits - new_max.unsqueeze(-1))
        denom = denom * rescale + p.sum(dim=-1)  # fp32 probabilities in the denominator
        pv = torch.einsum("bmhk,bmkd->bmhd", p.to(torch.bfloat16).float(), rows)  # bf16 P before P.V
        out = out * rescale.unsqueeze(-1) + pv
        run_max = new_max
    denom = denom + torch.exp(attn_sink.float() - run_max)
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16)


def hc_split_sinkhorn(
    mixes: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    hc_mult: int = 4,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """Split the hyper-connection mixes into pre / post weights and a doubly stochastic comb.

    mixes:   [b, s, (2+hc)*hc]  float32, laid out pre (hc) | post (hc) | comb (hc*hc, row-major)
    hc_scale: [3]               float32, one scale per part
    hc_base:  [(2+hc)*hc]       float32
    -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc]   float32
    pre = sigmoid + eps; post = 2 sigmoid; comb = row softmax + eps, then a column normalisation,
    then sinkhorn_iters - 1 rounds of (row, column) normalisation, each sum plus eps.
    """
    hc = hc_mult
    _check(mixes.size(-1) == (2 + hc) * hc, f"hc_split_sinkhorn: mixes {tuple(mixes.shape)} for hc_mult={hc}")
    x, sc, base = mixes.float(), hc_scale.float(), hc_base.float()
    pre = torch.sigmoid(x[..., :hc] * sc[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(x[..., hc : 2 * hc] * sc[1] + base[hc : 2 * hc])
    comb = (x[..., 2 * hc :] * sc[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb
