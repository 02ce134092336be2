"""Strict loading of one rank's deployable shard, `model{rank}-mp{world}.safetensors`.

The header is read and compared with the model's state dict before a byte of data is loaded:
key sets, dtypes and shapes must agree. torch's `load_state_dict` would silently convert dtypes
(an fp8 `wo_a` loads into the bf16 parameter as garbage-free-looking numbers, its scale
ignored); here any dtype difference is an error, except one exact widening that upstream's
deployable format relies on: a bf16 tensor in the file for the float32 `weight` of a layer (the
head, the ratio>1 compressor, the MTP heads, the vision norms: upstream keeps them fp32 in the
model and bf16 on disk; such a weight stored as F32 is refused, `stored_dtype`). Bare fp32 parameters
(hc_*, attn_sink, gate biases) are F32 on disk.

Header parsing and byte-range reads are `dsv41_convert.store.safetensors_header`'s (no mmap of the whole
file, which fails for files larger than memory); data goes straight into the parameters, in file order.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from dsv41_convert.errors import PlanError
from dsv41_convert.expert_names import ROUTED_EXPERT
from dsv41_convert.model import parallel
from dsv41_convert.numbers import counted
from dsv41_convert.quant.file_dtypes import SAFETENSORS_DTYPES, TORCH_TO_SAFETENSORS
from dsv41_convert.store.rank_names import rank_file_name
from dsv41_convert.store.safetensors_header import Header, pread_exact, read_header


def shard_path(folder: Path | str, rank: int, world_size: int) -> Path:
    return Path(folder) / rank_file_name(rank, world_size)


def _file_view(p: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    """How a parameter looks in a safetensors header: (dtype string, logical shape)."""
    shape = tuple(p.shape)
    if p.dtype == torch.float4_e2m1fn_x2:
        shape = (*shape[:-1], 2 * shape[-1])
    return TORCH_TO_SAFETENSORS[p.dtype], shape


def expected_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, nn.Module]]:
    """The model's state-dict tensors and their owning modules; a tensor reachable under several
    names (the MTP stages' tied embed/head) is listed once, under its first name."""
    owners = dict(model.named_modules())
    seen: set[int] = set()
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = (t, owners[name.rpartition(".")[0]])
    return out


def stored_dtype(p: torch.Tensor, name: str) -> torch.dtype:
    """The dtype a checkpoint stores the model's tensor `name` in: the parameter's, except a layer's fp32
    `weight` (Linear, head, norm), stored as bf16 and widened on load (exactly). The bare fp32 parameters
    (hc_*, attn_sink, gate biases) are stored in F32; no published tensor named `weight` is, so an F32 one
    is refused: it loads to the same values, but it is not what any conversion writes (an audit's head
    stored as F32 on every rank passed every verify mode)."""
    return torch.bfloat16 if p.dtype == torch.float32 and name.rpartition(".")[2] == "weight" else p.dtype


def check_header(model: nn.Module, header: Header) -> None:
    """Raise PlanError naming every tensor whose presence, dtype or shape differs from the model."""
    expected = expected_tensors(model)
    tensors, path = header.tensors, header.path
    problems = []
    for name in sorted(set(expected) - set(tensors)):
        _, shape = _file_view(expected[name][0])
        dtype = TORCH_TO_SAFETENSORS[stored_dtype(expected[name][0], name)]
        problems.append(f"{name}: missing from the shard (model wants {dtype} {list(shape)})")
    for name in sorted(set(tensors) - set(expected)):
        e = tensors[name]
        problems.append(f"{name}: in the shard ({e.dtype} {list(e.shape)}) but not in the model")
    for name in sorted(set(tensors) & set(expected)):
        p = expected[name][0]
        e = tensors[name]
        _, want_shape = _file_view(p)
        want_dtype = TORCH_TO_SAFETENSORS[stored_dtype(p, name)]
        if e.dtype != want_dtype:
            problems.append(f"{name}: found {e.dtype} {list(e.shape)}, model wants {want_dtype} {list(want_shape)}")
        elif e.shape != want_shape:
            problems.append(f"{name}: found shape {list(e.shape)}, model wants {list(want_shape)} ({want_dtype})")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        other = _other_ranks_experts(expected, tensors)
        raise PlanError(
            f"{path}: {counted(len(problems), 'tensor', ('does', 'do'))} not match the "
            f"model:\n  {shown}{more}\n"
            + (
                f"It holds rank {other}'s routed experts, not this rank's: is it another rank's file renamed or copied?"
                if other is not None
                else "Was the shard written for this config and tp size by `dsv41-convert shard`?"
            )
        )


def _other_ranks_experts(expected: Collection[str], tensors: Collection[str]) -> int | None:
    """The rank whose routed experts a rank file holds in every MoE layer in place of the model's own (each rank
    holds experts [r * n, (r + 1) * n) of a layer, n its count per rank), None where it holds no other rank's
    whole set: rank files renamed or copied between ranks failed with a list of experts "missing from the
    shard" and no word of the rank they are (a helper's hunt)."""

    def by_layer(names: Collection[str]) -> dict[str, set[int]]:
        layers: dict[str, set[int]] = {}
        for name in names:
            if m := ROUTED_EXPERT.match(name):
                layers.setdefault(m["layer"], set()).add(int(m["expert"]))
        return layers

    want, found = by_layer(expected), by_layer(tensors)
    ranks = set()
    for layer, own in want.items():
        held, n = found.get(layer, set()), len(own)
        first = min(held, default=0)
        if first % n or held != set(range(first, first + n)):
            return None
        ranks.add(first // n)
    return ranks.pop() if len(ranks) == 1 and want != found and found.keys() == want.keys() else None


def _read_into(fd: int, t: torch.Tensor, offset: int, path: str) -> None:
    """Fill the contiguous CPU tensor `t` with the file's bytes from `offset`."""
    pread_exact(fd, memoryview(t.view(torch.uint8).reshape(-1).numpy()), offset, path)


@torch.no_grad()
def load_shards(model: nn.Module, folder: Path | str, rank: int | None = None, world_size: int | None = None) -> Path:
    """Load this rank's shard into `model` after checking its header against the state dict.

    rank / world_size default to torch.distributed's (0 / 1 without a process group).
    Returns the path loaded. Raises PlanError (keys, dtypes, shapes) or HeaderError (file).
    """
    rank = parallel.rank() if rank is None else rank
    world_size = parallel.world_size() if world_size is None else world_size
    path = shard_path(folder, rank, world_size)
    if not path.is_file():
        raise PlanError(f"{path}: shard not found; was it written for tp={world_size}?")
    header = read_header(path)
    check_header(model, header)
    expected = expected_tensors(model)
    fd = os.open(path, os.O_RDONLY)
    try:
        for name, e in header.tensors.items():  # file order
            p = expected[name][0]
            file_dtype = SAFETENSORS_DTYPES[e.dtype]
            if p.dtype == file_dtype and p.device.type == "cpu" and p.is_contiguous():
                _read_into(fd, p.data, e.begin, str(path))
            else:
                tmp = torch.empty(p.shape if p.dtype == file_dtype else e.shape, dtype=file_dtype)
                _read_into(fd, tmp, e.begin, str(path))
                p.data.copy_(tmp.to(p.dtype))  # same dtype, or the exact bf16 -> fp32 widening
    finally:
        os.close(fd)
    return path


def _checked(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    what: str,
    prefix: str,
    deferred: Collection[str],
    shapes: dict[str, torch.Size] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """load_tensors' check (`shapes`: module name -> the shape wanted where the parameter holds a
    placeholder). -> module name -> (its parameter or buffer, the state's tensor for it)"""
    shapes = shapes or {}
    expected = {n: v for n, v in expected_tensors(module).items() if n not in deferred}
    local = {name.removeprefix(prefix): t for name, t in state.items()}
    problems = [f"{prefix}{n}: missing" for n in sorted(set(expected) - set(local))]
    problems += [f"{prefix}{n}: not in the model" for n in sorted(set(local) - set(expected))]
    for name in sorted(set(local) & set(expected)):
        p, t = expected[name][0], local[name]
        shape, dtype = shapes.get(name, p.shape), stored_dtype(p, name)
        if t.dtype != dtype or t.shape != shape:
            problems.append(f"{prefix}{name}: {t.dtype} {list(t.shape)}, model wants {dtype} {list(shape)}")
    if problems:
        raise PlanError(f"{what} do not fit the model:\n  " + "\n  ".join(problems[:20]))
    return {name: (p, local[name]) for name, (p, _owner) in expected.items()}


@torch.no_grad()
def load_tensors(
    module: nn.Module, state: dict[str, torch.Tensor], what: str, prefix: str = "", deferred: Collection[str] = ()
) -> None:
    """Copy in-memory tensors into `module` as strictly as load_shards reads a file: the key sets (state
    names minus `prefix`) must equal the module's, shapes equal, dtypes equal except bf16 -> float32 (the
    model's fp32 Linear and head weights are bf16 in the rank files). `deferred`: module names the caller
    fills later (the streamed path's lazily read experts), left out of both sides.
    Raises PlanError naming the tensors."""
    for p, t in _checked(module, state, what, prefix, deferred).values():
        p.data.copy_(t)  # copy_ widens bf16 -> float32 exactly, without a full-size temporary


@torch.no_grad()
def bind_tensors(
    module: nn.Module,
    state: dict[str, torch.Tensor],
    what: str,
    prefix: str = "",
    deferred: Collection[str] = (),
    shapes: dict[str, torch.Size] | None = None,
) -> None:
    """load_tensors without the copy: each parameter's data becomes the state's tensor (contiguous, on
    any device; bf16 -> float32 widened there, exactly), so a tensor already on the GPU is not copied
    again. Same checks as load_tensors. `shapes`: the shapes to check against for parameters that hold a
    placeholder (the streamed path's unloaded experts: 0 elements until read)."""
    for p, t in _checked(module, state, what, prefix, deferred, shapes).values():
        t = t if t.dtype == p.dtype else t.to(p.dtype)
        p.data = t.contiguous()
