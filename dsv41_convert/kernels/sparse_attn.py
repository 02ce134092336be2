"""sparse_attn on CUDA: each query attends to its own gathered KV rows, matching `kernels.ref.sparse_attn`.

Numerics (as the reference): one KV head used as both K and V; indices in blocks of 64; the running
max starts at -1e30 (a row of only -1 gives 0, not NaN); index -1 contributes a -inf logit; the
probabilities are float32 in the denominator and rounded to bf16 against the running max before
P.V; the sink adds exp(sink - max) to the denominator only; one rounding to bf16 at the end.

Bound against the reference: |out - ref| <= 2**-7 * |ref| + 2**-8 * max|v| (checked by
tests/gpu/test_model_kernels.py). The tensor cores sum the q.k and P.V dot products in another order
(float32, a few ulp), `expf` differs from torch's by an ulp or two, and a probability near a bf16
rounding boundary may round the other way (2**-8 relative, weighted by |v|); the final bf16 rounding
adds one ulp.

Compiled once per (h, d, topk bucket): the index list is padded with -1 to a power-of-two number of
64-blocks (`topk_bucket`). A block of only -1 leaves the softmax state exactly as it was (its logits
are -inf: probabilities 0, rescale exp(0) = 1), so padding changes no bit, and a decode, whose index
count grows every few tokens, compiles a handful of kernels instead of one per count.

Layout: one CTA per (batch, query, 16 heads); the 64 KV rows of a block are gathered into shared
memory, S = Q K^T and O += P V run on the tensor cores, the softmax state lives in registers.
"""

import torch
from torch import Tensor

from dsv41_convert.kernels.tl import BF16, F32, I32, PASS_CONFIGS, T, tilelang
from dsv41_convert.kernels.topk import BLOCK, topk_bucket

HEADS = 16  # heads per CTA
THREADS = 128


@tilelang.jit(pass_configs=PASS_CONFIGS)
def sparse_attn_kernel(h: int, d: int, topk: int):
    """q [b, m, h, d] bf16, kv [b, n, d] bf16, sink [h] f32, idx [b, m, topk] int32, scale (f32 scalar)
    -> [b, m, h, d] bf16. The softmax scale is a run-time argument: one compiled kernel serves every scale."""
    b = T.dynamic("b")
    m = T.dynamic("m")
    n = T.dynamic("n")
    steps = -(-topk // BLOCK)

    @T.prim_func
    def sparse_attn_(
        q: T.Tensor[(b, m, h, d), BF16],
        kv: T.Tensor[(b, n, d), BF16],
        attn_sink: T.Tensor[(h,), F32],
        topk_idxs: T.Tensor[(b, m, topk), I32],
        softmax_scale: T.float32,
        out: T.Tensor[(b, m, h, d), BF16],
    ):
        with T.Kernel(T.ceildiv(h, HEADS), m, b, threads=THREADS) as (bh, bm, bb):
            q_sh = T.alloc_shared((HEADS, d), BF16)
            kv_sh = T.alloc_shared((BLOCK, d), BF16)
            p_sh = T.alloc_shared((HEADS, BLOCK), BF16)
            idx_sh = T.alloc_shared((BLOCK,), I32)
            acc_s = T.alloc_fragment((HEADS, BLOCK), F32)
            acc_o = T.alloc_fragment((HEADS, d), F32)
            run_max = T.alloc_fragment((HEADS,), F32)
            prev_max = T.alloc_fragment((HEADS,), F32)
            rescale = T.alloc_fragment((HEADS,), F32)
            blk_max = T.alloc_fragment((HEADS,), F32)
            blk_sum = T.alloc_fragment((HEADS,), F32)
            denom = T.alloc_fragment((HEADS,), F32)

            T.copy(q[bb, bm, bh * HEADS, 0], q_sh)  # heads past h read as zeros
            T.clear(acc_o)
            T.clear(denom)
            T.fill(run_max, -1e30)  # finite: all-masked rows stay 0
            for t in T.serial(steps):
                for j in T.Parallel(BLOCK):
                    # idx = topk_idxs[..., t:t+64]; past topk counts as -1
                    idx_sh[j] = T.if_then_else(t * BLOCK + j < topk, topk_idxs[bb, bm, t * BLOCK + j], -1)
                for j, c in T.Parallel(BLOCK, d):
                    # rows = kv[batch, idx.clamp_min(0)] * valid
                    kv_sh[j, c] = T.if_then_else(idx_sh[j] >= 0, kv[bb, T.max(idx_sh[j], 0), c], T.bfloat16(0))
                # logits = q . rows
                T.gemm(q_sh, kv_sh, acc_s, transpose_B=True, clear_accum=True)
                for i, j in T.Parallel(HEADS, BLOCK):
                    # where(valid, logits, -inf) * scale
                    acc_s[i, j] = T.if_then_else(idx_sh[j] >= 0, acc_s[i, j], -T.infinity(F32)) * softmax_scale
                T.copy(run_max, prev_max)
                T.reduce_max(acc_s, blk_max, dim=1, clear=True)
                for i in T.Parallel(HEADS):
                    run_max[i] = T.max(prev_max[i], blk_max[i])  # new_max = maximum(run_max, logits.amax(-1))
                    rescale[i] = T.exp(prev_max[i] - run_max[i])  # exp(run_max - new_max)
                for i, j in T.Parallel(HEADS, BLOCK):
                    acc_s[i, j] = T.exp(acc_s[i, j] - run_max[i])  # p = exp(logits - new_max)
                T.reduce_sum(acc_s, blk_sum, dim=1, clear=True)
                for i in T.Parallel(HEADS):
                    denom[i] = denom[i] * rescale[i] + blk_sum[i]  # denom * rescale + p.sum(-1)
                T.copy(acc_s, p_sh)  # p.to(bfloat16)
                for i, c in T.Parallel(HEADS, d):
                    acc_o[i, c] *= rescale[i]  # out * rescale
                T.gemm(p_sh, kv_sh, acc_o)  # + p_bf16 @ rows
            for i in T.Parallel(HEADS):
                # denom + exp(sink - run_max)
                denom[i] = denom[i] + T.exp(
                    T.if_then_else(bh * HEADS + i < h, attn_sink[T.min(bh * HEADS + i, h - 1)], T.float32(0))
                    - run_max[i]
                )
            for i, c in T.Parallel(HEADS, d):
                acc_o[i, c] = acc_o[i, c] / denom[i]  # out / denom
            T.copy(acc_o, out[bb, bm, bh * HEADS, 0])  # .to(bfloat16); heads past h are not written

    return sparse_attn_


def sparse_attn(q: Tensor, kv: Tensor, attn_sink: Tensor, topk_idxs: Tensor, softmax_scale: float) -> Tensor:
    """Sparse single-KV-head attention with a sink; same signature as kernels.ref.sparse_attn.

    q:         [b, m, h, d]  bfloat16, CUDA (d a multiple of 16)
    kv:        [b, n, d]     bfloat16
    attn_sink: [h]           float32
    topk_idxs: [b, m, topk]  int32, rows of kv; -1 = nothing
    -> [b, m, h, d]          bfloat16
    """
    if q.dim() != 4 or kv.dim() != 3 or q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16 or not q.is_cuda:
        raise ValueError(f"sparse_attn: q {q.dtype} {list(q.shape)}, kv {kv.dtype} {list(kv.shape)}: want bf16 CUDA")
    bsz, m, h, d = q.shape
    if kv.size(0) != bsz or kv.size(2) != d or d % 16 or tuple(topk_idxs.shape[:2]) != (bsz, m):
        raise ValueError(f"sparse_attn: q {list(q.shape)}, kv {list(kv.shape)}, topk_idxs {list(topk_idxs.shape)}")
    if attn_sink.numel() != h:
        raise ValueError(f"sparse_attn: attn_sink {list(attn_sink.shape)} for {h} heads")
    out = torch.empty_like(q)
    topk = topk_idxs.size(-1)
    if out.numel() and topk:
        padded = topk_bucket(topk)
        kernel = sparse_attn_kernel(h, d, padded)
        kernel(
            q.contiguous(),
            kv.contiguous(),
            attn_sink.float().contiguous(),
            torch.nn.functional.pad(topk_idxs.int(), (0, padded - topk), value=-1).contiguous(),
            float(softmax_scale),
            out,
        )
    elif out.numel():
        # no index at all: only the sink in the denominator, nothing in the numerator
        out.zero_()
    return out


def warm_up(h: int, d: int, topk: int, softmax_scale: float | None = None) -> None:
    """Compile the kernel for h local heads, head dim d and topk indices before collectives start.

    softmax_scale is accepted for old callers and ignored: the scale is a run-time argument.
    """
    sparse_attn_kernel(h, d, topk_bucket(topk))
