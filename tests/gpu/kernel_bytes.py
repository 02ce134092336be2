"""The GPU tests' one comparison: a kernel's output holds exactly the bytes of its reference's."""

import torch


def same_bytes(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.dtype} {got.shape} vs {want.dtype} {want.shape}"
    )
    g, w = got.cpu().contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    bad = (g != w).sum().item()
    assert bad == 0, f"{what}: {bad} of {g.numel()} bytes differ"
