"""Where `verify --stream-layers` FAILs, it names the module the whole verify names (docs/VERIFY.md: "the module
named is, in this order: the first differing replica's, ...")."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify import reffile
from dsv41_convert.verify.prompts import load_prompts
from dsv41_convert.verify.reference import compute_reference_ranks
from dsv41_convert.verify.run import VerifyOptions, verify


def test_a_replica_differing_on_one_rank_is_localized_with_and_without_stream_layers(tmp_path):
    """norm.weight one bf16 ulp up on rank 0 of a tp-2 set: the whole verify FAILs it on the replicas check and
    names the replica's module; `--stream-layers` FAILed it too (the streamed merge refuses the two copies),
    but named no module ("the shards do not load"), with the replicas check's failure in the same report."""
    src, mp2, ref = tmp_path / "src", tmp_path / "mp2", tmp_path / "ref.safetensors"
    write_checkpoint(src, TINY, seed=0, quantized=True, vision=False)
    execute(build_plan(src, 2), mp2)
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": [5, 17, 300, 42, 7, 99, 100, 12]}) + "\n")
    prompts = load_prompts(tmp_path / "p.jsonl", None, TINY.vocab_size)
    torch.set_num_threads(1)
    reffile.save(compute_reference_ranks(src, prompts, 1, 0, None, "cpu", False, 1), ref)
    path = mp2 / "model0-mp2.safetensors"
    tensors = load_file(str(path))
    raw = tensors["norm.weight"].view(torch.uint8).clone()
    raw[0] += 1  # the low byte of element 0: one bf16 ulp
    tensors["norm.weight"] = raw.view(torch.bfloat16)
    save_file(tensors, str(path))
    (mp2 / "manifest.json").unlink()  # the replicas check decides, not the manifest's

    modules = {}
    for stream in (False, True):
        result = verify(VerifyOptions(mp2, reference_logits=ref, threads=1, stream_layers=stream))
        assert result.verdict == "FAIL", (stream, result.checks)
        assert any(f.startswith("replicas: norm.weight:") for f in result.failures), (stream, result.failures)
        modules[stream] = result.localization.module
    assert modules == {False: "norm", True: "norm"}, modules  # the final norm, as the hidden states name it
