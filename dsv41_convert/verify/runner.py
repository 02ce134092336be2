"""Run the bundled model over verify's prompts: prefill, greedy decode steps, DSpark drafts.

The same function runs the reference (tp 1, in one process) and the converted weights (one process
per rank), so both sides do exactly the same computation in the same order, batch 1, prompt by
prompt. The decode steps of both sides feed the same tokens: the reference's greedy choices
(`teacher`), so a converted model that picks another token is still compared on the reference's path.

Per prompt, with S prompt positions, T decode steps, K draft tokens, V vocab:
    logits_all     [S, V]     float32  prefill, every position
    last           [V]        float32  prefill, last position, computed like the default forward
    decode_ids     [T + 1]    int64    [0] the greedy token after the prefill, [t + 1] after decode step t;
                                       step t feeds decode_ids[t], its drafts start from decode_ids[t + 1]
    decode_logits  [T, V]     float32  logits after feeding decode_ids[t]
    draft_logits   [T, K, V]  float32  DSpark drafts after each decode step (None without MTP stages)
    hidden         key -> [S, ...] bfloat16, the prefill per-module outputs (see Transformer.forward)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from dsv41_convert.config import ModelArgs
from dsv41_convert.verify.fits import require_caches_fit
from dsv41_convert.verify.prompts import Prompt


@dataclass
class ModelInput:
    """One prompt as the model takes it (image spans expanded)."""

    input_ids: Tensor  # [S] int64
    token_types: Tensor | None = None  # [S] int64, -1 for text
    images: list | None = None  # ImageInput list of this row
    image: str | None = None  # the image's path, for the reference file
    image_sha256: str | None = None  # of the bytes `images` were cut from (the file may change during the run)


@dataclass
class PromptRun:
    logits_all: Tensor
    decode_ids: Tensor
    decode_logits: Tensor
    draft_logits: Tensor | None
    hidden: dict[str, Tensor] = field(default_factory=dict)
    last: Tensor | None = None  # [V] float32, when it is stored apart from logits_all (a reference file)
    draft_confidence: Tensor | None = None  # [T, K] float32: the DSpark confidence head beside the drafts

    @property
    def logits(self) -> Tensor:
        """[V] float32, the last prompt position."""
        return self.last if self.last is not None else self.logits_all[-1]


def model_input(prompt: Prompt, args: ModelArgs) -> ModelInput:
    """Token ids (and for an image prompt, the image span after the text) as tensors."""
    ids = torch.tensor(prompt.input_ids, dtype=torch.int64)
    if prompt.image is None:
        return ModelInput(ids)
    from dsv41_convert.model.image_processor import prepare_vl_inputs, read_image_file

    try:
        data = read_image_file(Path(prompt.image))  # read once: the reference file records these bytes' digest
        full, types, images = prepare_vl_inputs([*prompt.input_ids, args.image_token_id], [data], args)
    except (ValueError, OSError) as exc:
        from dsv41_convert.errors import VerifyInputError

        raise VerifyInputError(f"{prompt.origin or prompt.label}: image {prompt.image}: {exc}") from exc
    digest = hashlib.sha256(data).hexdigest()
    return ModelInput(torch.tensor(full), torch.tensor(types), images, prompt.image, digest)


def attach_images(inp: ModelInput, args: ModelArgs) -> ModelInput:
    """Rebuild the image inputs of a prompt read from a reference file (ids and token types already
    expanded, the image known by its path)."""
    if inp.image is None or inp.images is not None:
        return inp
    from dsv41_convert.errors import VerifyInputError
    from dsv41_convert.model.image_processor import IMAGE_START, TEXT, ImageInput, image_token_types, load_image

    if inp.token_types is None:
        raise VerifyInputError(f"image {inp.image}: the reference file has no token_types for its prompt")
    try:
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = load_image(Path(inp.image), args)
    except (ValueError, OSError) as exc:
        raise VerifyInputError(f"image {inp.image}: {exc}") from exc
    starts = (inp.token_types == IMAGE_START).nonzero().flatten().tolist()
    types = image_token_types(n_llm_h, n_llm_w)  # [span] int64, the span this model makes of the image
    # the prompt's token types as this model makes them: text, then exactly this span (another grid's span of
    # this length or longer, the reference run's other vision settings, was a rank's RuntimeError "shape
    # mismatch" in merge_image_spans: an audit)
    start = starts[0] if len(starts) == 1 else -1
    fits = 0 <= start and start + types.numel() <= len(inp.token_types)
    expected = torch.full_like(inp.token_types, TEXT)
    if fits:
        expected[start : start + types.numel()] = types
    if not fits or not torch.equal(inp.token_types, expected):
        raise VerifyInputError(
            f"image {inp.image}: token_types hold no {types.numel()}-token image span of the {n_llm_h}x{n_llm_w} "
            "grid this model cuts it into (did the reference run other vision settings in config.json?)"
        )
    image = ImageInput(start, patches, n_vit_h, n_vit_w, types)
    return ModelInput(inp.input_ids, inp.token_types, [image], inp.image)


def build_model(args: ModelArgs, folder: Path, device: str, runs_on: str | None = None) -> nn.Module:
    """A Transformer for `args` (tp from torch.distributed), empty weights, in eval mode, on `device`; `folder`
    holds the config.json `args` came from (named when its caches cannot fit) and the tokenizer.json Engram
    reads. runs_on: where the caller moves it after loading (its caches are checked against that memory too)."""
    from dsv41_convert.model.transformer import Transformer

    require_caches_fit(args, runs_on or device, folder / "config.json", shortest_drafted(args))
    tokenizer = folder / "tokenizer.json" if args.engram_layer_ids else None  # read (and checked) by the Engram hash
    model = Transformer(args, tokenizer).eval()
    return model if device == "cpu" else model.to(device)


@torch.no_grad()
def load_state(model: nn.Module, state: dict[str, Tensor], what: str = "reference weights") -> None:
    """Copy an in-memory state dict into `model`, as strictly as load_shards reads a file: the key sets
    must be equal, shapes equal, and dtypes equal except bf16 -> float32 (the model's fp32 Linear and
    head weights are bf16 in the rank files). Raises PlanError naming the tensors and `what` they are."""
    from dsv41_convert.model.load import load_tensors

    load_tensors(model, state, what)


def positions_needed(prompt_length: int, n_decode: int, draft_block: int = 0) -> int:
    """The runtime max_seq_len a prompt and its decode steps (and their drafts) need: after the last step
    (position prompt + n_decode - 1) the DSpark stages rope `draft_block` positions beyond it."""
    return prompt_length + n_decode + max(1, draft_block if n_decode else 0)


def draft_block(args) -> int:
    """Positions the DSpark drafts take after a decode step: the block size, 0 for a model without stages."""
    return args.dspark_block_size if args.n_mtp_layers > 0 else 0


def shortest_drafted(args) -> int:
    """The positions of the shortest run with DSpark drafts (a 1-token prompt and one decode step, then the
    block), 0 for a model without them: where these alone cannot fit, the config's block is too large."""
    block = draft_block(args)
    return positions_needed(1, 1, block) if block else 0


@torch.inference_mode()
def run_prompt(
    model: nn.Module,
    inp: ModelInput,
    n_decode: int,
    teacher: Tensor | None = None,
    capture_hidden: bool = False,
    device: str = "cpu",
) -> PromptRun:
    """Prefill `inp`, then `n_decode` single-token steps, with the DSpark drafts after each step.

    teacher: [n_decode + 1] int64, the reference's decode_ids (None, or empty for a reference without
             decode steps: this model's own greedy choices)
    """
    if teacher is not None and teacher.numel() == 0:
        teacher = None
    if teacher is not None and teacher.numel() < n_decode + 1:
        raise ValueError(f"teacher holds {teacher.numel()} tokens, {n_decode} decode steps feed {n_decode + 1}")
    ids = inp.input_ids.to(device)[None]
    types = None if inp.token_types is None else inp.token_types.to(device)[None]
    images = None if inp.images is None else [inp.images]
    seq = ids.shape[1]
    hidden: dict[str, Tensor] = {}
    _, logits, main_hidden = model(ids, 0, images, types, all_logits=True, hidden_states=hidden)
    logits_all = logits[0].float().cpu()
    # the last position as the default forward computes it: the head on one row (an fp32 matmul of
    # one row can differ in the last bit from the same row inside a matmul of many; SPEC.md section 6)
    last = model.head(hidden["norm"], full_logits=False)[0].float().cpu()
    has_mtp = len(getattr(model, "mtp", ())) > 0
    fed, dec_logits, drafts, confidence = [], [], [], []
    nxt = last.argmax() if teacher is None else teacher[0]
    if has_mtp and n_decode:
        model.forward_spec(nxt.view(1).to(device), main_hidden, 0)  # seeds the draft windows
    fed.append(int(nxt))
    for t in range(n_decode):
        tok = torch.tensor([[int(nxt)]], dtype=torch.int64, device=device)
        _, step_logits, main_hidden = model(tok, seq + t)
        step = step_logits[0].float().cpu()
        dec_logits.append(step)
        nxt = step.argmax() if teacher is None else teacher[t + 1]
        fed.append(int(nxt))
        if has_mtp:
            spec = model.forward_spec(nxt.view(1).to(device), main_hidden, seq + t)
            drafts.append(spec[1][0].float().cpu())
            confidence.append(spec[2][0].float().cpu())
    vocab = logits_all.shape[-1]
    return PromptRun(
        logits_all=logits_all,
        decode_ids=torch.tensor(fed, dtype=torch.int64),
        decode_logits=torch.stack(dec_logits) if dec_logits else torch.empty(0, vocab),
        draft_logits=torch.stack(drafts) if drafts else None,
        draft_confidence=torch.stack(confidence) if confidence else None,
        hidden={k: v[0].cpu() for k, v in hidden.items()} if capture_hidden else {},
        last=last,
    )
