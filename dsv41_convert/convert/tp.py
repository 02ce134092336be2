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

import functools
import itertools
import math
import operator
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dsv41_convert.config import HF_NAMES, ModelArgs
from dsv41_convert.engram_buckets import is_prime
from dsv41_convert.errors import PlanError
from dsv41_convert.store.rank_names import rank_files_in

BLOCK = 32  # the fp8 weight block (quantization_config.weight_block_size) and the activation quant block
MAX_LISTED = 12  # tp values listed per requirement
# ints tried one by one at most (a few ms); past it the tp values come from the prime factors: a config value
# near 10**18 took a minute (vocab_size 10**18 at --tp 3: 55 s), a product of two near 2**40 hours (a helper's hunt)
LOOPED = 10**5
_SMALL_PRIMES = tuple(p for p in range(2, 1000) if is_prime(p))


@dataclass(frozen=True)
class TpRequirement:
    """The per-rank share of one model dimension, `value` / tp, must be whole and (at tp > 1) a multiple of `unit`."""

    keys: tuple[str, ...]  # ModelArgs fields whose product is `value`
    value: int
    unit: int  # 1: whole heads, groups, rows, experts; BLOCK: whole 32-blocks
    needs: str  # what a rank's shapes take from it
    parts: tuple[int, ...] = ()  # the values of `keys`, whose product is `value`, factored one by one (() for value)

    def holds(self, tp: int) -> bool:
        # tp 1 cuts nothing, so a partial last block is no problem there
        return self.value % tp == 0 and (tp == 1 or (self.value // tp) % self.unit == 0)

    def working_tps(self) -> list[int]:
        """Every tp at which this holds, ascending: divisors of `value`, found in pairs up to its square root (one
        by one up to the value, a typo of 10**9 experts took minutes before a wrong tp was said); of a larger
        value, from its prime factors."""
        if math.isqrt(self.value) > LOOPED:
            factors = self._share_factors()
            return _divisors_up_to(factors, None) if factors is not None else [1]
        small = [d for d in range(1, math.isqrt(self.value) + 1) if self.value % d == 0]
        return [d for d in sorted({*small, *(self.value // d for d in small)}) if self.holds(d)]

    def _share_factors(self) -> Counter[int] | None:
        """The prime factors of value / unit, whose divisors are the tps at which this holds (tp 1 among them);
        None where unit does not divide value (then only tp 1 holds)."""
        factors = _prime_factors(self.parts or (self.value,))
        factors.subtract(_prime_factors((self.unit,)))
        return None if any(e < 0 for e in factors.values()) else +factors

    def _working_listed(self) -> str:
        """working_tps as _listed says it, without listing every one of a value of millions of divisors."""
        if math.isqrt(self.value) <= LOOPED:
            return _listed(self.working_tps())
        factors = self._share_factors()
        if factors is None:
            return _listed([1])
        return _listed(_smallest_divisors(factors, MAX_LISTED), math.prod(e + 1 for e in factors.values()))

    def problem(self, tp: int) -> str:
        """`o_groups = 8: wo_a output groups per rank; 8 / 16 is not whole; works at tp 1, 2, 4, 8`."""
        names = " x ".join(f"{k} ({HF_NAMES[k]})" if HF_NAMES.get(k, f"text_config.{k}") != f"text_config.{k}" else k
                           for k in self.keys)  # fmt: skip
        if self.unit == 1:
            why = f"{self.value} / {tp} is not whole"
        else:
            why = f"{self.value} / {tp} = {self.value / tp:g} is not a multiple of {self.unit}"
        return f"{names} = {self.value}: {self.needs}; {why}; works at tp {self._working_listed()}"


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
            (args.o_groups, args.o_lora_rank),
        ),
        TpRequirement(
            ("n_heads", "head_dim"),
            args.n_heads * args.head_dim,
            BLOCK,
            "wq_b rows per rank, in whole 32-row scale blocks",
            (args.n_heads, args.head_dim),
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
                (args.index_n_heads, args.index_head_dim),
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
    if bound > LOOPED:  # every requirement holds at the divisors of the gcd of their per-rank shares
        shares = [r._share_factors() for r in reqs]
        if any(f is None for f in shares):
            return [1]
        return _divisors_up_to(functools.reduce(operator.and_, shares), None)  # & of factors: those of the gcd
    return [tp for tp in range(1, bound + 1) if all(r.holds(tp) for r in reqs)]


def _listed(tps: list[int], total: int | None = None) -> str:
    """The first MAX_LISTED of `tps` and how many there are (`total`: of which tps are the first)."""
    total = len(tps) if total is None else total
    shown = ", ".join(map(str, tps[:MAX_LISTED]))
    return shown + (f", ... ({total} values)" if total > MAX_LISTED else "") if tps else "none"


def _prime_factors(values: Iterable[int]) -> Counter[int]:
    """The prime factors of the product of `values` (positive ints), each value factored on its own: small
    primes by trial, the rest by Pollard's rho (ms for a value below 2**63; a product of two, past 2**120,
    might take hours at once)."""
    factors: Counter[int] = Counter()
    for value in values:
        for p in _SMALL_PRIMES:
            while value % p == 0:
                factors[p] += 1
                value //= p
        left = [value] if value > 1 else []
        while left:
            n = left.pop()
            if is_prime(n):
                factors[n] += 1
            else:
                d = _rho(n)
                left += [d, n // d]
    return factors


def _rho(n: int) -> int:
    """A factor of the odd composite `n` other than 1 and n (Pollard's rho, Brent's cycle finding)."""
    for c in itertools.count(1):
        y, r, q, g, x, ys = 2, 1, 1, 1, 2, 2
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(128, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += 128
            r *= 2
        if g == n:  # the batch overshot: step it again one by one
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise AssertionError("unreachable")


def _divisors_up_to(factors: Counter[int], most: int | None) -> list[int]:
    """The divisors of the number of these prime factors, ascending, those up to `most` only (None: all)."""
    found = [1]
    for p, e in sorted(factors.items()):
        found = [d * p**k for d in found for k in range(e + 1) if most is None or d * p**k <= most]
    return sorted(found)


def _smallest_divisors(factors: Counter[int], count: int) -> list[int]:
    """The `count` smallest divisors of the number of these prime factors (all, if it has fewer), found below a
    bound doubled until they are there: never every divisor of a number of millions."""
    total, most = math.prod(e + 1 for e in factors.values()), 2
    while len(found := _divisors_up_to(factors, most)) < min(count, total):
        most *= 2
    return found[:count]


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
