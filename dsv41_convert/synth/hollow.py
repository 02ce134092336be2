"""`make-tiny OUT --preset full --sparse`: the published V4.1-Flash layout at full size, without the bytes.

The real config.json (dsv41_convert/data/v41-flash.config.json, hash-verified against the published
file), the published shard grouping (48 files: vision + aligner, embed + image_*, layers 0..39, head +
norm, mtp 0..2, the two Engram tables) with every tensor of the published catalogue (96,085, real names,
dtypes, shapes), an index, and a tokenizer.json of the real vocab size (129,280 ids) with every special
token at the id config.json names (image 129264, DSpark noise 128799) and whose Engram token map has the
config's engram_compressed_vocab_size (99,092) ids, so the Engram hashing runs on it.

Each shard is a safetensors header followed by a hole: `stat` reports 510,286,023,000 bytes of data,
the disk holds ~20 MB (headers, index, tokenizer). Every data byte reads as zero, which is valid in
every dtype of the file: e4m3 / bf16 / f32 / e2m1 zeros, and e8m0 byte 0 = 2^-127. A model run on it
gives all-zero logits (finite): every weight is 0, so every projection, norm and expert output is 0.

Tensor order within a file is safetensors' serializer order (dtype, then name), as published, but in the
two Engram shards (the module's order, table first: Shard.sorted_header); file sizes, config.json and
tokenizer_config.json are the published ones to the byte. The index has the published mapping, total_size
and byte length, but not the published bytes: the published key order is not known (reference README),
ours is sorted (sha256 733ec7b8..., published 74b0686a...).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from dsv41_convert import interrupts
from dsv41_convert.config import ModelArgs
from dsv41_convert.errors import OutputError
from dsv41_convert.progress import Progress
from dsv41_convert.published import REAL_CONFIG, real_config
from dsv41_convert.synth.staged import INDEX, staged
from dsv41_convert.synth.tokenizer import fit_compressed_size, special_token_ids, tokenizer_config
from dsv41_convert.synth.write import plan_shards, write_text


def hollow_tokenizer(config: dict[str, Any]) -> Tokenizer:
    """The tokenizer of the full-size layout: the config's vocab size, every special token at the id the config
    names (image 129264, DSpark noise 128799), an Engram token map of engram_compressed_vocab_size ids."""
    text = config["text_config"]
    specials = special_token_ids(config)
    return fit_compressed_size(text["vocab_size"], text["engram_compressed_vocab_size"], specials)


def _check_sparse(path: Path, out: Path) -> None:
    """OutputError where the filesystem stored a shard's hole as data: the full layout would fill ~510 GB."""
    st = path.stat()
    if st.st_size > 2 * SPARSE_SLACK and st.st_blocks * 512 > st.st_size // 2:
        raise OutputError(
            f"{out}: its filesystem does not keep files sparse ({path.name}: {st.st_blocks * 512:,} bytes on disk "
            f"for {st.st_size:,}); the full layout would take ~510 GB there: pick a folder on ext4, xfs, btrfs or tmpfs"
        )


SPARSE_SLACK = 1 << 20  # a shard's header and the filesystem's first blocks


def write_hollow(out: Path, *, overwrite: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    """Write the full-size layout as sparse files into `out` (see the module docstring).

    progress(file, bytes, total): once per shard, with the shard's apparent size.
    Returns a summary: files with apparent sizes, tensor count, total_size, disk bytes used.
    """
    out = Path(out)
    interrupts.check()  # a signal that landed in an import (torch's: ~1 s) stops the run here, not seconds later
    config = real_config()
    args = ModelArgs.from_hf_dict(config, REAL_CONFIG)
    shards = plan_shards(args, quantized=True)
    text = config["text_config"]
    tok = hollow_tokenizer(config)  # ~2.7 s on the dev box; checks between its tries
    files, weight_map, total = [], {}, 0
    with staged(out, overwrite) as stage:
        write_text(stage / "config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        write_text(stage / "tokenizer.json", tok.to_str(pretty=False))
        model_max = text["max_position_embeddings"]
        tok_config = tokenizer_config(model_max)
        write_text(stage / "tokenizer_config.json", json.dumps(tok_config, indent=2, ensure_ascii=False))
        for shard in shards:
            interrupts.check()
            header, spans = shard.header()
            size = spans[-1][2] if spans else len(header)
            path = stage / shard.file
            with open(path, "wb") as f:
                f.write(header)
                f.truncate(size)  # the data: a hole that reads as zeros
            _check_sparse(path, out)
            files.append({"file": shard.file, "bytes": size, "tensors": len(shard.tensors)})
            weight_map.update({t.name: shard.file for t in shard.tensors})
            total += size - len(header)
            if progress is not None:
                progress(shard.file, size, size)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_text(stage / INDEX, json.dumps(index, indent=2))  # keys sorted; no newline at the end, as published
        used = sum(p.stat().st_blocks * 512 for p in stage.iterdir())
    return {
        "out": str(out),
        "preset": "full",
        "sparse": True,
        "source_dtype": "fp8",
        "vision": True,
        "n_tensors": len(weight_map),
        "total_size": total,
        "disk_bytes": used,
        "engram_compressed_vocab_size": text["engram_compressed_vocab_size"],
        "files": files,
    }
