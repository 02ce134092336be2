"""Whether the model's runtime caches, and a prompt's prefill, can exist on this machine, asked before the
model is built.

The model sizes its window KV ring by the config's `sliding_window` and its Engram token map by the
vocabulary, whatever the prompts: a config value far beyond the published one (a window of 10**12 rows) would
otherwise end verify or reference-logits in an allocator's traceback. A prompt's prefill makes, per index
layer, the scores of every query against every compressed position: quadratic in the prompt's length (a
100,000-token prompt on make-tiny: 80 GB, an allocator's traceback after minutes of compute). The weights
too (plan's per-rank figures, convert.memory): a model larger than the host's RAM (the full-size layout on a
23 GB host) ended in an allocator's traceback building an Engram table, not a refusal."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from dsv41_convert import torchrun
from dsv41_convert.config import HF_NAMES, ModelArgs, load_json
from dsv41_convert.convert.memory import BF16, cache_bytes
from dsv41_convert.errors import ConfigError, VerifyInputError
from dsv41_convert.numbers import ascii_int
from dsv41_convert.store.machine import physical_memory

GIB = 1 << 30


# the way out where the DSpark drafts alone need more positions than fit: reference-logits takes --decode-steps,
# verify --reference-logits runs its file's (it said "--decode-steps 0", an option verify refuses there)
NO_DRAFTS = (
    "a config whose block fits, or no decode steps (--decode-steps 0; verify --reference-logits runs its file's: "
    "compute that with --decode-steps 0)"
)


def machine_bytes(device: str) -> int:
    """Bytes of memory `device` has in all: the host's physical memory for "cpu", the card's for a CUDA
    device (the current one for "cuda")."""
    if device == "cpu":
        return physical_memory()
    import torch

    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def _local_world_size() -> int:
    """LOCAL_WORLD_SIZE (torchrun's, or verify's spawned ranks'), 0 where it is unset or not a number."""
    try:
        return ascii_int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return 0


def processes_on_this_host() -> int:
    """The model processes that build their caches in this host's memory at once: a torchrun launch's
    LOCAL_WORLD_SIZE, else every rank of the group (verify starts them all here); 1 outside a group."""
    from dsv41_convert.model import parallel

    local = _local_world_size()
    return local if local > 0 else parallel.world_size()


def ranks_on_this_host(tp: int) -> range | int:
    """The ranks of a tp-`tp` run that will build their models in this host's memory at once, asked before they
    start (no torch): all `tp` (launch starts them here), or under a torchrun launch of several hosts its
    LOCAL_WORLD_SIZE of them, ranks RANK - LOCAL_RANK onwards (torchrun numbers a host's ranks in a row); only how
    many where the launch does not say which (no LOCAL_RANK): the caller counts the largest."""
    local = _local_world_size() if torchrun.world() is not None else 0
    if local <= 0 or local >= tp:
        return range(tp)
    try:
        first = torchrun.rank() - ascii_int(os.environ.get("LOCAL_RANK", ""))
    except ValueError:
        return local
    return range(first, first + local) if 0 <= first <= tp - local else local


def require_weights_fit(
    ranks: Sequence[int], device: str, what: str, way_out: str, card: Sequence[int] | None = None, beside: int = 0
) -> None:
    """VerifyInputError when the weights the model holds exceed all the memory of the host (the ranks it runs at
    once: `ranks_on_this_host`, the largest of `ranks` counted where it does not know which) or, on a card, one
    rank's exceed the card's. Asked before any model is built (each is built on the host, then moved).

    ranks:   bytes of weights each rank holds in the host's memory at its peak, rank order (convert.memory's
             rank_weights / model_bytes; with the state dict it is loaded from: reference_weights)
    card:    bytes of weights each rank moves onto its card (its model's), rank order; None: `ranks`
    beside:  bytes this host holds meanwhile apart from the ranks (the verify process's reference and twin)
    what:    the model, for the message (a folder, "SRC at tp N")
    way_out: the run that holds less (--stream-layers), for the message"""
    here = ranks_on_this_host(len(ranks))
    held = list(here) if isinstance(here, range) else sorted(range(len(ranks)), key=ranks.__getitem__)[-here:]
    if len(held) == len(ranks):
        which = ""
    elif isinstance(here, range):
        which = f": rank{'s' if len(here) > 1 else ''} {here.start}{f'-{here.stop - 1}' if len(here) > 1 else ''}"
        which += f" of {len(ranks)}"
    else:
        which = f": the largest {len(held)} of {len(ranks)}, LOCAL_RANK unset"
    sharing = len(held)
    card = ranks if card is None else card
    for where in dict.fromkeys(("cpu", device)):
        need = sum(ranks[r] for r in held) + beside if where == "cpu" else max(card[r] for r in held)
        have = machine_bytes(where)
        if need <= have:
            continue
        if where == "cpu":
            parts = [f"{sharing} ranks on this host{which}, {(need - beside) / sharing / GIB:,.1f} GiB each"]
            parts = parts if sharing > 1 else [f"1 rank on this host{which}"] if which else []
            parts += [f"{beside / GIB:,.1f} GiB beside them"] if beside else []
            per = f" ({'; '.join(parts)})" if parts else ""
            memory, larger = f"this host's physical memory ({have / GIB:,.1f} GiB of RAM, swap not counted)", "host"
        else:
            per, memory, larger = "", f"{where}'s memory ({have / GIB:,.1f} GiB)", "card"
        raise VerifyInputError(
            f"{what}: the model's weights need {need / GIB:,.1f} GiB{per}, more than all of {memory}: "
            f"{way_out}, or a larger {larger}"
        )


def _key(config: Path, field: str) -> str:
    """ModelArgs `field`'s key as `config` spells it: the HF config.json nests it, the rank files' does not."""
    return HF_NAMES[field] if "text_config" in load_json(config) else field


def require_caches_fit(args: ModelArgs, device: str, config: Path, drafted: int = 0) -> None:
    """An error when the caches a model of `args` allocates at its runtime batch and sequence length
    (convert.memory.cache_bytes) exceed all the memory of the host (where the model is built) or of `device`
    (where it runs): ConfigError naming `config` (the file `args` came from) and its window key where the
    window ring alone does, or its dspark_block_size where the shortest run with DSpark drafts alone does (`drafted`
    positions: runner.shortest_drafted; 0 for a model without them), else VerifyInputError naming the positions
    (--max-seq-len, or a reference file's)."""
    each = cache_bytes(args, args.max_batch_size, args.max_seq_len)
    for where in dict.fromkeys(("cpu", device)):
        have, sharing = machine_bytes(where), processes_on_this_host() if where == "cpu" else 1
        need = each * sharing
        if need <= have:
            continue
        rings = (args.n_layers + args.n_mtp_layers) * args.max_batch_size
        window = rings * args.window_size * args.head_dim * BF16
        per = f" ({sharing} processes on this host, {each / GIB:,.1f} GiB each)" if sharing > 1 else ""
        said = (
            f"the model's caches need {need / GIB:,.1f} GiB{per}, more than all of {where}'s memory "
            f"({have / GIB:,.1f} GiB)"
        )
        if window > have:  # one process's rings alone: the config's window is what is too large
            raise ConfigError(
                f"{config}: {said}: {_key(config, 'window_size')} = {args.window_size}: its KV rings alone are "
                f"{window / GIB:,.1f} GiB ({rings} rings: a layer's each, at batch {args.max_batch_size})"
            )
        if 0 < drafted <= args.max_seq_len and cache_bytes(args, args.max_batch_size, drafted) * sharing > have:
            # the drafts made the run this long: the message blamed a --max-seq-len no one gave (a carried item)
            raise ConfigError(
                f"{config}: {said}: {_key(config, 'dspark_block_size')} = {args.dspark_block_size}: the DSpark "
                f"drafts after a decode step take that many positions, {drafted:,} with a 1-token prompt and one "
                f"decode step: {NO_DRAFTS}"
            )
        raise VerifyInputError(
            f"{said} at batch {args.max_batch_size} and {args.max_seq_len:,} positions (--max-seq-len, or the "
            "reference file's): fewer positions, or shorter prompts and decode steps"
            + (", or fewer ranks on this host" if sharing > 1 else "")
        )


def prefill_scores_shape(args: ModelArgs, seq: int, tp: int = 1) -> tuple[int, int, int, int] | None:
    """The indexer's scores in a prefill of `seq` positions on one of `tp` ranks, at the index layer of the least
    compress ratio: [1, seq, index_n_heads / tp, seq / ratio] bfloat16 (model/indexer.py); None without index
    layers. One tensor of the prefill, so a lower bound of its peak: what it refuses cannot run at all."""
    ratios = [max(1, args.compress_ratios[layer]) for layer in args.index_source_layers if layer < args.n_layers]
    return (1, seq, args.index_n_heads // tp, seq // min(ratios)) if ratios else None


def require_prompts_fit(args: ModelArgs, device: str, prompts: Sequence[tuple[str, int]], tp: int = 1) -> None:
    """VerifyInputError naming the longest of `prompts` (label, positions) whose prefill's indexer scores alone
    exceed all the memory of `device` (the ranks' shares together where they share the host's memory, "cpu")."""
    if not prompts:
        return
    label, seq = max(prompts, key=lambda p: p[1])
    shape = prefill_scores_shape(args, seq, tp)
    if shape is None:
        return
    sharing = tp if device == "cpu" else 1
    need, have = math.prod(shape) * BF16 * sharing, machine_bytes(device)
    if need <= have:
        return
    per = f" on each of {tp} ranks" if tp > 1 else ""
    raise VerifyInputError(
        f"{label}: a prompt of {seq:,} positions: its prefill's indexer scores alone ({list(shape)} bfloat16{per}) "
        f"need {need / GIB:,.1f} GiB, more than all of {device}'s memory ({have / GIB:,.1f} GiB): shorten it"
    )
