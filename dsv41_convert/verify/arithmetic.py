"""What a run's sums depend on besides tp, threads and torch: the kernels the math libraries pick here.

MKL and oneDNN choose a kernel by the CPU's instruction sets (and by the variables that cap them), and
kernels for other instruction sets add in another order: a reference computed on an AVX-512 host is
not reproduced bit for bit on an AVX2 host by the same code on the same weights (an audit, 2026-12-05:
MKL_ENABLE_INSTRUCTIONS=AVX2 alone made a correct conversion's exact checks differ). On a GPU the
model and the CUDA version decide the same way. reference-logits records `arithmetic(device)`, and a
verify run whose own differs does not expect bit equality (verdict.exact_blockers).
"""

from __future__ import annotations

import functools
import os
import platform

import torch

# instruction sets whose presence changes which float kernels MKL, oneDNN or ATen run
_FLOAT_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_fp16",
)  # fmt: skip
# variables that cap or pin the kernels the libraries pick
_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def arithmetic(device: str) -> str:
    """One line naming what picks this process's kernels on `device` ("cpu" | "cuda[:N]"), e.g.
    "x86_64 AVX512; avx avx2 avx512f fma; MKL_ENABLE_INSTRUCTIONS=AVX2" or "NVIDIA H200 sm_90; CUDA 13.0"."""
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(torch.device(device))
        return f"{p.name} sm_{p.major}{p.minor}; CUDA {torch.version.cuda}"
    parts = [f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}", " ".join(_cpu_flags())]
    parts += [f"{name}={os.environ[name]}" for name in _CAPS if os.environ.get(name)]
    return "; ".join(p for p in parts if p)


@functools.cache
def _cpu_flags() -> tuple[str, ...]:
    """The _FLOAT_FLAGS this CPU has (Linux's /proc/cpuinfo; () where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return tuple(sorted(have.intersection(_FLOAT_FLAGS)))
    except OSError:
        pass
    return ()
