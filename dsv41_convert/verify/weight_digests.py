"""The sha256 of every weight a reference ran, recorded in its file, and CONVERTED's rank files against them.

A reference of converted weights (`reference-logits SRC --tp N` of an fp8 source, or --as-converted) runs
the rank files `shard SRC --tp N` writes, computed in memory. Their tensors' sha256 go into the file's
provenance (`weights`, one {name: sha256} per rank), so that `verify --reference-logits FILE` compares
every weight of CONVERTED with them, whether a prompt reaches it or not: the rank files themselves at the
same tp; at another, their merge (convert.unshard, as the replay runs it) cut into the record's ranks. Without
SRC at hand this is the only check of a weight no prompt reaches (an expert no prompt routes to, an Engram
row no n-gram hashes to); a logits check cannot see it.

    weights = {"tp": N, "expert_dtype": "fp4" | "fp8", "ranks": [{name: sha256 hex}, ... N of them],
               "experts_as": {"expert_dtype": "fp8", "sha256": {name: sha256 hex}}}   (optional)

A conversion with another expert dtype than the record's (`shard --expert-dtype fp8` against a reference of
fp4 experts, the set for Hopper serving) has other expert bytes by design. `experts_as` records the routed
experts as that conversion holds them (the fp4 -> fp8 cast of each, weight and scale; an expert is whole on
one rank, so the digests hold at every tp), and the experts of such rank files are compared with it. A
record without it (an fp8-expert source, --no-weight-digests of older files) leaves them uncompared, and
the check says so.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.rules import Split, match_rule
from dsv41_convert.convert.tp import check_tp
from dsv41_convert.convert.unshard import MERGE_BLOCK, RankFiles, cut_sha256, piece_sha256
from dsv41_convert.errors import ConfigError, PlanError
from dsv41_convert.progress import Progress, Tally, counting
from dsv41_convert.store.file_digest import SHA256_HEX, hash_threads, sha256_of_blocks
from dsv41_convert.store.heap import reuse_freed_buffers
from dsv41_convert.store.threads import map_stoppable
from dsv41_convert.verify.source import whole_row_copy

T = TypeVar("T")
NOT_HELD, NOT_RECORDED = "not in the rank files", "not in the reference's record"  # compare's name failures

if TYPE_CHECKING:
    from dsv41_convert.convert.plan import OutTensor
    from dsv41_convert.verify.source import SourceWeights


def tensor_sha256(t: Tensor) -> str:
    """sha256 of a tensor's bytes, in its dtype (fp4 pairs and e8m0 scales as their raw bytes)."""
    raw = t.detach().contiguous().view(torch.uint8).reshape(-1)
    return hashlib.sha256(memoryview(raw.numpy())).hexdigest()


def digests(state: dict[str, Tensor]) -> dict[str, str]:
    """{name: tensor_sha256} of one rank's weights (file dtypes)."""
    return {name: tensor_sha256(t) for name, t in sorted(state.items())}


def of_source(
    weights: SourceWeights, progress: Progress | None = None, weights_as: SourceWeights | None = None
) -> tuple[dict[str, str], dict[str, str] | None]:
    """digests() of the tp-1 weights of a published (fp8) source that `weights` gives (reference_state's, as
    `shard SRC --tp 1` writes them), without holding them: several tensors at once, a copied one (experts,
    the Engram tables, embeddings: nearly all the bytes) hashed from its source bytes MERGE_BLOCK at a time,
    a computed one (wo_a's dequantization) whole. What `reference-logits --stream-layers` records: one more
    read of the whole source, for the weights no prompt reaches. progress("weights sha256", bytes, total).

    weights_as: the same source in the other expert dtype (SourceWeights(src, OTHER_EXPERTS[...])): each
                routed expert's weight is also computed so (of_experts_as) right after its own bytes were
                hashed, while they are in the page cache
    -> (the digests, the experts' digests in weights_as's dtype or None)"""
    reuse_freed_buffers()
    outputs: dict[str, list[OutTensor]] = {}
    for t in weights.plan.files[0].tensors:
        outputs.setdefault(t.group or t.name, []).append(t)
    tally = Tally(progress, "weights sha256", sum(t.end - t.begin for ts in outputs.values() for t in ts))
    as_other: dict[str, str] = {}

    def one(group: list[OutTensor], keep_going: Callable[[], None]) -> dict[str, str]:
        if len(group) == 1 and whole_row_copy(group[0]):
            found = {group[0].name: sha256_of_blocks(weights.copied_blocks(group[0], MERGE_BLOCK), keep_going)}
        else:
            keep_going()
            found = {n: tensor_sha256(t) for n, t in weights([t.name for t in group]).items()}
        if weights_as is not None and _routed_weight(group[0].name):
            as_other.update(expert_as(weights_as, group[0].name))
        tally.add(sum(t.end - t.begin for t in group))
        return found

    found: dict[str, str] = {}
    for part in _each(one, list(outputs.values())):
        found.update(part)
    return dict(sorted(found.items())), None if weights_as is None else dict(sorted(as_other.items()))


def record(ranks: list[dict[str, str]], expert_dtype: str, experts_as: dict[str, str] | None = None) -> dict[str, Any]:
    """The provenance entry `weights` for one digests() per rank; `experts_as`: of_experts_as()'s digests of the
    routed experts in the other expert dtype (OTHER_EXPERTS[expert_dtype])."""
    entry: dict[str, Any] = {"tp": len(ranks), "expert_dtype": expert_dtype, "ranks": ranks}
    if experts_as is not None:
        entry["experts_as"] = {"expert_dtype": OTHER_EXPERTS[expert_dtype], "sha256": experts_as}
    return entry


OTHER_EXPERTS = {"fp4": "fp8"}  # expert dtype of a reference -> the one `experts_as` records (fp8 -> fp4 is lossy)


def weights_as_other(src: Path, expert_dtype: str) -> SourceWeights | None:
    """SourceWeights of `src` with the routed experts in OTHER_EXPERTS[expert_dtype] (what `experts_as`
    records), None where there is no other; the caller closes it."""
    from dsv41_convert.verify.source import SourceWeights

    other = OTHER_EXPERTS.get(expert_dtype)
    return None if other is None else SourceWeights(src, other)


def of_experts_as(weights_as: SourceWeights, progress: Progress | None = None) -> dict[str, str]:
    """{name: sha256} of every routed expert's weight and scale as `weights_as` (SourceWeights(src,
    expert_dtype)) computes them: `shard SRC --expert-dtype X`'s bytes of each, several experts at once.
    progress("routed experts as X", expert weights done (w1, w2, w3 each), of all) counting."""
    reuse_freed_buffers()
    names = [t.name for t in weights_as.plan.files[0].tensors if _routed_weight(t.name)]
    tally = Tally(progress, counting(f"routed experts as {weights_as.plan.expert_dtype}", "weights"), len(names))

    def one(name: str, keep_going: Callable[[], None]) -> dict[str, str]:
        keep_going()
        found = expert_as(weights_as, name)
        tally.add(1)
        return found

    found: dict[str, str] = {}
    for part in _each(one, names):
        found.update(part)
    return dict(sorted(found.items()))


def expert_as(weights_as: SourceWeights, weight: str) -> dict[str, str]:
    """{name: sha256} of one routed expert's weight and scale as `weights_as` computes them."""
    scale = weight.removesuffix(".weight") + ".scale"
    return {n: tensor_sha256(t) for n, t in weights_as([weight, scale]).items()}


def problems(weights: Any, model: Any = None) -> list[str]:
    """What is wrong with a recorded `weights` entry (reffile's validation), [] when nothing. `model`: the
    file's provenance.model (the inference config), which the record must fit: its expert dtype, and a tp
    the model runs at. A record that breaks them was edited or damaged: verify refused nothing and blamed
    CONVERTED (a tp of 0 crashed it; an expert dtype edited to fp8 switched the experts' comparison off)."""
    shape = ['metadata provenance.weights must be {"tp", "expert_dtype", "ranks": [{name: sha256}]}']
    if not isinstance(weights, dict):
        return shape
    tp, ranks = weights.get("tp"), weights.get("ranks")
    if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1 and isinstance(ranks, list)):
        return shape
    if weights.get("expert_dtype") not in ("fp4", "fp8") or len(ranks) != tp:
        return shape
    if not all(
        isinstance(r, dict) and all(isinstance(v, str) and SHA256_HEX.fullmatch(v) for v in r.values()) for r in ranks
    ):
        return ["metadata provenance.weights: every digest must be 64 lowercase hex digits (sha256)"]
    if "experts_as" in weights:
        wrong = _experts_as_problems(weights["experts_as"], weights["expert_dtype"])
        if wrong:
            return [wrong]
    if not isinstance(model, dict):
        return []
    out = []
    ran = "fp8" if model.get("expert_dtype") == "fp8" else "fp4"
    if weights["expert_dtype"] != ran:
        out.append(
            f"metadata provenance.weights.expert_dtype {weights['expert_dtype']!r}, but the model it ran "
            f"(provenance.model.expert_dtype) stores its experts as {ran}"
        )
    try:
        check_tp(ModelArgs.from_inference_dict(model), tp, "metadata provenance.weights")
    except (ConfigError, PlanError, TypeError, ValueError) as exc:
        out.append(f"metadata provenance.weights.tp {tp}: {str(exc).splitlines()[0]}")
    return out


def _experts_as_problems(entry: Any, expert_dtype: str) -> str | None:
    """What is wrong with a record's `experts_as`, None when nothing."""
    want = OTHER_EXPERTS.get(expert_dtype)
    if not (isinstance(entry, dict) and entry.get("expert_dtype") == want and isinstance(entry.get("sha256"), dict)):
        return (
            f'metadata provenance.weights.experts_as must be {{"expert_dtype": {want!r}, "sha256": {{name: sha256}}}} '
            f"beside experts stored as {expert_dtype}"
        )
    digests = entry["sha256"]
    if not all(isinstance(v, str) and SHA256_HEX.fullmatch(v) for v in digests.values()):
        return "metadata provenance.weights.experts_as: every digest must be 64 lowercase hex digits (sha256)"
    strays = sorted(n for n in digests if not _routed(n))
    if strays:
        return f"metadata provenance.weights.experts_as holds {strays[0]}, which is not a routed expert's tensor"
    return None


def compare(weights: dict[str, Any], ranks: RankFiles, progress: Progress | None = None) -> tuple[list[str], str]:
    """CONVERTED's rank files against a recorded `weights`: at the record's tp the files as they are, at
    another the pieces a tp-N conversion would hold, cut from their merge (unshard.cut_sha256).
    -> (failures, a note saying what was compared). Raises ShardConsistencyError where they do not merge.
    progress("weights sha256", bytes of the rank files read, their total) as tensors are done."""
    reuse_freed_buffers()
    expert_dtype = experts_stored_as(ranks)
    skip_experts = expert_dtype not in (None, weights["expert_dtype"])  # compared with experts_as, or not at all
    as_other = _experts_as(weights, expert_dtype) if skip_experts else None
    names = [n for n in ranks.names() if not (skip_experts and _routed(n))]
    experts = [n for n in ranks.names() if _routed(n)] if as_other is not None else []
    held = {n: [r for r, h in enumerate(ranks.headers) if n in h.tensors] for n in names + experts}
    total = sum(ranks.headers[r].tensors[n].nbytes for n in names + experts for r in held[n])
    tally = Tally(progress, "weights sha256", total)
    if weights["tp"] == ranks.tp:  # every piece as it lies in its file
        found = [{} for _ in range(ranks.tp)]
        for (r, n), digest in _pieces_sha256(ranks, names, held, tally):
            found[r][n] = digest
        what = f"each rank file against the reference's tp-{ranks.tp} record"
    else:  # cut from the merge a block at a time: no merged tensor is ever whole in memory
        tp = weights["tp"]

        def cut(name: str, keep_going: Callable[[], None]) -> list[str | None]:
            digests = cut_sha256(ranks, name, tp, keep_going)
            tally.add(sum(ranks.headers[r].tensors[name].nbytes for r in held[name]))
            return digests

        cuts = dict(zip(names, _each(cut, names), strict=True))
        found = [{n: c[r] for n, c in cuts.items() if c[r] is not None} for r in range(tp)]
        what = (
            f"the tp-{ranks.tp} rank files merged to tp 1, a block at a time, against the reference's tp-1 record"
            if tp == 1
            else f"the tp-{ranks.tp} rank files cut to tp {tp} from their merge, a block at a time, against the "
            f"reference's tp-{tp} record"
        )
    failures = []
    ours = weights["tp"] == ranks.tp  # at another tp the rank is the record's, not a file of CONVERTED's
    for r, (want, got) in enumerate(zip(weights["ranks"], found, strict=True)):
        want = {n: d for n, d in want.items() if not (skip_experts and _routed(n))}
        where = "" if weights["tp"] == 1 else f" on rank {r}" if ours else f" in tp-{weights['tp']} rank {r}"
        failures += [f"{n}{where}: {NOT_HELD}" for n in sorted(want.keys() - got.keys())]
        failures += [f"{n}{where}: {NOT_RECORDED}" for n in sorted(got.keys() - want.keys())]
        failures += [
            f"{n}{where}{'' if ours else _only_holder(ranks, held.get(n, []))}: sha256 {got[n][:12]}..., "
            f"the reference's weights {want[n][:12]}..."
            for n in sorted(want.keys() & got.keys())
            if want[n] != got[n]
        ]
    if as_other is not None:
        failures += _compare_experts(as_other, ranks, experts, held, tally)
        what += f"; routed experts as {expert_dtype}, against the reference's record of them converted so"
    elif skip_experts:
        what += f"; routed experts not compared ({expert_dtype} here, {weights['expert_dtype']} in the reference)"
    return failures, what


def _pieces_sha256(
    ranks: RankFiles, names: list[str], held: dict[str, list[int]], tally: Tally
) -> list[tuple[tuple[int, str], str]]:
    """[((rank, name), sha256 of that rank file's piece as it lies there)] for each of `names` on each rank
    that holds it (`held`), several at once."""
    pieces = [(r, n) for n in names for r in held[n]]

    def piece(item: tuple[int, str], keep_going: Callable[[], None]) -> str:
        info = ranks.headers[item[0]].tensors[item[1]]
        digest = piece_sha256(ranks, item[0], info, keep_going)
        tally.add(info.nbytes)
        return digest

    return list(zip(pieces, _each(piece, pieces), strict=True))


def _experts_as(weights: dict[str, Any], expert_dtype: str | None) -> dict[str, str] | None:
    """The record's digests of the routed experts stored as `expert_dtype`, None where it has none."""
    entry = weights.get("experts_as")
    return entry["sha256"] if entry is not None and entry["expert_dtype"] == expert_dtype else None


def _compare_experts(
    want: dict[str, str], ranks: RankFiles, names: list[str], held: dict[str, list[int]], tally: Tally
) -> list[str]:
    """The routed experts of the rank files (each whole in one file, at every tp) against `want`."""
    got: dict[str, str] = {}
    failures = []
    for (_, n), digest in _pieces_sha256(ranks, names, held, tally):
        if n in got:  # a routed expert is whole on one rank; a second copy is no conversion's
            failures.append(f"{n}: in more than one rank file")
        got[n] = digest
    failures += [f"{n}: {NOT_HELD}" for n in sorted(want.keys() - got.keys())]
    failures += [f"{n}: {NOT_RECORDED}" for n in sorted(got.keys() - want.keys())]
    failures += [
        f"{n}{_only_holder(ranks, held[n])}: sha256 {got[n][:12]}..., the reference's weights {want[n][:12]}..."
        for n in sorted(want.keys() & got.keys())
        if want[n] != got[n]
    ]
    return failures


def _only_holder(ranks: RankFiles, holders: list[int]) -> str:
    """ " (in model3-mp8.safetensors)" where one rank file holds the tensor (a routed expert), so a difference
    found in the merge is that file's; "" where several hold pieces of it."""
    return f" (in {Path(ranks.headers[holders[0]].path).name})" if len(holders) == 1 and ranks.tp > 1 else ""


def compares_every_weight(weights: dict[str, Any], ranks: RankFiles) -> bool:
    """Whether `compare` compares every tensor: not where the rank files store the routed experts in
    another dtype than the record's (`shard --expert-dtype fp8` against an fp4 reference) and the record
    has no `experts_as` of that dtype: it skips them."""
    stored = experts_stored_as(ranks)
    return stored in (None, weights["expert_dtype"]) or _experts_as(weights, stored) is not None


def experts_stored_as(ranks: RankFiles) -> str | None:
    """ "fp8" or "fp4": how the rank files store the routed experts (the model reads it from the dtype, as
    the config does not say it), None without any."""
    for header in ranks.headers:
        for name, info in header.tensors.items():
            if name.endswith(".weight") and _routed(name):
                return "fp8" if info.dtype == "F8_E4M3" else "fp4"
    return None


def _routed(name: str) -> bool:
    """A routed expert's tensor (the rule table's EXPERT split), not the shared expert's."""
    return match_rule(name).split is Split.EXPERT


def _routed_weight(name: str) -> bool:
    """A routed expert's weight (its scale is computed with it)."""
    return name.endswith(".weight") and _routed(name)


def _each(fn: Callable[[Any, Callable[[], None]], T], items: list) -> list[T]:
    """[fn(item, keep_going) for item in items], several at once (store.threads)."""
    return map_stoppable(fn, items, hash_threads(len(items)), "weights")
