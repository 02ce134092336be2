"""A small published-format (fp8/fp4) or bf16 V4.1 checkpoint in a folder, built in well under a second.

Real names and file dtypes (the real config.json with tiny sizes); values are random but valid: e4m3
bytes that are finite, e8m0 scales near 1, any I8 byte (two e2m1 codes). Tensors are spread over three
shards with an index, as the published checkpoint is. For tests of the plan and of bad inputs; the
end-to-end tests use `dsv41-convert make-tiny`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.catalogue import published_layout

REAL_CONFIG = Path(__file__).resolve().parent / "data" / "reference" / "v41-flash.config.json"

TINY_TEXT = {
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 3,
    "num_attention_heads": 8, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_lora_rank": 32,
    "o_groups": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "compress_ratios": [0, 2, 1, 0, 0],
    "kv_source_layer_ids": [1, 2], "index_source_layer_ids": [1, 2], "index_n_heads": 8, "index_head_dim": 32,
    "index_topk": 4, "candidate_source_layer_id": 2, "engram_layer_ids": [1], "engram_num_embeddings": [102],
    "engram_max_ngram_size": 3, "engram_vocab_size": 18, "engram_n_heads": 2, "engram_head_dim": 32,
    "engram_compressed_vocab_size": 100, "num_nextn_predict_layers": 2, "dspark_target_layer_ids": [1, 2],
    "dspark_markov_rank": 32, "dspark_n_routed_experts": 8, "dspark_num_experts_per_tok": 2,
}  # fmt: skip
TINY_VISION = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 48}

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


def tiny_config(quantized: bool = True, vision: bool = True) -> dict:
    cfg = copy.deepcopy(json.loads(REAL_CONFIG.read_text()))
    cfg["text_config"].update(TINY_TEXT)
    cfg["text_config"]["dspark_noise_token_id"] = TINY_TEXT["vocab_size"] - 1  # a token id, as make-tiny's
    cfg["vision_config"].update(TINY_VISION)
    if not vision:
        del cfg["vision_config"]
    if not quantized:
        del cfg["quantization_config"]
    return cfg


def random_tensor(dtype: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random values valid for the file dtype."""
    if dtype == "I8":
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    if dtype == "F8_E8M0":  # scales 2**-4 .. 2**3
        return torch.randint(123, 131, shape, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    if dtype == "F8_E4M3":
        return (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


def source_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint `cfg` describes; unquantized ones when cfg has no quantization_config."""
    args = ModelArgs.from_hf_dict(cfg)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (dtype, shape) in published_layout(args).items():
        if "quantization_config" in cfg:
            out[name] = random_tensor(dtype, shape, g)
        elif not name.endswith(".scale"):
            logical = (shape[0], shape[1] * 2) if dtype == "I8" else shape
            out[name] = random_tensor("BF16" if dtype != "F32" else "F32", logical, g)
    return out


def write_ckpt(folder: Path, tensors: dict[str, torch.Tensor], cfg: dict, n_files: int = 3) -> Path:
    """Write `tensors` as n_files shards + index + config.json + tokenizer files into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_files):
        file = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::n_files]}
        save_file(part, folder / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg, tokenizer = _with_tokenizer(cfg)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def make_tiny(folder: Path, quantized: bool = True, vision: bool = True, seed: int = 0) -> Path:
    cfg = tiny_config(quantized, vision)
    return write_ckpt(folder, source_tensors(cfg, seed), cfg)


def _with_tokenizer(cfg: dict):
    """A word-level tokenizer with one token per id of the config's vocabulary whose Engram token map folds to the
    config's engram_compressed_vocab_size C (id i decodes to i // C spaces and "t{i % C}", which normalize alike),
    and the config (C lowered to the vocabulary where it exceeds it): plan checks a source's tokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    cfg = copy.deepcopy(cfg)
    text = cfg["text_config"]
    vocab = text["vocab_size"] if isinstance(text.get("vocab_size"), int) and text["vocab_size"] > 0 else 256
    folded = text.get("engram_compressed_vocab_size")
    folded = min(folded, vocab) if isinstance(folded, int) and folded > 0 else vocab
    if text.get("engram_layer_ids"):
        text["engram_compressed_vocab_size"] = folded
    words = {" " * (i // folded) + f"t{i % folded}": i for i in range(vocab)}
    return cfg, Tokenizer(WordLevel(words, unk_token="t0"))
