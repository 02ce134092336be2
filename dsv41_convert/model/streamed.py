"""Layer-streamed execution of the bundled model at tp 1: one unit of weights in memory at a time.

Units, in order: `vision` (vision.*, aligner.*; only when a prompt has an image), `embed` (embed,
image_*), `layers.0` .. `layers.{n-1}`, `mtp.0` .. `mtp.{K-1}`, `head` (norm, head, and the last DSpark
stage's norm / markov_head / confidence_head). Each unit is built, filled from a WeightProvider, run
over every prompt and every step (the prefill, then each decode step), and dropped before the next.
What passes between units stays in memory: per prompt and step the hc stream [1, s, hc, dim], its
collapse weights, the DSpark target inputs and the attention runtime (compressed KV, index keys, top-k
choice, candidates) that later layers read.

The decode tokens are fixed before the run (`decode_ids`), as verify's teacher forcing feeds them, so
the result is bit-identical to `verify.runner.run_prompt(whole_model, ..., teacher=decode_ids)` on the
same device: every unit does the same operations on the same inputs in the same order, only the weights
arrive later. Each unit's caches are kept per prompt between passes and restored, so every prompt's
steps see the caches the whole model would.

One pass over the units per step (the prefill of every prompt, then each decode step), not one pass for
all steps: the attention runtime is shared across steps as upstream's is. At a decode step where a
ratio-2 KV source's group is still incomplete it publishes no new index keys, and its indexer reads the
keys published last, which are a later layer's (layer 20's in V4.1-Flash, layer 3's in the tiny preset)
from the previous step. A layer-major single pass would not have them yet. The runtime left by the last
layer at step t is what step t + 1 starts from, as in the whole model.

Two kinds of weights are read lazily, never whole:
- routed experts: empty placeholders (no memory) until the router first sends a token to them; a
  forward hook on the gate then reads every newly picked expert of the unit at once;
- Engram tables: only the rows the prompts' n-gram hashes touch (known before the pass), packed into
  a small table whose row ids replace the hashes of that layer.

Each unit is built (modules with empty weights) before its weights arrive, then bound to them
(load.bind_tensors: the read tensors become the parameters, no copy). On CUDA the next unit is built
and its weights read and copied to the GPU while the current one computes (stream_feed.CudaFeed); on
the CPU a unit's weights are read when it starts (stream_feed.HostFeed).

Legend: P prompts, J steps per prompt (1 + decode steps), S prompt length, K draft block.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from dsv41_convert import interrupts
from dsv41_convert.errors import VerifyInputError
from dsv41_convert.model import parallel
from dsv41_convert.model.block import Block, make_identity_pre_mix
from dsv41_convert.model.head import ParallelHead
from dsv41_convert.model.layers import ParallelEmbedding, RMSNorm, dense_dtype
from dsv41_convert.model.load import bind_tensors, expected_tensors
from dsv41_convert.model.runtime import SharedAttentionRuntime
from dsv41_convert.model.stream_feed import CudaFeed, HostFeed, nbytes
from dsv41_convert.model.stream_records import StreamPrompt, StreamResult, UnitTiming, WeightProvider
from dsv41_convert.model.transformer import (
    block_step,
    capture_block,
    capture_embedding,
    merge_image_spans,
    to_streams,
)
from dsv41_convert.progress import counting
from dsv41_convert.store.heap import release_freed_memory

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs
    from dsv41_convert.progress import Progress

RUNTIME_FIELDS = ("compress_kv", "index_k", "topk_idxs", "candidates")
DRAFT_HEAD_PARTS = ("norm.", "markov_head.", "confidence_head.")  # of the last stage, run by the head unit


@dataclass
class _Step:
    """What one (prompt, step) carries from unit to unit."""

    ids: Tensor  # [1, s] int64
    start_pos: int
    image_mask: Tensor | None = None
    engram_mask: Tensor | None = None
    hashes: Tensor | None = None  # [1, s, G, C] int64
    h: Tensor | None = None
    pre_mix: Tensor | None = None
    runtime: tuple = (None, None, None, None)
    targets: list[Tensor] = field(default_factory=list)
    draft_id: Tensor | None = None  # [1] int64
    main_x: Tensor | None = None
    draft_h: Tensor | None = None
    draft_pre: Tensor | None = None


class _DraftHeads(nn.Module):
    """The last DSpark stage's output heads (mtp.draft_outputs reads these attributes)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        from dsv41_convert.model.mtp import DSparkConfidenceHead, DSparkMarkovHead

        self.block_size = args.dspark_block_size
        self.temperature = args.temperature
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.markov_head = DSparkMarkovHead(args.vocab_size, args.dspark_markov_rank)
        self.confidence_head = DSparkConfidenceHead(args.dim + args.dspark_markov_rank)


_Part = tuple[nn.Module, str, frozenset[str]]  # a module, its provider prefix, the names it reads later


@dataclass
class _Unit:
    """A unit built before its weights arrive: its modules (the first one is the unit's root), and per
    provider name the bytes it will hold (what the feed reads; the deferred names are read later)."""

    key: tuple[int, str]  # (pass, unit name)
    parts: list[_Part]
    sizes: dict[str, int]

    @property
    def root(self) -> nn.Module:
        return self.parts[0][0]

    def param_bytes(self) -> int:
        """Bytes of the parameters the unit holds now (a tied parameter once)."""
        params = {id(p): p for module, _, _ in self.parts for p in module.parameters()}
        return nbytes(params)


class _Runner:
    """One pass over the units per step (the prefill of every prompt, then each decode step): the module
    docstring says why a pass cannot hold several steps and stay exact."""

    def __init__(self, args, provider, prompts, tokenizer, capture_hidden, device, progress):
        if parallel.is_distributed():
            raise VerifyInputError("the streamed model runs at tp 1, outside a process group")
        shortest = min(p.input_ids.numel() for p in prompts)
        ratio = max(args.compress_ratios[: args.n_layers], default=0)
        if shortest < ratio:
            # its prefill would publish no index keys and read the previous prompt's (not streamable)
            raise VerifyInputError(f"a {shortest}-token prompt: streaming needs {ratio} (the largest compress ratio)")
        self.args, self.provider, self.device = args, provider, device
        # on CUDA the next unit's weights are read and copied while this one computes (stream_feed.py)
        self.feed = CudaFeed(provider, device) if torch.device(device).type == "cuda" else HostFeed(provider)
        self.built: dict[tuple[int, str], _Unit] = {}  # the unit read ahead, built before its weights
        self.capture = capture_hidden
        self.progress = progress
        self.timings: dict[str, UnitTiming] = {}
        self.runtime = SharedAttentionRuntime()
        self.prompts = prompts
        self.steps = [self._steps(p) for p in prompts]
        self.hidden: list[dict[str, Tensor]] = [{} for _ in prompts]
        self.buffers: dict[tuple[str, int], dict[str, Tensor]] = {}  # (unit, prompt) -> its caches between passes
        self.layout = None
        self.engram_ids: dict[int, Tensor] = {}
        # no drafts without stages, whatever dspark_block_size says (as verify.runner.draft_block): a model without
        # DSpark stages was refused, "the model wants mtp.-1.norm.weight"
        has_stages = args.n_mtp_layers > 0 and args.dspark_block_size > 0
        self.drafts = has_stages and any(len(p.decode_ids) > 1 for p in prompts)
        self.logits: list[dict[str, list[Tensor]]] = [{"dec": [], "draft": [], "conf": []} for _ in prompts]
        if args.engram_layer_ids:
            self._hash(tokenizer)

    def _steps(self, p: StreamPrompt) -> list[_Step]:
        dev = self.device
        first = _Step(p.input_ids.to(dev)[None], 0)
        if p.token_types is not None:
            first.image_mask = p.token_types.to(dev)[None] >= 0
            first.engram_mask = ~first.image_mask
        seq = p.input_ids.numel()
        steps = [first] + [_Step(p.decode_ids[t].view(1, 1).to(dev), seq + t) for t in range(len(p.decode_ids) - 1)]
        for j, step in enumerate(steps):
            step.draft_id = p.decode_ids[j].view(1).to(dev)
        return steps

    @torch.inference_mode()
    def _hash(self, tokenizer) -> None:
        """Every step's Engram rows, in the whole model's order (the hash history is per position)."""
        from dsv41_convert.model.engram_hash import EngramLayout, NgramHashState

        self.layout = EngramLayout.from_args(self.args)
        hasher = NgramHashState(self.args, self.layout, tokenizer).to(self.device)
        for steps in self.steps:
            for step in steps:
                step.hashes = hasher(step.ids, step.start_pos, step.engram_mask)

    # --- weights ---

    def _unit_of(self, key: tuple[int, str], parts: list[tuple[nn.Module, str, frozenset[str]]]) -> _Unit:
        names = {}
        for module, prefix, deferred in parts:
            names.update({prefix + n: p.numel() * p.element_size()
                          for n, (p, _) in expected_tensors(module).items() if n not in deferred})  # fmt: skip
        return _Unit(key, parts, names)

    def _bind(self, unit: _Unit, timing: UnitTiming) -> None:
        """Fill the unit's modules with its weights (read ahead on CUDA) and move them to the device."""
        got = self.feed.take(f"{unit.key[0]}:{unit.key[1]}", unit.sizes, timing)
        for module, prefix, deferred in unit.parts:
            mine = {n: got[prefix + n] for n in expected_tensors(module) if n not in deferred}
            bind_tensors(module, mine, f"{prefix or 'unit'} weights", "", deferred)
            if self.device != "cpu":
                module.to(self.device)  # the buffers (caches) and the unread experts' empty placeholders

    def _lazy_experts(self, moe: nn.Module, prefix: str, timing: UnitTiming) -> frozenset[str]:
        """Leave the routed experts unread (empty placeholders) until the router first picks them, then
        read every newly picked one at once; -> the deferred module names."""
        experts: dict[int, tuple[nn.Module, dict[str, torch.Size]]] = {}
        for e, expert in enumerate(moe.experts):
            if expert is None:
                continue
            shapes = {}
            for n, (p, _) in expected_tensors(expert).items():
                shapes[n] = p.shape
                p.data = torch.empty(0, dtype=p.dtype)  # holds nothing until read
            experts[e] = (expert, shapes)
        moe.gate.register_forward_hook(self._expert_loader(prefix, experts, timing))
        return frozenset(f"ffn.experts.{e}.{n}" for e, (_, shapes) in experts.items() for n in shapes)

    def _expert_loader(self, prefix: str, experts: dict, timing: UnitTiming):
        loaded: set[int] = set()

        def load(_gate, _inputs, out: tuple[Tensor, Tensor]) -> None:
            picked = sorted(set(out[1].unique().tolist()) & (experts.keys() - loaded))
            if not picked:
                return
            names = [f"{prefix}ffn.experts.{e}.{n}" for e in picked for n in experts[e][1]]
            got = self.feed.now(names, timing)
            for e in picked:
                expert, shapes = experts[e]
                at = f"{prefix}ffn.experts.{e}."
                mine = {n: got[at + n] for n in shapes}
                bind_tensors(expert, mine, f"{at.rstrip('.')} weights", shapes=shapes)
            timing.experts_read += len(picked)
            loaded.update(picked)

        return load

    # --- state between units and passes ---

    def _restore(self, step: _Step) -> None:
        for name, value in zip(RUNTIME_FIELDS, step.runtime, strict=True):
            setattr(self.runtime, name, value)

    def _save(self, step: _Step) -> None:
        """Keep the runtime as it is after this unit; buffers a unit owns are cloned (later steps write them)."""
        saved = []
        for name, before in zip(RUNTIME_FIELDS, step.runtime, strict=True):
            now = getattr(self.runtime, name)
            saved.append(now if now is before or now is None else now.clone())
        step.runtime = tuple(saved)

    def _swap_in(self, unit: nn.Module, name: str, p: int) -> None:
        saved = self.buffers.get((name, p))
        if saved is not None:
            for key, buf in unit.named_buffers():
                buf.copy_(saved[key])

    def _swap_out(self, unit: nn.Module, name: str, p: int, s: int) -> None:
        """Caches (KV, compressor, indexer) of this prompt, kept for its next step's pass."""
        if s + 1 < len(self.steps[p]):
            self.buffers[(name, p)] = {key: buf.clone() for key, buf in unit.named_buffers()}
        else:
            self.buffers.pop((name, p), None)

    # --- the passes ---

    def run(self) -> tuple[list[StreamResult], list[UnitTiming]]:
        n_steps = max(len(s) for s in self.steps)
        units = self._unit_names()
        order = [(s, n) for s in range(n_steps) for n in units if n != "vision" or s == 0]
        try:
            for s in range(n_steps):
                if s > 0:  # a step starts from the runtime its previous step left after the last unit
                    for steps in self.steps:
                        if s < len(steps):
                            steps[s].runtime = steps[s - 1].runtime
                label = counting(f"pass {s + 1}/{n_steps} ({'prefill' if s == 0 else f'decode step {s}'})", "units")
                for u, name in enumerate(units):
                    interrupts.check()  # Ctrl-C or SIGTERM postponed by an import (interrupts.py)
                    if self.progress is not None:
                        self.progress(label, u, len(units))
                    if name != "vision" or s == 0:
                        k = order.index((s, name))
                        self._unit(name, s, order[k + 1] if k + 1 < len(order) else None)
                if self.progress is not None:
                    self.progress(label, len(units), len(units))
        finally:
            self.feed.close()
        return self._results(), list(self.timings.values())

    def _unit_names(self) -> list[str]:
        names = ["vision"] if any(p.images for p in self.prompts) else []
        names.append("embed")
        names += [f"layers.{i}" for i in range(self.args.n_layers)]
        if self.drafts:
            names += [f"mtp.{k}" for k in range(self.args.n_mtp_layers)]
        return [*names, "head"]

    def _build(self, s: int, name: str) -> _Unit:
        """The unit's modules with their weights still to come (see _Unit)."""
        timing = self.timings.setdefault(name, UnitTiming(name))
        kind, _, index = name.partition(".")
        parts = getattr(self, f"_build_{kind}")(timing, s, *((int(index),) if index else ()))
        return self._unit_of((s, name), parts)

    def _unit(self, name: str, s: int, following: tuple[int, str] | None) -> None:
        timing = self.timings.setdefault(name, UnitTiming(name))
        work = [(p, steps[s]) for p, steps in enumerate(self.steps) if s < len(steps)]
        t0, wait0 = time.perf_counter(), timing.wait_s
        with torch.inference_mode():
            unit = self.built.pop((s, name), None) or self._build(s, name)
            self._bind(unit, timing)
            if following is not None and self.feed.reads_ahead:
                nxt = self._build(*following)
                self.built[following] = nxt
                self.feed.ahead(f"{following[0]}:{following[1]}", nxt.sizes)
            kind, _, index = name.partition(".")
            getattr(self, f"_{kind}")(unit, timing, s, work, *((int(index),) if index else ()))
            timing.param_bytes = max(timing.param_bytes, unit.param_bytes())
        del unit
        # weights up to glibc's mmap threshold (which grows to 32 MiB once such a block is freed) live on the
        # heap: without a trim a full-size run's RSS grew by ~0.1 GiB per unit (measured: 5.8 GiB before the head)
        release_freed_memory()
        spent = time.perf_counter() - t0
        timing.compute_s += spent - (timing.wait_s - wait0)

    def _build_vision(self, timing: UnitTiming, s: int) -> list[_Part]:
        from dsv41_convert.model.vision import Aligner, ViT

        unit = nn.Module()
        with dense_dtype(self.args):
            unit.vision, unit.aligner = ViT(self.args), Aligner(self.args)
        return [(unit, "", frozenset())]

    def _vision(self, built: _Unit, timing: UnitTiming, s: int, work) -> None:
        from dsv41_convert.model.vision import encode_image

        unit = built.root
        self.image_embeds = {
            p: [encode_image(unit.vision, unit.aligner, i.patches.to(self.device), i.n_vit_h, i.n_vit_w)
                for i in self.prompts[p].images or ()]
            for p, _ in work
        }  # fmt: skip

    def _build_embed(self, timing: UnitTiming, s: int) -> list[_Part]:
        args = self.args
        unit = nn.Module()
        with dense_dtype(args):
            unit.embed = ParallelEmbedding(args.vocab_size, args.dim)
            if args.vision_enabled:
                for name in ("image_start", "image_end", "image_newline"):
                    setattr(unit, name, nn.Parameter(torch.empty(args.dim, dtype=torch.bfloat16)))
        return [(unit, "", frozenset())]

    def _embed(self, built: _Unit, timing: UnitTiming, s: int, work) -> None:
        args, unit = self.args, built.root
        for p, step in work:
            h = unit.embed(step.ids)
            if s == 0 and self.prompts[p].images:
                encoded = iter(self.image_embeds[p])
                merge_image_spans(unit, [self.prompts[p].images], h, lambda *_, it=encoded: next(it))
            if s == 0 and self.capture:
                capture_embedding(self.hidden[p], h, step.image_mask, args.vision_enabled)
            step.h, step.pre_mix = to_streams(h, args.hc_mult)
            if self.drafts:
                from dsv41_convert.model.mtp import embed_draft_block

                block, noise = args.dspark_block_size, args.dspark_noise_token_id
                step.draft_h = embed_draft_block(unit.embed, step.draft_id, block, noise, args.hc_mult)
                step.draft_pre = make_identity_pre_mix(step.draft_h, step.draft_h.size(2))

    def _engram_rows(self, block: Block, timing: UnitTiming, prefix: str, work) -> None:
        """Read the rows this pass's hashes touch into a packed table; renumber the hashes to match."""
        g = block.engram.layer_hash_index
        rows = torch.unique(torch.cat([step.hashes[..., g, :].flatten().cpu() for _, step in work]))
        names = [f"{prefix}engram.embed.weight", f"{prefix}engram.embed.scale"]
        t0 = time.perf_counter()
        got = self.provider.rows(names, rows)
        spent = time.perf_counter() - t0
        timing.read_s += spent
        timing.wait_s += spent
        timing.bytes_read += nbytes(got)
        emb = block.engram.embed
        emb.weight.data, emb.scale.data = got[names[0]].to(self.device), got[names[1]].to(self.device)
        emb.part_num_embeddings = emb.num_embeddings = rows.numel()
        for _, step in work:
            packed = step.hashes.clone()
            packed[..., g, :] = torch.searchsorted(rows.to(step.hashes.device), step.hashes[..., g, :].contiguous())
            self.engram_ids[id(step)] = packed

    def _build_layers(self, timing: UnitTiming, s: int, i: int) -> list[_Part]:
        args, prefix, layout = self.args, f"layers.{i}.", self.layout
        if layout is not None and i in layout.layer_ids:
            # an empty table here; _engram_rows fills it with the rows this pass reads
            counts = list(layout.num_embeddings)
            counts[layout.layer_ids.index(i)] = 0
            layout = dataclasses.replace(layout, num_embeddings=tuple(counts))
        with dense_dtype(args):
            block = Block(i, args, layout)
        block.attn.shared = self.runtime
        deferred = self._lazy_experts(block.ffn, prefix, timing)
        if block.engram is not None:
            deferred |= {"engram.embed.weight", "engram.embed.scale"}
        return [(block, prefix, deferred)]

    def _layers(self, built: _Unit, timing: UnitTiming, s: int, work, i: int) -> None:
        args, prefix, block = self.args, f"layers.{i}.", built.root
        self.engram_ids = {}
        if block.engram is not None:
            self._engram_rows(block, timing, prefix, work)
        last = i == args.n_layers - 1
        for p, step in work:
            self._swap_in(block, f"layers.{i}", p)
            self._restore(step)
            hooks = capture_block(block, f"layers.{i}", self.hidden[p]) if s == 0 and self.capture else []
            hashes = self.engram_ids.get(id(step), step.hashes)
            h, pre_mix, target = block_step(
                block, step.h, step.start_pos, step.pre_mix, step.image_mask, step.engram_mask, hashes
            )
            for hook in hooks:
                hook.remove()
            self._save(step)
            self._swap_out(block, f"layers.{i}", p, s)
            if i in args.dspark_target_layer_ids:
                step.targets.append(target)
            if s == 0 and self.capture:
                self.hidden[p][f"layers.{i}"] = h.clone()
                self.hidden[p][f"layers.{i}.pre_mix"] = pre_mix.clone()  # as Transformer.forward
            # after the last layer only the collapsed stream goes on (to the final norm)
            step.h, step.pre_mix = (block.hc_pre(h, pre_mix), None) if last else (h, pre_mix)

    def _build_mtp(self, timing: UnitTiming, s: int, k: int) -> list[_Part]:
        from dsv41_convert.model.mtp import DSparkBlock

        args, prefix = self.args, f"mtp.{k}."
        with dense_dtype(args):
            stage = DSparkBlock(args.n_layers + k, args)
        deferred = self._lazy_experts(stage.ffn, prefix, timing)
        if k == args.n_mtp_layers - 1:
            deferred |= {n for n in expected_tensors(stage) if n.startswith(DRAFT_HEAD_PARTS)}
        return [(stage, prefix, deferred)]

    def _mtp(self, built: _Unit, timing: UnitTiming, s: int, work, k: int) -> None:
        args, stage = self.args, built.root
        last = k == args.n_mtp_layers - 1
        for p, step in work:
            if len(self.steps[p]) == 1:
                continue  # no decode steps: the whole model never runs the drafts either
            self._swap_in(stage, f"mtp.{k}", p)
            if k == 0:
                step.main_x = stage.main_context(torch.cat(step.targets, dim=-1))
            step.draft_h, step.draft_pre = stage(step.draft_h, step.start_pos, step.draft_pre, step.main_x)
            if last and step.start_pos > 0:
                step.draft_h = stage.hc_pre(step.draft_h, step.draft_pre)
            self._swap_out(stage, f"mtp.{k}", p, s)

    def _build_head(self, timing: UnitTiming, s: int) -> list[_Part]:
        args = self.args
        unit = nn.Module()
        with dense_dtype(args):
            unit.norm = RMSNorm(args.dim, args.norm_eps)
            unit.head = ParallelHead(args.vocab_size, args.dim, args.norm_eps, args.hc_eps)
            if not (self.drafts and s > 0):
                return [(unit, "", frozenset())]
            drafts = _DraftHeads(args)
        return [(unit, "", frozenset()), (drafts, f"mtp.{args.n_mtp_layers - 1}.", frozenset())]

    def _head(self, built: _Unit, timing: UnitTiming, s: int, work) -> None:
        unit = built.root
        drafts = built.parts[1][0] if len(built.parts) > 1 else None
        if drafts is not None:
            drafts.head = unit.head
        for p, step in work:
            normed = unit.norm(step.h)
            out = self.logits[p]
            if s == 0:
                if self.capture:
                    self.hidden[p]["norm"] = normed.clone()
                out["all"] = unit.head(normed, full_logits=True)[0].float().cpu()
                out["last"] = unit.head(normed, full_logits=False)[0].float().cpu()
                continue
            out["dec"].append(unit.head(normed)[0].float().cpu())
            if drafts is not None:
                from dsv41_convert.model.mtp import draft_outputs

                _, logits, confidence = draft_outputs(drafts, step.draft_h, step.draft_id)
                out["draft"].append(logits[0].float().cpu())
                out["conf"].append(confidence[0].float().cpu())

    def _results(self) -> list[StreamResult]:
        results = []
        for p, out in enumerate(self.logits):
            vocab = out["all"].shape[-1]
            results.append(
                StreamResult(
                    logits_all=out["all"],
                    last=out["last"],
                    decode_logits=torch.stack(out["dec"]) if out["dec"] else torch.empty(0, vocab),
                    draft_logits=torch.stack(out["draft"]) if out["draft"] else None,
                    hidden={k: v[0].cpu() for k, v in self.hidden[p].items()},
                    draft_confidence=torch.stack(out["conf"]) if out["conf"] else None,
                )
            )
        return results


def run_streamed(
    args: ModelArgs,
    provider: WeightProvider,
    prompts: Sequence[StreamPrompt],
    tokenizer=None,
    capture_hidden: bool = False,
    device: str = "cpu",
    progress: Progress | None = None,
) -> tuple[list[StreamResult], list[UnitTiming]]:
    """Run `prompts` (prefill, the decode steps feeding decode_ids, the DSpark drafts) unit by unit.

    args: runtime ModelArgs (max_batch_size >= 1, max_seq_len, temperature 0 for the drafts' argmax);
    tokenizer: as Transformer takes it (Engram's token map); progress(pass label, units done, units in the pass),
    the label `counting` units.
    -> per prompt a StreamResult, per unit a UnitTiming (summed over the passes)
    """
    return _Runner(args, provider, list(prompts), tokenizer, capture_hidden, device, progress).run()
