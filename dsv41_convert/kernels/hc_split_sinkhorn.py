"""hc_split_sinkhorn on CUDA: the hyper-connection split and Sinkhorn normalisation, per token.

Numerics: the same float32 operations in the same order as `kernels.ref.hc_split_sinkhorn` (which
follows the upstream kernel): pre = sigmoid + eps, post = 2 sigmoid, comb = row softmax + eps, a
column normalisation, then sinkhorn_iters - 1 rounds of row and column normalisation, each sum plus
eps, sums taken left to right. Divisions are IEEE (fast math off); only `expf` (in exp and sigmoid)
may differ from torch's CPU exp by an ulp or two, and the normalisations are contractions, so the
bound is tight: |out - ref| <= 1e-6 + 1e-5 * |ref| (checked by tests/gpu/test_model_kernels.py).

Layout: one thread per token holds its (2 + hc) * hc mixes in registers.
"""

import torch
from torch import Tensor

from dsv41_convert.kernels.tl import F32, PASS_CONFIGS, T, tilelang

THREADS = 128


@tilelang.jit(pass_configs=PASS_CONFIGS)
def hc_split_sinkhorn_kernel(hc: int, sinkhorn_iters: int, eps: float):
    """[n, (2+hc)*hc] float32 mixes -> pre [n, hc], post [n, hc], comb [n, hc, hc]."""
    n = T.dynamic("n")
    mix = (2 + hc) * hc

    @T.prim_func
    def hc_split_sinkhorn_(
        mixes: T.Tensor[(n, mix), F32],
        hc_scale: T.Tensor[(3,), F32],
        hc_base: T.Tensor[(mix,), F32],
        pre: T.Tensor[(n, hc), F32],
        post: T.Tensor[(n, hc), F32],
        comb: T.Tensor[(n, hc, hc), F32],
    ):
        with T.Kernel(T.ceildiv(n, THREADS), threads=THREADS) as bx:
            t = bx * THREADS + T.get_thread_binding()
            x = T.alloc_local((mix,), F32)
            cm = T.alloc_local((hc, hc), F32)
            acc = T.alloc_local((1,), F32)
            if t < n:
                for j in T.unroll(mix):
                    x[j] = mixes[t, j]
                for j in T.unroll(hc):
                    pre[t, j] = T.sigmoid(x[j] * hc_scale[0] + hc_base[j]) + T.float32(eps)  # sigmoid(..) + eps
                    post[t, j] = T.float32(2) * T.sigmoid(x[hc + j] * hc_scale[1] + hc_base[hc + j])  # 2 * sigmoid(..)
                for i in T.unroll(hc):
                    for j in T.unroll(hc):
                        cm[i, j] = x[2 * hc + i * hc + j] * hc_scale[2] + hc_base[2 * hc + i * hc + j]
                # comb = exp(comb - comb.amax(-1)); comb = comb / comb.sum(-1) + eps
                for i in T.unroll(hc):
                    acc[0] = cm[i, 0]
                    for j in T.unroll(1, hc):
                        acc[0] = T.max(acc[0], cm[i, j])
                    for j in T.unroll(hc):
                        cm[i, j] = T.exp(cm[i, j] - acc[0])
                    acc[0] = cm[i, 0]
                    for j in T.unroll(1, hc):
                        acc[0] = acc[0] + cm[i, j]
                    for j in T.unroll(hc):
                        cm[i, j] = cm[i, j] / acc[0] + T.float32(eps)
                # comb = comb / (comb.sum(-2) + eps)
                for j in T.unroll(hc):
                    acc[0] = cm[0, j]
                    for i in T.unroll(1, hc):
                        acc[0] = acc[0] + cm[i, j]
                    for i in T.unroll(hc):
                        cm[i, j] = cm[i, j] / (acc[0] + T.float32(eps))
                for _ in T.serial(sinkhorn_iters - 1):
                    # comb = comb / (comb.sum(-1) + eps)
                    for i in T.unroll(hc):
                        acc[0] = cm[i, 0]
                        for j in T.unroll(1, hc):
                            acc[0] = acc[0] + cm[i, j]
                        for j in T.unroll(hc):
                            cm[i, j] = cm[i, j] / (acc[0] + T.float32(eps))
                    # comb = comb / (comb.sum(-2) + eps)
                    for j in T.unroll(hc):
                        acc[0] = cm[0, j]
                        for i in T.unroll(1, hc):
                            acc[0] = acc[0] + cm[i, j]
                        for i in T.unroll(hc):
                            cm[i, j] = cm[i, j] / (acc[0] + T.float32(eps))
                for i in T.unroll(hc):
                    for j in T.unroll(hc):
                        comb[t, i, j] = cm[i, j]

    return hc_split_sinkhorn_


def hc_split_sinkhorn(
    mixes: Tensor,
    hc_scale: Tensor,
    hc_base: Tensor,
    hc_mult: int = 4,
    sinkhorn_iters: int = 20,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """Split the hyper-connection mixes; same signature as kernels.ref.hc_split_sinkhorn.

    mixes:    [b, s, (2+hc)*hc]  float32, CUDA
    hc_scale: [3]                float32
    hc_base:  [(2+hc)*hc]        float32
    -> pre [b, s, hc], post [b, s, hc], comb [b, s, hc, hc]   float32
    """
    hc = hc_mult
    mix = (2 + hc) * hc
    if mixes.size(-1) != mix or hc_scale.numel() != 3 or hc_base.numel() != mix or not mixes.is_cuda:
        raise ValueError(
            f"hc_split_sinkhorn: mixes {list(mixes.shape)}, hc_scale {list(hc_scale.shape)}, "
            f"hc_base {list(hc_base.shape)} for hc_mult={hc} (want last dim {mix} on CUDA)"
        )
    if sinkhorn_iters < 1:
        raise ValueError(f"hc_split_sinkhorn: sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
    lead = mixes.shape[:-1]
    x = mixes.float().contiguous().view(-1, mix)
    rows = x.size(0)
    pre = torch.empty(rows, hc, dtype=torch.float32, device=mixes.device)
    post = torch.empty(rows, hc, dtype=torch.float32, device=mixes.device)
    comb = torch.empty(rows, hc, hc, dtype=torch.float32, device=mixes.device)
    if rows:
        kernel = hc_split_sinkhorn_kernel(hc, sinkhorn_iters, float(eps))
        kernel(x, hc_scale.float().contiguous(), hc_base.float().contiguous(), pre, post, comb)
    return pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc)


def warm_up(hc_mult: int = 4, sinkhorn_iters: int = 20, eps: float = 1e-6) -> None:
    """Compile the kernel before collectives start."""
    hc_split_sinkhorn_kernel(hc_mult, sinkhorn_iters, float(eps))
