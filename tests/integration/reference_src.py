"""A fake V4.1-Flash source folder at real scale without the bytes: config.json, the reconstructed index
and the 48 shards as sparse files, each holding its real (reconstructed) header at the front and a hole
where the data would be. Shards 47/48 have no offsets in the reconstruction: they are laid out here in
safetensors' serializer order. The files take almost no disk, but `stat` reports 510 GB.
"""

from __future__ import annotations

import gzip
import json
import shutil
import struct
from pathlib import Path

from dsv41_convert.store.safetensors_header import build_header

REFERENCE = Path(__file__).resolve().parents[1] / "data" / "reference"  # see tests/reference_data.py


def build_reference_src(dst: Path) -> Path:
    """Write the sparse source folder into `dst` and return it."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REFERENCE / "v41-flash.config.json", dst / "config.json")
    shutil.copyfile(REFERENCE / "v41-flash.tokenizer_config.json", dst / "tokenizer_config.json")
    with gzip.open(REFERENCE / "v41-flash.model.safetensors.index.RECONSTRUCTED.json.gz") as f:
        (dst / "model.safetensors.index.json").write_bytes(f.read())
    with gzip.open(REFERENCE / "v41-flash.headers.RECONSTRUCTED.json.gz") as f:
        shards = json.load(f)["shards"]
    for file, info in shards.items():
        tensors = info["tensors"]
        if any(t["data_offsets"] is None for t in tensors.values()):
            header, _ = build_header([(n, t["dtype"], tuple(t["shape"])) for n, t in tensors.items()])
        else:
            doc = {n: tensors[n] for n in sorted(tensors, key=lambda n: tensors[n]["data_offsets"][0])}
            text = json.dumps(doc, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            header = struct.pack("<Q", len(text)) + text
        with open(dst / file, "wb") as f:
            f.write(header)
            f.truncate(len(header) + info["data_bytes"])
    return dst
