"""Which implementation of each model op runs on a device.

CPU always gets the torch references (`kernels/ref.py`, `quant/act.py`). CUDA gets the TileLang
kernel named in `CUDA_KERNELS` where there is one, and the reference otherwise. The table is
plain data: a kernel module is imported only when a CUDA device first asks for its op, so
importing the model never imports tilelang. `use_reference(True)` forces the references
everywhere (verify uses it to tell a kernel fault from a weight fault).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv41_convert.kernels import ref
from dsv41_convert.quant import act

OP_NAMES = ("act_quant", "fp4_act_quant", "fp8_gemm", "fp4_gemm", "sparse_attn", "hc_split_sinkhorn")

# op name -> "module:function" of its TileLang kernel; same signature as the reference.
# The kernels helper fills this in; an op missing here runs its reference on CUDA too.
CUDA_KERNELS: dict[str, str] = {
    "act_quant": "dsv41_convert.kernels.act_quant:act_quant",
    "fp4_act_quant": "dsv41_convert.kernels.fp4_act_quant:fp4_act_quant",
    "fp8_gemm": "dsv41_convert.kernels.fp8_gemm:fp8_gemm",
    "fp4_gemm": "dsv41_convert.kernels.fp4_gemm:fp4_gemm",
    "sparse_attn": "dsv41_convert.kernels.sparse_attn:sparse_attn",
    "hc_split_sinkhorn": "dsv41_convert.kernels.hc_split_sinkhorn:hc_split_sinkhorn",
}

_REFERENCE = {
    "act_quant": act.act_quant,
    "fp4_act_quant": act.fp4_act_quant,
    "fp8_gemm": ref.fp8_gemm,
    "fp4_gemm": ref.fp4_gemm,
    "sparse_attn": ref.sparse_attn,
    "hc_split_sinkhorn": ref.hc_split_sinkhorn,
}


@dataclass(frozen=True)
class Ops:
    """The op implementations for one device type."""

    act_quant: Callable
    fp4_act_quant: Callable
    fp8_gemm: Callable
    fp4_gemm: Callable
    sparse_attn: Callable
    hc_split_sinkhorn: Callable


_cache: dict[tuple[str, bool], Ops] = {}
_force_reference = False


def use_reference(flag: bool) -> None:
    """Force (True) or stop forcing (False) the torch references on every device."""
    global _force_reference
    _force_reference = flag


def _resolve(target: str) -> Callable:
    module_name, _, fn_name = target.partition(":")
    return getattr(importlib.import_module(module_name), fn_name)


def ops_for(device: torch.device | str) -> Ops:
    """The ops to run on `device`: references on CPU (or when forced), kernels on CUDA."""
    kind = torch.device(device).type
    key = (kind, _force_reference)
    ops = _cache.get(key)
    if ops is None:
        impls = dict(_REFERENCE)
        if kind == "cuda" and not _force_reference:
            impls.update({name: _resolve(target) for name, target in CUDA_KERNELS.items()})
        ops = _cache[key] = Ops(**impls)
    return ops
