"""load_shards: the header is checked against the model before any data is read, and any
difference (key, dtype, shape) is an error naming the tensor; then the bytes load unchanged."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from model_testing import random_state_dict, tiny_args
from safetensors.torch import save_file

from dsv41_convert.errors import HeaderError, PlanError
from dsv41_convert.model import Transformer, load_shards
from dsv41_convert.model.load import expected_tensors
from dsv41_convert.quant.fp8 import encode_fp8_blocks
from dsv41_convert.store.safetensors_header import read_header

ARGS = tiny_args(
    n_layers=2, compress_ratios=(0, 2), kv_source_layers=(1,), index_source_layers=(1,), candidate_source_layer=-1
)


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return random_state_dict(ARGS, seed=3)


def _write(folder: Path, sd: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model0-mp1.safetensors"))
    return folder


def test_loads_every_tensor_bit_exactly(tmp_path, state):
    model = Transformer(ARGS)
    load_shards(model, _write(tmp_path, state))
    for name, (p, _) in expected_tensors(model).items():
        file_t = state[name]
        if p.dtype != file_t.dtype:  # the documented exact widening: bf16 file -> fp32 Linear/head
            assert (name, file_t.dtype, p.dtype) in {(name, torch.bfloat16, torch.float32)}
            assert torch.equal(p.detach(), file_t.float()), name
        else:
            assert torch.equal(p.detach().view(torch.uint8), file_t.view(torch.uint8)), name
    assert model.head.weight.dtype == torch.float32  # widened on load, as upstream's load_model does


def test_widening_is_documented_for_linear_and_head_only(state):
    assert state["head.weight"].dtype == torch.bfloat16
    assert state["layers.1.attn.compressor.wgate.weight"].dtype == torch.bfloat16
    assert state["layers.0.hc_attn_fn"].dtype == torch.float32


def _expect(tmp_path: Path, sd: dict[str, torch.Tensor], pattern: str, exc=PlanError) -> None:
    with pytest.raises(exc, match=pattern):
        load_shards(Transformer(ARGS), _write(tmp_path, sd))


def test_missing_tensor(tmp_path, state):
    sd = dict(state)
    del sd["layers.1.attn.indexer.weights_proj.weight"]
    _expect(tmp_path, sd, r"layers\.1\.attn\.indexer\.weights_proj\.weight: missing from the shard \(model wants BF16")


def test_unexpected_tensor(tmp_path, state):
    sd = dict(state, **{"layers.0.attn.wo_a.scale": torch.ones(1, 1, dtype=torch.float8_e8m0fnu)})
    _expect(tmp_path, sd, r"layers\.0\.attn\.wo_a\.scale: in the shard \(F8_E8M0 \[1, 1\]\) but not in the model")


def test_fp8_wo_a_is_refused_not_converted(tmp_path, state):
    """The raw checkpoint's wo_a is fp8 + scale; torch would silently cast the fp8 values into
    the bf16 parameter and ignore the scale."""
    w = state["layers.0.attn.wo_a.weight"]
    q, s = encode_fp8_blocks(w.float())
    sd = dict(state, **{"layers.0.attn.wo_a.weight": q, "layers.0.attn.wo_a.scale": s})
    _expect(tmp_path, sd, r"layers\.0\.attn\.wo_a\.weight: found F8_E4M3 \[256, 64\], model wants BF16")


def test_int8_expert_bytes_are_refused(tmp_path, state):
    """The published checkpoint stores packed e2m1 as I8; the shards must say F4."""
    name = "layers.1.ffn.experts.3.w2.weight"
    sd = dict(state, **{name: state[name].view(torch.int8)})
    _expect(tmp_path, sd, r"experts\.3\.w2\.weight: found I8 \[64, 32\], model wants F4 \[64, 64\]")


def test_fp32_parameter_stored_bf16_is_refused(tmp_path, state):
    sd = dict(state, **{"layers.0.hc_attn_fn": state["layers.0.hc_attn_fn"].bfloat16()})
    _expect(tmp_path, sd, r"layers\.0\.hc_attn_fn: found BF16 \[24, 256\], model wants F32")


def test_a_widened_weight_stored_as_f32_is_refused(tmp_path, state):
    """head.weight is bf16 in every checkpoint (fp32 in the model): stored as F32 it loads to the same values,
    so before, every verify mode passed such rank files (an audit); it is not what any conversion writes."""
    assert state["head.weight"].dtype == torch.bfloat16
    sd = dict(state, **{"head.weight": state["head.weight"].float()})
    shape = list(state["head.weight"].shape)
    _expect(tmp_path, sd, re.escape(f"head.weight: found F32 {shape}, model wants BF16"))


def test_in_memory_weights_follow_the_same_dtype_rule(state):
    from dsv41_convert.model.load import load_tensors

    model = Transformer(ARGS)
    load_tensors(model, state, "weights")  # the file dtypes: fine
    with pytest.raises(PlanError, match=r"head\.weight: torch\.float32 .*model wants torch\.bfloat16"):
        load_tensors(model, dict(state, **{"head.weight": state["head.weight"].float()}), "weights")


def test_wrong_shape(tmp_path, state):
    sd = dict(state, **{"layers.0.attn.attn_sink": torch.zeros(4)})
    _expect(tmp_path, sd, r"layers\.0\.attn\.attn_sink: found shape \[4\], model wants \[8\]")


def test_all_problems_are_listed(tmp_path, state):
    sd = dict(state)
    del sd["norm.weight"]
    del sd["embed.weight"]
    _expect(tmp_path, sd, r"2 tensors do not match the model:\n  embed\.weight: .*\n  norm\.weight")
    # one problem in the singular: it said "1 tensor(s) do not match the model", in verify's load line too
    one = dict(state)
    del one["norm.weight"]
    _expect(tmp_path / "one", one, r"1 tensor does not match the model:\n  norm\.weight: ")


def test_wrong_tp_size_names_the_file(tmp_path, state):
    folder = _write(tmp_path, state)
    with pytest.raises(PlanError, match=r"model0-mp2\.safetensors: shard not found; was it written for tp=2"):
        load_shards(Transformer(ARGS), folder, rank=0, world_size=2)


def test_corrupt_header(tmp_path):
    (tmp_path / "model0-mp1.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(HeaderError, match="header length 1000000 runs past the end"):
        load_shards(Transformer(ARGS), tmp_path)
    (tmp_path / "model0-mp1.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops")
    with pytest.raises(HeaderError, match="not valid JSON"):
        read_header(tmp_path / "model0-mp1.safetensors")


def test_truncated_data(tmp_path, state):
    path = _write(tmp_path, state) / "model0-mp1.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(HeaderError, match="truncated rank file"):
        load_shards(Transformer(ARGS), tmp_path)


def test_a_missing_gate_bias_is_refused(tmp_path, state):
    """Every tensor is required, the MoE gate's fp32 bias as much as a weight (left out, it would stay at its
    initial value and route otherwise)."""
    sd = dict(state)
    del sd["layers.0.ffn.gate.bias"]
    _expect(tmp_path, sd, r"layers\.0\.ffn\.gate\.bias: missing from the shard \(model wants F32")


def test_a_transposed_tensor_is_refused(tmp_path, state):
    w = state["layers.0.attn.wo_a.weight"]
    assert w.shape[0] != w.shape[1]
    sd = dict(state, **{"layers.0.attn.wo_a.weight": w.t().contiguous()})
    want, found = list(w.shape), list(w.t().shape)
    _expect(tmp_path, sd, re.escape(f"layers.0.attn.wo_a.weight: found shape {found}, model wants {want}"))


def test_in_memory_weights_must_be_complete(state):
    from dsv41_convert.model.load import load_tensors

    sd = dict(state)
    del sd["norm.weight"]
    with pytest.raises(PlanError, match=r"weights do not fit the model:\n  norm\.weight: missing"):
        load_tensors(Transformer(ARGS), sd, "weights")


def test_the_mtp_stages_tied_embed_and_head_are_listed_once():
    """The DSpark stages share the backbone's embed and head: the rank files hold them once, under the
    backbone's names, and nothing else is expected of the stages' tied copies."""
    import dataclasses

    from tiny_ckpt import tiny_config

    from dsv41_convert.config import ModelArgs

    args = ModelArgs.from_hf_dict(tiny_config(vision=False))
    args = dataclasses.replace(args, engram_layer_ids=(), engram_num_embeddings=())  # no tokenizer needed
    names = set(expected_tensors(Transformer(args)))
    assert {"embed.weight", "head.weight"} <= names
    for stage in range(args.n_mtp_layers):
        assert not {f"mtp.{stage}.embed.weight", f"mtp.{stage}.head.weight"} & names


def test_another_ranks_file_is_named_as_that_ranks(tmp_path, state, monkeypatch):
    """Rank 1's file at rank 0's name (rank files renamed or copied between ranks) is refused naming rank 1, whose
    routed experts it holds: the refusal was a list of experts "missing from the shard" and "not in the model",
    with no word of the rank they are (a helper's hunt). A file of a mixture of ranks' experts is not said to be
    one rank's."""
    from model_testing import shard_state_dict

    from dsv41_convert.model import parallel

    monkeypatch.setattr(parallel, "world_size", lambda: 2)
    monkeypatch.setattr(parallel, "rank", lambda: 0)
    ranks = shard_state_dict(state, ARGS, 2)
    tmp_path.mkdir(exist_ok=True)
    save_file(ranks[1], str(tmp_path / "model0-mp2.safetensors"))
    with pytest.raises(PlanError, match=r"It holds rank 1's routed experts, not this rank's: is it another rank's"):
        load_shards(Transformer(ARGS), tmp_path, rank=0, world_size=2)
    mixed = dict(ranks[0])
    expert = next(n for n in ranks[1] if ".experts." in n)
    mixed[expert] = ranks[1][expert]
    del mixed[expert.replace(f".experts.{expert.split('.')[4]}.", ".experts.0.")]
    save_file(mixed, str(tmp_path / "model0-mp2.safetensors"))
    with pytest.raises(PlanError, match=r"Was the shard written for this config and tp size") as refused:
        load_shards(Transformer(ARGS), tmp_path, rank=0, world_size=2)
    assert "holds rank" not in str(refused.value)
    save_file(ranks[0], str(tmp_path / "model0-mp2.safetensors"))
    load_shards(Transformer(ARGS), tmp_path, rank=0, world_size=2)
