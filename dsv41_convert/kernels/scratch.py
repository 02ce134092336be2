"""One reusable host buffer per thread for the CPU reference GEMMs' widened (fp32) weights.

A weight widened to fp32 is up to 168 MB at full size ([32768, 1280] wq_b, [5120, 8192] wo_b), far
above glibc's mmap threshold (32 MiB at most): a fresh tensor per GEMM is a fresh mapping, whose pages
the kernel faults in and zeroes on every call (about a third of the widening's CPU time on the dev
box). The buffer is kept per thread (two threads never share one) and grows to the largest request;
it is held until the thread ends. Other devices get a fresh tensor (CUDA's allocator caches).
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

_local = threading.local()


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A contiguous tensor of undefined contents, valid until this thread's next call.

    -> [*shape]  dtype, on device
    """
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    buf: Tensor | None = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        _local.buf = None  # drop the smaller one before allocating the larger
        buf = _local.buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes].view(dtype).view(shape)
