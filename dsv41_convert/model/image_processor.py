"""Image preprocessing and the image span of the prompt.

An image is resized (aspect kept, padded with gray) to a multiple of the patch size, cut into an
n_vit_h x n_vit_w grid of patches for the ViT; the aligner folds 3x3 patches into one token, giving
an n_llm_h x n_llm_w grid. The prompt carries the image as the span

    [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]

where every position holds `image_token_id` in input_ids and only `token_types` tells them apart
(TEXT = -1 outside spans). IMAGE positions get the aligner rows in row-major order, the other three
get the learned `image_start` / `image_newline` / `image_end` vectors. Spans must lie in the first
prefill chunk.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np
import torch

from dsv41_convert.file_kinds import refuse_non_file

if TYPE_CHECKING:
    from PIL import Image as PILImage
    from tokenizers import Tokenizer

    from dsv41_convert.config import ModelArgs

TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)
PAD_COLOR = (127, 127, 127)

ImageSource = Union["PILImage.Image", str, Path, bytes]


@dataclass
class ImageInput:
    """One image of a prompt.

    start:   position of its IMAGE_START in the prompt
    patches: [n_vit_h * n_vit_w, 3, p, p]  bfloat16, row-major, pixels scaled to [-1, 1]
    types:   [span length]                int64 token types (IMAGE_START .. IMAGE_END)
    """

    start: int
    patches: torch.Tensor
    n_vit_h: int
    n_vit_w: int
    types: torch.Tensor


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Span length: one row of n_llm_w IMAGE plus a NEW_LINE per grid row, plus START and END."""
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(height: int, width: int, patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    """Token grid (rows, cols) the aligner makes from an image of this pixel size."""
    return math.ceil((height // patch_size) / downsample_ratio), math.ceil((width // patch_size) / downsample_ratio)


def _fit_to_budget(height, width, patch_size: int, downsample_ratio: int, max_n_token: int) -> tuple[int, int]:
    """The largest aspect-keeping pixel size (multiples of patch_size) whose span fits max_n_token."""
    aspect = height / width
    # cols w with rows = aspect * w solves w * aspect * (w + 1) + 2 = max_n_token
    cols = math.sqrt((max_n_token - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    cell = patch_size * downsample_ratio
    if cols < 1.0:  # too tall for even one column at full height: a single column
        return (max_n_token - 2) // 2 * cell, cell
    if rows < 1.0:  # too wide: a single row
        return cell, (max_n_token - 3) * cell
    shrink = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return (
        math.floor(height * shrink / patch_size) * patch_size,
        math.floor(width * shrink / patch_size) * patch_size,
    )


def plan_image_grid(width, height, args: ModelArgs) -> tuple[int, int, int, int]:
    """(n_llm_h, n_llm_w, target height, target width) for an image of this original size."""
    p = args.vision_patch_size
    if args.vision_max_wh_ratio is not None and width > height * args.vision_max_wh_ratio:
        width = height * args.vision_max_wh_ratio
    if 0 < width * height < args.vision_min_pixels:  # small images are scaled up first
        grow = (args.vision_min_pixels / (width * height)) ** 0.5
        width, height = int(width * grow), int(height * grow)
    target_w, target_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    n_llm_h, n_llm_w = llm_grid(target_h, target_w, p, args.vision_downsample_ratio)
    if num_image_tokens(n_llm_h, n_llm_w) > args.vision_max_n_token:
        target_h, target_w = _fit_to_budget(height, width, p, args.vision_downsample_ratio, args.vision_max_n_token)
        n_llm_h, n_llm_w = llm_grid(target_h, target_w, p, args.vision_downsample_ratio)
        if num_image_tokens(n_llm_h, n_llm_w) > args.vision_max_n_token:
            raise ValueError(f"image {width}x{height}: no grid fits vision_max_n_token={args.vision_max_n_token}")
    return n_llm_h, n_llm_w, target_h, target_w


def read_image_file(path: Path) -> bytes:
    """The encoded bytes of the image file at `path`; ValueError naming it where it is no regular file."""
    refuse_non_file(Path(path), ValueError)  # a FIFO waited for a writer forever (an audit)
    return Path(path).read_bytes()


def open_image(source: ImageSource) -> PILImage.Image:
    """An RGB PIL image from a PIL image, a file path or encoded bytes."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    data = source if isinstance(source, bytes) else read_image_file(Path(source))
    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except Image.UnidentifiedImageError:
        raise ValueError("not an image PIL can read (PNG, JPEG, WebP, ...)") from None
    except Image.DecompressionBombError as exc:  # not a ValueError: it was a traceback (an audit)
        raise ValueError(f"{exc} (PIL's decompression-bomb limit)") from None


def load_image(source: ImageSource, args: ModelArgs) -> tuple[torch.Tensor, int, int, int, int]:
    """Resize and cut one image into ViT patches.

    -> (patches [n_vit_h * n_vit_w, 3, p, p] bfloat16, n_vit_h, n_vit_w, n_llm_h, n_llm_w)
    """
    from PIL import ImageOps

    p = args.vision_patch_size
    image = open_image(source)
    n_llm_h, n_llm_w, target_h, target_w = plan_image_grid(image.width, image.height, args)
    n_vit_h, n_vit_w = target_h // p, target_w // p
    if args.vision_max_wh_ratio is not None and image.width >= args.vision_max_wh_ratio * image.height:
        image = image.resize((target_w, target_h))  # over-wide: stretched, not padded
    else:
        image = ImageOps.pad(image, (target_w, target_h), color=PAD_COLOR)
    pixels_CHW = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255
    pixels_CHW = ((pixels_CHW - 0.5) / 0.5).to(torch.bfloat16)
    patches = pixels_CHW.reshape(3, n_vit_h, p, n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(n_vit_h * n_vit_w, 3, p, p)
    return patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w


def image_token_types(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """-> [num_image_tokens(n_llm_h, n_llm_w)] int64, the span's token types in order."""
    row = [IMAGE] * n_llm_w + [IMAGE_NEW_LINE]
    return torch.tensor([IMAGE_START, *row * n_llm_h, IMAGE_END], dtype=torch.int64)


def prepare_vl_inputs(
    prompt_ids: list[int], images: list[ImageSource], args: ModelArgs
) -> tuple[list[int], list[int], list[ImageInput] | None]:
    """Expand each `image_token_id` of `prompt_ids` into its image's span.

    -> (input ids, token types, images or None when there are none)
    """
    placeholders = sum(t == args.image_token_id for t in prompt_ids)
    if placeholders != len(images):
        raise ValueError(
            f"prompt has {placeholders} image placeholders (id {args.image_token_id}), got {len(images)} images"
        )
    if placeholders and not args.vision_enabled:
        raise ValueError("the prompt has images but the model has no vision tower (vision_n_layers == 0)")
    if placeholders and not 0 <= args.image_token_id < args.vocab_size:  # a span's ids are embedded (then replaced)
        raise ValueError(  # -1 was a traceback (IndexError in the embedding), past the vocabulary an Engram error
            f"config.json's image_token_id {args.image_token_id} is not a token id (0..{args.vocab_size - 1}): "
            "every position of an image span holds it"
        )
    ids: list[int] = []
    types: list[int] = []
    inputs: list[ImageInput] = []
    pending = iter(images)
    for tok in prompt_ids:
        if tok != args.image_token_id:
            ids.append(tok)
            types.append(TEXT)
            continue
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = load_image(next(pending), args)
        span = image_token_types(n_llm_h, n_llm_w)
        inputs.append(ImageInput(len(ids), patches, n_vit_h, n_vit_w, span))
        ids += [args.image_token_id] * span.numel()
        types += span.tolist()
    return ids, types, inputs or None


def build_vl_prompt(
    tokenizer: Tokenizer, parts: list[str | ImageSource], args: ModelArgs
) -> tuple[torch.Tensor, torch.Tensor, list[list[ImageInput] | None]]:
    """Model inputs for one prompt mixing text and images, for `Transformer.forward`.

    `parts` alternate freely: a str is tokenized (no special tokens added: put BOS or chat markers
    in the text), anything else is an image (PIL image, pathlib.Path, or encoded bytes). Text parts are
    encoded separately, so a part boundary is a token boundary, as around the image placeholder.

    -> (input_ids [1, S] int64, token_types [1, S] int64, images: one list per batch row)
    """
    prompt_ids: list[int] = []
    images: list[ImageSource] = []
    for part in parts:
        if isinstance(part, str):
            if not part:
                continue
            prompt_ids += tokenizer.encode(part, add_special_tokens=False).ids
        else:
            prompt_ids.append(args.image_token_id)
            images.append(part)
    ids, types, inputs = prepare_vl_inputs(prompt_ids, images, args)
    return torch.tensor([ids], dtype=torch.int64), torch.tensor([types], dtype=torch.int64), [inputs]


def build_image_prompt(
    tokenizer: Tokenizer, image: PILImage.Image | str | Path | bytes, args: ModelArgs, before: str = "", after: str = ""
) -> tuple[torch.Tensor, torch.Tensor, list[list[ImageInput] | None]]:
    """`before` + one image + `after`, as `build_vl_prompt` returns it; `image` may be a PIL
    image, a file path (str or Path) or encoded bytes."""
    source = Path(image) if isinstance(image, str) else image
    return build_vl_prompt(tokenizer, [before, source, after], args)
