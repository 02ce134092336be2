"""bench/teacher_flips.py plants each fault in the one tensor it names, and only where rank 0's file holds it (a
kv-less index source has no wk or k_norm)."""

from __future__ import annotations

import torch
from bench_modules import fresh_bench_module


def test_each_fault_changes_only_its_tensor_of_an_index_source_that_has_it(monkeypatch):
    flips = fresh_bench_module(monkeypatch, "teacher_flips")
    p = "layers.5.attn.indexer"
    tensors = {
        f"{p}.wq_b.scale": torch.full((4, 2), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        f"{p}.weights_proj.weight": torch.ones(4, 8, dtype=torch.bfloat16),
    }
    planted = flips.faults(5, set(tensors))
    assert len(planted) == 3 and not any("wk" in k or "k_norm" in k for k in planted), list(planted)
    for label, edit in planted.items():
        changed = dict(tensors)
        edit(changed)
        differs = [n for n in tensors if not torch.equal(changed[n].view(torch.uint8), tensors[n].view(torch.uint8))]
        assert differs == [label.split(": ")[0] + (".scale" if "wq_b" in label else ".weight")], (label, differs)
