"""Converted rank files as the layer-streamed model's weights (model.streamed.WeightProvider): each request
merged back to tp 1 by `convert.unshard.unshard_tensors` (only the named tensors' bytes are read), Engram
rows read straight from the rank that holds them (rank r holds rows [r * k, (r + 1) * k), k = ceil(rows / N)).

This is the tp-1 replay of a converted set at real scale: `reference-logits OUT_FOLDER ... --stream-layers`
on rank files computes what a tp-1 run of exactly those bytes gives, and `verify --stream-layers` replays
them so (RankWeights.over). Rank files whose replicated tensors differ are refused first
(convert.unshard.replica_mismatches: those tensors' bytes are read once).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from dsv41_convert.convert.tp import rank_file_tps
from dsv41_convert.convert.unshard import RankFiles, replica_mismatches, unshard_tensors
from dsv41_convert.errors import VerifyInputError, first_few
from dsv41_convert.quant.file_dtypes import SAFETENSORS_DTYPES
from dsv41_convert.store.index import INDEX_NAME
from dsv41_convert.store.rank_names import rank_file_name, rank_files_in
from dsv41_convert.store.safetensors_header import Header, pread_exact


def rank_file_tp(folder: Path) -> int | None:
    """The tp of the rank files in `folder`, None when it holds none (an HF source). VerifyInputError where it
    holds rank files beside a Hugging Face checkpoint's index: the rank files were replayed and the checkpoint
    ignored, a reference of whatever model they hold said to be the folder's (an audit), where the whole-model
    reference reads the checkpoint (and refuses the rank files' tensors held twice)."""
    tps = rank_file_tps(folder)
    if len(tps) > 1:
        raise VerifyInputError(f"{folder}: rank files of several tp sizes {tps}; keep one set")
    if tps and (folder / INDEX_NAME).exists():
        found = first_few([rank_file_name(r, tps[0]) for r in sorted(rank_files_in(folder)[tps[0]])], 2)
        raise VerifyInputError(
            f"{folder}: a Hugging Face checkpoint ({INDEX_NAME}) with rank files beside it ({found}): which "
            "of them to run is not clear; move the rank files to a folder of their own (a reference of the "
            "checkpoint, or of the rank files: give that folder)"
        )
    return tps[0] if tps else None


class RankWeights:
    """tp-1 tensors from the rank files of `folder` (see the module docstring)."""

    source_format = "fp8"  # rank files are the deployable (quantized) format

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        tp = rank_file_tp(self.folder)
        if tp is None:
            raise VerifyInputError(f"{self.folder}: no model{{r}}-mp{{N}}.safetensors rank files")
        self.ranks = RankFiles(self.folder, tp)  # the whole set, or the missing files named
        self.headers: list[Header] = self.ranks.headers
        # every replicated tensor, not only those of the units a run reaches (the vision tower without an
        # image prompt was never merged, so ranks that disagreed on it gave a reference: an audit)
        differ = replica_mismatches(self.ranks)
        if differ:
            self.ranks.close()
            shown = "; ".join(differ[:5]) + (f"; and {len(differ) - 5} more" if len(differ) > 5 else "")
            raise VerifyInputError(f"{self.folder}: the rank files are not one conversion ({shown})")
        self._owns_files = True

    @classmethod
    def over(cls, ranks: RankFiles) -> RankWeights:
        """Over rank files opened (and checked) by the caller: verify's replicas check names each tensor that
        differs as a failure; close() leaves them open."""
        weights = cls.__new__(cls)
        weights.folder, weights.ranks, weights.headers = ranks.folder, ranks, ranks.headers
        weights._owns_files = False
        return weights

    def __call__(self, names) -> dict[str, Tensor]:
        return unshard_tensors(self.ranks, list(names))

    def rows(self, names, rows: Tensor) -> dict[str, Tensor]:
        """Rows `rows` ([n] int64, sorted, unique, < the config's row count) of Engram tables."""
        out = {}
        for name in names:
            info0 = self.headers[0].tensors.get(name)
            if info0 is None:
                raise VerifyInputError(f"{name}: not in {self.headers[0].path}")
            per_rank = info0.shape[0]
            dtype = SAFETENSORS_DTYPES[info0.dtype]
            row_bytes = (info0.end - info0.begin) // per_rank
            buf = bytearray(rows.numel() * row_bytes)
            view = memoryview(buf)
            for i, row in enumerate(rows.tolist()):
                r, local = divmod(row, per_rank)
                info = self.headers[r].tensors[name]
                at = info.begin + local * row_bytes
                row_view = view[i * row_bytes : (i + 1) * row_bytes]
                pread_exact(self.ranks.fd(r), row_view, at, self.ranks.where(r, name))
            raw = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            out[name] = raw.view(rows.numel(), row_bytes).view(dtype)
        return out

    def close(self) -> None:
        if self._owns_files:
            self.ranks.close()
