"""Which tensor-parallel sizes the model can run: every per-rank shape the model builds must divide.

One statement of the rule, from the config alone (no tensor is read), used by `plan` and `shard`
(build_plan, before a byte moves) and by `verify` on a converted folder (before a rank starts).

What a rank's shapes take from tp (model/: attention.py, indexer.py, head.py, layers.py, moe.py, mtp.py):
    n_heads                      attention heads per rank: wq_b rows, attn_sink (backbone and DSpark stages)
    o_groups                     wo_a output groups per rank (n_local_groups; 0 at tp > o_groups)
    o_groups * o_lora_rank       wo_a rows and wo_b columns per rank, in whole 32-blocks (fp8 scale
                                 blocks, and wo_b's activations are quantized per 32 input features)
    n_heads * head_dim           wq_b rows per rank, in whole 32-row scale blocks
    index_n_heads                indexer heads per rank: indexer.wq_b rows, weights_proj rows
    index_n_heads * index_head_dim   indexer.wq_b rows per rank, in whole 32-row scale blocks
    vocab_size                   embed and head rows per rank, and the DSpark markov_head's embed and head
    n_routed_experts             whole routed experts per rank, backbone layers
    dspark_n_routed_experts      whole routed experts per rank, DSpark stages (0: the backbone's count)
The Engram tables are split in ceil(rows / tp) padded slices and everything else is replicated: any tp.
For V4.1-Flash (64 heads, o_groups 8, 32 indexer heads, vocab 2^8 x 505, 384 and 128 experts) that
leaves tp 1, 2, 4, 8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dsv41_convert.config import HF_NAMES, ModelArgs
from dsv41_convert.errors import PlanError
from dsv41_convert.store.rank_names import rank_files_in

BLOCK = 32  # the fp8 weight block (quantization_config.weight_block_size) and the activation quant block
MAX_LISTED = 12  # tp values listed per requirement


@dataclass(frozen=True)
class TpRequirement:
    """The per-rank share of one model dimension, `value` / tp, must be whole and (at tp > 1) a multiple of `unit`."""

    keys: tuple[str, ...]  # ModelArgs fields whose product is `value`
    value: int
    unit: int  # 1: whole heads, groups, rows, experts; BLOCK: whole 32-blocks
    needs: str  # what a rank's shapes take from it

    def holds(self, tp: int) -> bool:
        # tp 1 cuts nothing, so a partial last block is no problem there
        return self.value % tp == 0 and (tp == 1 or (self.value // tp) % self.unit == 0)

    def working_tps(self) -> list[int]:
        """Every tp at which this holds, ascending: divisors of `value`, found in pairs up to its square root (one
        by one up to the value, a typo of 10**9 experts took minutes before a wrong tp was said)."""
        small = [d for d in range(1, math.isqrt(self.value) + 1) if self.value % d == 0]
        return [d for d in sorted({*small, *(self.value // d for d in small)}) if self.holds(d)]

    def problem(self, tp: int) -> str:
        """`o_groups = 8: wo_a output groups per rank; 8 / 16 is not whole; works at tp 1, 2, 4, 8`."""
        names = " x ".join(f"{k} ({HF_NAMES[k]})" if HF_NAMES.get(k, f"text_config.{k}") != f"text_config.{k}" else k
                           for k in self.keys)  # fmt: skip
        if self.unit == 1:
            why = f"{self.value} / {tp} is not whole"
        else:
            why = f"{self.value} / {tp} = {self.value / tp:g} is not a multiple of {self.unit}"
        return f"{names} = {self.value}: {self.needs}; {why}; works at tp {_listed(self.working_tps())}"


def rank_file_tps(folder: Path) -> list[int]:
    """The tp sizes of the rank files in `folder`, sorted; [] for a folder without any."""
    return sorted(rank_files_in(folder))


def tp_requirements(args: ModelArgs) -> list[TpRequirement]:
    """Every divisibility the model needs of tp, for this config (the table in the module docstring)."""
    reqs = [
        TpRequirement(("n_heads",), args.n_heads, 1, "attention heads per rank (wq_b rows, attn_sink)"),
        TpRequirement(("o_groups",), args.o_groups, 1, "wo_a output groups per rank"),
        TpRequirement(
            ("o_groups", "o_lora_rank"),
            args.o_groups * args.o_lora_rank,
            BLOCK,
            "wo_a rows and wo_b columns per rank, in whole 32-blocks",
        ),
        TpRequirement(
            ("n_heads", "head_dim"),
            args.n_heads * args.head_dim,
            BLOCK,
            "wq_b rows per rank, in whole 32-row scale blocks",
        ),
    ]
    if args.index_source_layers:
        reqs += [
            TpRequirement(("index_n_heads",), args.index_n_heads, 1, "indexer heads per rank (wq_b, weights_proj)"),
            TpRequirement(
                ("index_n_heads", "index_head_dim"),
                args.index_n_heads * args.index_head_dim,
                BLOCK,
                "indexer wq_b rows per rank, in whole 32-row scale blocks",
            ),
        ]
    vocab_users = "embed and head rows per rank" + (", DSpark markov_head embed and head" if args.n_mtp_layers else "")
    reqs.append(TpRequirement(("vocab_size",), args.vocab_size, 1, vocab_users))
    reqs.append(TpRequirement(("n_routed_experts",), args.n_routed_experts, 1, "routed experts per rank, backbone"))
    if args.n_mtp_layers and args.dspark_n_routed_experts:
        reqs.append(
            TpRequirement(
                ("dspark_n_routed_experts",), args.dspark_n_routed_experts, 1, "routed experts per rank, DSpark stages"
            )
        )
    return reqs


def runnable_tps(args: ModelArgs) -> list[int]:
    """Every tp the model can run (ascending); 1 always is."""
    reqs = tp_requirements(args)
    bound = math.gcd(*(r.value for r in reqs))
    return [tp for tp in range(1, bound + 1) if all(r.holds(tp) for r in reqs)]


def _listed(tps: list[int]) -> str:
    shown = ", ".join(map(str, tps[:MAX_LISTED]))
    return shown + (f", ... ({len(tps)} values)" if len(tps) > MAX_LISTED else "") if tps else "none"


def tp_problems(args: ModelArgs, tp: int) -> list[str]:
    """One line per requirement that `tp` breaks: the config keys, their value, the tp values that would work."""
    return [r.problem(tp) for r in tp_requirements(args) if not r.holds(tp)]


def check_tp(args: ModelArgs, tp: int, where: str) -> None:
    """Raise PlanError listing every requirement `tp` breaks, and the tp values this model can run.

    where: the config or folder the message names
    """
    if tp < 1:
        raise PlanError(f"{where}: tp {tp} must be at least 1")
    problems = tp_problems(args, tp)
    if problems:
        raise PlanError(
            f"{where}: the model cannot run at tp {tp} (every per-rank shape must divide); "
            f"it can at tp {_listed(runnable_tps(args))}:\n  " + "\n  ".join(problems)
        )
