"""The DeepSeek V4.1 text model: embed -> hc copies -> blocks -> collapse -> norm -> head.

Engram, vision and the DSpark MTP stages are built only when the config has them; their modules
(engram*.py, vision.py, image_processor.py, mtp.py) are imported only then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dsv41_convert import interrupts
from dsv41_convert.model.attention import Attention
from dsv41_convert.model.block import Block, make_identity_pre_mix
from dsv41_convert.model.head import ParallelHead, sample
from dsv41_convert.model.layers import ParallelEmbedding, RMSNorm, dense_dtype
from dsv41_convert.model.runtime import SharedAttentionRuntime

if TYPE_CHECKING:
    from dsv41_convert.config import ModelArgs


class Transformer(nn.Module):
    """DeepSeek V4.1. world_size/rank come from torch.distributed at construction (one model per
    process); the tokenizer is needed only by Engram's n-gram hashing.

    embed: [vocab / world, dim] bfloat16; norm: [dim] bfloat16; head: [vocab / world, dim] float32.
    """

    def __init__(self, args: ModelArgs, tokenizer=None):
        super().__init__()
        self.args = args
        self.max_seq_len = args.max_seq_len
        self.max_batch_size = args.max_batch_size
        self.temperature = args.temperature
        self.norm_eps = args.norm_eps
        self.hc_eps = args.hc_eps
        with dense_dtype(args):
            self.engram_layout = None
            self.engram_hash = None
            if args.engram_layer_ids:
                from dsv41_convert.model.engram_hash import EngramLayout, NgramHashState

                self.engram_layout = EngramLayout.from_args(args)
                self.engram_hash = NgramHashState(args, self.engram_layout, tokenizer)
            self.embed = ParallelEmbedding(args.vocab_size, args.dim)
            self.layers = nn.ModuleList(Block(i, args, self.engram_layout) for i in range(args.n_layers))
            self.norm = RMSNorm(args.dim, self.norm_eps)
            self.head = ParallelHead(args.vocab_size, args.dim, self.norm_eps, self.hc_eps)
            self.mtp = nn.ModuleList()
            self.target_layer_ids = tuple(args.dspark_target_layer_ids)
            if args.dspark_block_size:
                from dsv41_convert.model.mtp import DSparkBlock

                for k in range(args.n_mtp_layers):
                    self.mtp.append(DSparkBlock(args.n_layers + k, args))
                    # tied to the backbone: aliases in state_dict(), absent from the shards
                    self.mtp[-1].embed = self.embed
                    self.mtp[-1].head = self.head
            self.hc_mult = args.hc_mult
            self.vision = None
            if args.vision_enabled:
                from dsv41_convert.model.vision import Aligner, ViT

                self.vision = ViT(args)
                self.aligner = Aligner(args)
                # learned embeddings of the image span's delimiters
                self.image_start = nn.Parameter(torch.empty(args.dim, dtype=torch.bfloat16))
                self.image_end = nn.Parameter(torch.empty(args.dim, dtype=torch.bfloat16))
                self.image_newline = nn.Parameter(torch.empty(args.dim, dtype=torch.bfloat16))
        # one runtime per model, shared by its attention layers (the MTP stages' too)
        self.shared_attn = SharedAttentionRuntime()
        for module in self.modules():
            if isinstance(module, Attention):
                module.shared = self.shared_attn

    @torch.inference_mode()
    def encode_image(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """patches: [n_vit_h * n_vit_w, 3 * patch^2] -> [image tokens, dim] (ViT, then aligner)"""
        return self.aligner(self.vision(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)

    def merge_image_embeddings(self, images, h: torch.Tensor) -> None:
        """Write each image's span into h in place (see merge_image_spans), encoding each image here."""
        merge_image_spans(self, images, h, self.encode_image)

    def _check_inputs(self, input_ids: torch.Tensor, start_pos: int) -> None:
        bsz, seqlen = input_ids.shape
        if bsz > self.max_batch_size:
            raise ValueError(f"batch {bsz} exceeds max_batch_size {self.max_batch_size}")
        if start_pos + seqlen > self.max_seq_len:
            raise ValueError(f"positions up to {start_pos + seqlen} exceed max_seq_len {self.max_seq_len}")
        if start_pos > 0 and seqlen != 1:
            raise ValueError(f"decode (start_pos {start_pos} > 0) takes one token per step, got {seqlen}")

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int = 0,
        images=None,
        token_types: torch.Tensor | None = None,
        *,
        all_logits: bool = False,
        hidden_states: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Prefill (start_pos 0, the whole prompt) or one decode step (start_pos > 0, one token).

        input_ids:   [b, s] int64
        token_types: [b, s] int, -1 for text, >= 0 inside image spans (with `images`)
        all_logits:  logits of every position instead of the last
        hidden_states: if a dict, filled with this rank's per-module outputs (cloned):
            "vision" [b, s, dim] (a model with a vision tower: the image spans' rows, see image_rows),
            "embed" [b, s, dim], "layers.{i}.attn" / "layers.{i}.ffn" [b, s, dim],
            "layers.{i}" [b, s, hc, dim], "norm" [b, s, dim], all bfloat16; and what a block needs
            besides its input to be run on its own (verify.teacher): "layers.{i}.pre_mix" [b, s, hc]
            float32 (the collapse weights block i hands to block i + 1), "layers.{i}.engram"
            [b, s, hc, dim] bfloat16 (Engram layers), "layers.{i}.attn.indexer" [b, s, k] int64 (the
            top-k of an index source), "layers.{i}.attn.candidates" [b, s, t] int8 (the candidate source's
            kept blocks, 1 inside one)
        -> output_ids [b] (or [b, s]) int64, logits [b, vocab] (or [b, s, vocab]) float32,
           main_hidden [b, s, len(target_layer_ids) * dim] bfloat16 for the MTP stages, or None
        """
        self._check_inputs(input_ids, start_pos)
        hooks = self._capture(hidden_states) if hidden_states is not None else []
        try:
            image_mask = None if token_types is None else token_types >= 0
            # image tokens take no part in an n-gram and get no Engram contribution
            engram_mask = None if image_mask is None else ~image_mask
            hashes = None
            if self.engram_hash is not None:
                hashes = self.engram_hash(input_ids, start_pos, engram_mask)
            h = self.embed(input_ids)
            if images is not None:
                if start_pos != 0:
                    raise ValueError("image spans must lie in the first prefill chunk (start_pos 0)")
                self.merge_image_embeddings(images, h)
            if hidden_states is not None:
                capture_embedding(hidden_states, h, image_mask, self.vision is not None)
            h, pre_mix = to_streams(h, self.hc_mult)
            main_hiddens = []
            for i, layer in enumerate(self.layers):
                interrupts.check()  # Ctrl-C or SIGTERM postponed by an import (interrupts.py)
                h, pre_mix, target = block_step(layer, h, start_pos, pre_mix, image_mask, engram_mask, hashes)
                if i in self.target_layer_ids:
                    main_hiddens.append(target)
                if hidden_states is not None:
                    hidden_states[f"layers.{i}"] = h.clone()
                    hidden_states[f"layers.{i}.pre_mix"] = pre_mix.clone()
            h = self.norm(layer.hc_pre(h, pre_mix))
            if hidden_states is not None:
                hidden_states["norm"] = h.clone()
            logits = self.head(h, full_logits=all_logits)
        finally:
            for hook in hooks:
                hook.remove()
        output_ids = sample(logits, self.temperature)
        main_hidden = torch.cat(main_hiddens, dim=-1) if main_hiddens else None
        return output_ids, logits, main_hidden

    def _capture(self, store: dict[str, torch.Tensor]) -> list:
        """Forward hooks that copy each layer's attention, MoE, Engram output and indexer choice into `store`."""

        hooks = []
        for i, layer in enumerate(self.layers):
            hooks += capture_block(layer, f"layers.{i}", store)
        return hooks

    @torch.inference_mode()
    def forward_spec(self, input_ids: torch.Tensor, main_hidden: torch.Tensor, start_pos: int = 0):
        """The DSpark draft stages (mtp.py): seeds their caches at start_pos 0, else returns
        (draft ids, logits, confidence)."""
        from dsv41_convert.model.mtp import forward_spec

        return forward_spec(self, input_ids, main_hidden, start_pos)


def merge_image_spans(owner: nn.Module, images, h: torch.Tensor, encode) -> None:
    """Write each image's span into h in place: IMAGE slots take the encoded rows in row-major order,
    the delimiters their learned embeddings (owner.image_start / image_end / image_newline, [dim] bf16).

    images: per batch row, a list of ImageInput; encode(patches, n_vit_h, n_vit_w) -> [image tokens, dim],
    called once per image in row order; h: [b, s, dim] bfloat16
    """
    from dsv41_convert.model.image_processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START

    for row, row_images in enumerate(images):
        for img in row_images or ():
            types = img.types.to(h.device)
            span = h[row, img.start : img.start + types.numel()]
            span[types == IMAGE_START] = owner.image_start.to(h.dtype)
            span[types == IMAGE_END] = owner.image_end.to(h.dtype)
            span[types == IMAGE_NEW_LINE] = owner.image_newline.to(h.dtype)
            embeds = encode(img.patches.to(h.device), img.n_vit_h, img.n_vit_w)
            span[types == IMAGE] = embeds.to(h.dtype)


def capture_embedding(hidden: dict[str, torch.Tensor], h: torch.Tensor, image_mask, vision: bool) -> None:
    """hidden["embed"] = h (cloned) and, for a model with a vision tower, hidden["vision"] = image_rows(h).

    h: [b, s, dim] bfloat16 after merge_image_spans; image_mask: [b, s] bool or None
    """
    if vision:
        hidden["vision"] = image_rows(h, image_mask)
    hidden["embed"] = h.clone()


def image_rows(h: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
    """The rows of h that image spans wrote (the tower's and aligner's output, the delimiters' embeddings), zeros
    elsewhere: what the vision tower hands the backbone, apart from the token embeddings.

    h: [b, s, dim] bfloat16 after merge_image_spans; image_mask: [b, s] bool or None (no image) -> [b, s, dim]
    """
    out = torch.zeros_like(h)
    if image_mask is not None:
        out[image_mask] = h[image_mask]
    return out


def to_streams(h: torch.Tensor, hc_mult: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding copied into hc_mult streams, and the first block's collapse weights.

    h: [b, s, dim] bfloat16 -> ([b, s, hc, dim] bfloat16, pre_mix [b, s, hc] float32)
    """
    h = h.unsqueeze(2).repeat(1, 1, hc_mult, 1)
    return h, make_identity_pre_mix(h, hc_mult)


def block_step(
    layer: Block,
    h: torch.Tensor,
    start_pos: int,
    pre_mix: torch.Tensor,
    image_mask: torch.Tensor | None,
    engram_mask: torch.Tensor | None,
    hashes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One backbone layer as the Transformer runs it: Engram (if the layer has it), then the block.

    h: [b, s, hc, dim] bfloat16; pre_mix: [b, s, hc] float32; hashes: [b, s, G, C] int64 (Engram rows)
    -> (h [b, s, hc, dim], pre_mix [b, s, hc], the block's input collapsed by the hc mean [b, s, dim]:
        what the DSpark stages read when this layer is one of their targets)
    """
    if layer.engram is not None:
        h = layer.engram(h, hashes[:, :, layer.engram.layer_hash_index, :], engram_mask)
    target = h.mean(dim=2)
    h, pre_mix = layer(h, start_pos, pre_mix, image_mask)
    return h, pre_mix, target


def capture_block(layer: Block, key: str, store: dict[str, torch.Tensor]) -> list:
    """Forward hooks that clone the block's attention and MoE outputs into store[key + ".attn" / ".ffn"],
    and what running the block alone needs (verify.teacher): the stream after its Engram
    (key + ".engram"), an index source's choice (key + ".attn.indexer", int64) and the candidate source's
    blocks (key + ".attn.candidates", [b, s, t] int8, 1 inside a kept block)."""

    def saver(name: str, dtype: torch.dtype | None = None):
        def hook(_module, _inputs, output):
            store[name] = output.clone() if dtype is None else output.to(dtype)

        return hook

    hooks = [
        layer.attn.register_forward_hook(saver(f"{key}.attn")),
        layer.ffn.register_forward_hook(saver(f"{key}.ffn")),
    ]
    if layer.engram is not None:
        hooks.append(layer.engram.register_forward_hook(saver(f"{key}.engram")))
    indexer = getattr(layer.attn, "indexer", None)
    if indexer is not None:
        hooks.append(indexer.register_forward_hook(saver(f"{key}.attn.indexer", torch.int64)))
    if indexer is not None and indexer.is_candidate_source:

        def candidates(_module, _inputs, _output):
            store[f"{key}.attn.candidates"] = layer.attn.shared.candidates.to(torch.int8)

        hooks.append(indexer.register_forward_hook(candidates))
    return hooks
