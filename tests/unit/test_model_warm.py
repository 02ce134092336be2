"""Kernel warm-up: the families found from the model are the kernels a forward pass runs.

GEMM families come from the parameters; op families (in-place act_quant / fp4_act_quant, sparse_attn
per index-count bucket, hc_split_sinkhorn) from the modules. The recorders below derive each call's
family from the call's own tensors, independently of warm.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_testing import random_state_dict, tiny_args, with_runtime, write_shards

from dsv41_convert.config import ModelArgs
from dsv41_convert.kernels import dispatch
from dsv41_convert.kernels.topk import topk_bucket, topk_buckets
from dsv41_convert.model import Transformer, load_shards
from dsv41_convert.model import attention as attention_module
from dsv41_convert.model import block as block_module
from dsv41_convert.model import indexer as indexer_module
from dsv41_convert.model import layers as layers_module
from dsv41_convert.model import mtp as mtp_module
from dsv41_convert.model import warm as warm_module
from dsv41_convert.model.layers import dense_dtype
from dsv41_convert.model.mtp import DSparkAttention
from dsv41_convert.model.warm import (
    GemmFamily,
    OpFamily,
    gemm_families,
    max_topk,
    op_families,
    run_family,
    warm_up_kernels,
)
from dsv41_convert.synth.presets import TINY, hf_config

OP_MODULES = (attention_module, block_module, indexer_module, mtp_module, warm_module)


def _bucket(topk: int) -> int:
    """64 * the next power of two of ceil(topk / 64)."""
    blocks = 1
    while 64 * blocks < topk:
        blocks *= 2
    return 64 * blocks


def _recording_ops(gemms: set[GemmFamily], op_calls: set[OpFamily], widths: list[int]):
    """ops_for() that notes each call's family (and each sparse_attn index count), then runs the reference."""

    def ops_for(device):
        ops = dispatch.ops_for(device)

        def gemm(fn):
            def call(xq, xs, weight, scale, *args, **kw):
                gemms.add(GemmFamily(str(weight.dtype), weight.shape[0], weight.shape[1], tuple(scale.shape)))
                return fn(xq, xs, weight, scale, *args, **kw)

            return call

        def act_quant(x, block, fmt, scale_dtype, inplace=False):
            assert (block, fmt, scale_dtype, inplace) == (32, "ue8m0", torch.float8_e8m0fnu, True)
            op_calls.add(OpFamily("act_quant", (x.size(-1),)))
            return ops.act_quant(x, block, fmt, scale_dtype, inplace)

        def fp4_act_quant(x, block, inplace=False, scale_dtype=None):
            assert inplace and scale_dtype == (torch.float8_e4m3fn if block == 16 else None)
            op_calls.add(OpFamily("fp4_act_quant", (x.size(-1), block)))
            return ops.fp4_act_quant(x, block, inplace, scale_dtype=scale_dtype)

        def sparse_attn(q, kv, sink, idxs, scale):
            widths.append(idxs.size(-1))
            op_calls.add(OpFamily("sparse_attn", (q.size(2), q.size(3), _bucket(idxs.size(-1)))))
            return ops.sparse_attn(q, kv, sink, idxs, scale)

        def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc, iters, eps):
            op_calls.add(OpFamily("hc_split_sinkhorn", (hc, iters, eps)))
            return ops.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc, iters, eps)

        return dataclasses.replace(
            ops,
            fp8_gemm=gemm(ops.fp8_gemm),
            fp4_gemm=gemm(ops.fp4_gemm),
            act_quant=act_quant,
            fp4_act_quant=fp4_act_quant,
            sparse_attn=sparse_attn,
            hc_split_sinkhorn=hc_split_sinkhorn,
        )

    return ops_for


@pytest.fixture
def record(monkeypatch):
    """(gemm families, op families, sparse_attn index counts) seen while the test runs the model."""
    gemms: set[GemmFamily] = set()
    op_calls: set[OpFamily] = set()
    widths: list[int] = []
    for module in OP_MODULES:
        monkeypatch.setattr(module, "ops_for", _recording_ops(set(), op_calls, widths))
    # layers' act_quant is the GEMMs' own (not in place): only its GEMMs are recorded there
    monkeypatch.setattr(
        layers_module,
        "ops_for",
        lambda device: dataclasses.replace(
            _recording_ops(gemms, set(), [])(device), act_quant=dispatch.ops_for(device).act_quant
        ),
    )
    return gemms, op_calls, widths


def _loaded(args: ModelArgs, folder) -> Transformer:
    write_shards(random_state_dict(args, seed=0), args, folder, 1)
    model = Transformer(args)
    load_shards(model, folder)
    return model


@pytest.mark.parametrize("overrides", [{}, {"dtype": "bf16"}], ids=["fp8", "bf16-dense"])
def test_families_are_the_kernels_a_forward_pass_runs(tmp_path, record, overrides):
    args = with_runtime(tiny_args(**overrides), max_seq_len=64)
    model = _loaded(args, tmp_path)
    gemms, op_calls, widths = record
    ids = torch.randint(0, args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
        model(ids[:, -1:], start_pos=24)  # a decode step goes through the same weights
    families = gemm_families(model)
    assert families == sorted(set(families))
    assert set(families) == gemms
    assert {f.dtype for f in families} == (
        {str(torch.float8_e4m3fn), str(torch.float4_e2m1fn_x2)} if "dtype" not in overrides
        else {str(torch.float4_e2m1fn_x2)}
    )  # fmt: skip
    ops = op_families(model)
    assert ops == sorted(set(ops))
    assert {f.op for f in op_calls} == {"act_quant", "fp4_act_quant", "sparse_attn", "hc_split_sinkhorn"}
    assert op_calls <= set(ops)
    assert {f for f in ops if f.op != "sparse_attn"} == {f for f in op_calls if f.op != "sparse_attn"}
    assert max(widths) <= max_topk(args)


def test_max_topk_is_what_a_full_prefill_attends_to(tmp_path, record):
    args = with_runtime(tiny_args(), max_seq_len=64)
    model = _loaded(args, tmp_path)
    _, _, widths = record
    ids = torch.randint(0, args.vocab_size, (1, args.max_seq_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids)
    assert max(widths) == max_topk(args) == args.window_size + min(args.index_topk, args.max_seq_len)


def test_dspark_attention_index_counts_are_covered(record):
    args = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405, vision=False))
    args = dataclasses.replace(args, dtype="bf16", expert_dtype=None).with_runtime(max_batch_size=1, max_seq_len=64)
    assert args.dspark_block_size > 0
    with dense_dtype(args):
        attn = DSparkAttention(args.n_layers, args)
    for p in attn.parameters():
        torch.nn.init.normal_(p.data, std=0.02)
    _, op_calls, widths = record
    main_x = torch.randn(1, 30, args.dim).bfloat16()
    x = torch.randn(1, args.dspark_block_size, args.dim).bfloat16()
    with torch.no_grad():
        attn(x, 0, main_x)
        attn(x, 30, main_x[:, -1:])
    assert widths == [args.window_size + args.dspark_block_size] and widths[0] <= max_topk(args)
    assert op_calls <= set(op_families(OneLayerModel(attn, args)))


class OneLayerModel(torch.nn.Module):
    """A stand-in model: one layer and the args."""

    def __init__(self, layer: torch.nn.Module, args: ModelArgs):
        super().__init__()
        self.layer, self.args = layer, args


def test_run_family_runs_exactly_that_family(record):
    args = tiny_args()
    model = Transformer(args)
    gemms, op_calls, _ = record
    for f in gemm_families(model):
        run_family(f, "cpu")
    assert gemms == set(gemm_families(model))
    for f in op_families(model):
        run_family(f, "cpu")
    assert op_calls == set(op_families(model))


def test_warm_up_is_a_no_op_on_the_cpu():
    model = Transformer(tiny_args())
    got = warm_up_kernels(model, "cpu")
    assert got == {"families": len(gemm_families(model)) + len(op_families(model)), "seconds": 0.0}
    assert len(op_families(model)) > 0


@pytest.mark.parametrize("most", [1, 64, 65, 640, 1025])
def test_topk_buckets_cover_every_index_count(most):
    got = topk_buckets(most)
    assert got == sorted({_bucket(t) for t in range(1, most + 1)})
    assert all(topk_bucket(t) == _bucket(t) for t in range(1, 2 * most + 1))


def test_max_topk_is_window_plus_the_larger_of_compressed_rows_and_draft_block():
    """The index-count buckets to compile reach max_topk: a too small one leaves the largest sparse_attn buckets
    to compile mid-forward, inside the collectives. Catches max_topk dividing by the largest compress ratio
    (fewest compressed rows) instead of the smallest, and max_topk forgetting the DSpark draft block."""
    from types import SimpleNamespace

    base = dict(window_size=128, index_topk=512, max_seq_len=1024, dspark_block_size=0)
    # ratio 4 gives 1024 // 4 = 256 compressed rows (under index_topk 512); ratio 128 would give only 8
    assert max_topk(SimpleNamespace(**base, compress_ratios=(0, 4, 128, 4))) == 128 + 256
    assert max_topk(SimpleNamespace(**base, compress_ratios=(0, 128))) == 128 + 8
    # no compressed layers: only the window and a draft block of 16 rows
    assert max_topk(SimpleNamespace(**{**base, "dspark_block_size": 16}, compress_ratios=(0, 0))) == 128 + 16
    # a draft block larger than the compressed rows wins
    assert max_topk(SimpleNamespace(**{**base, "dspark_block_size": 64}, compress_ratios=(0, 128))) == 128 + 64


def test_the_compressed_kv_fp4_family_comes_from_the_kv_source_layers_only():
    """Each layer's own families: an fp4_act_quant of head_dim with the compressed KV's block of 16 (e4m3
    scales) exactly where the config names the layer a kv source. Catches the test on is_kv_source inverted
    (the whole model's set hides it, since tiny has both kinds of layer)."""
    args = tiny_args()
    model = Transformer(args)
    seen = set()
    for i, layer in enumerate(model.layers):
        fams = op_families(OneLayerModel(layer, args))
        kv_fp4 = OpFamily("fp4_act_quant", (args.head_dim, 16)) in fams
        assert kv_fp4 == (i in args.kv_source_layers), i
        seen.add(kv_fp4)
    assert seen == {True, False}


def _warm_up_as_rank(monkeypatch, model: torch.nn.Module, rank: int, world: int) -> list:
    """warm_up_kernels(model, "cuda") as rank `rank` of `world`: the families run, in order, and "barrier"."""
    events: list = []
    monkeypatch.setattr(warm_module, "run_family", lambda family, device: events.append(family))
    monkeypatch.setattr(warm_module.parallel, "world_size", lambda: world)
    monkeypatch.setattr(warm_module.parallel, "rank", lambda: rank)
    monkeypatch.setattr(warm_module.parallel, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: events.append("barrier"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    assert warm_up_kernels(model, "cuda")["families"] == len(gemm_families(model)) + len(op_families(model))
    return events


def test_warm_up_shares_the_families_out_over_the_ranks_then_runs_them_all(monkeypatch):
    """Before the barrier rank r runs the families r, r + world, ... (together the ranks compile each family
    once); after it every rank runs every family (the peers' come out of TileLang's cache). Catches every
    rank compiling the same share (the rest left to the forward pass, inside the collectives) and a missing
    barrier (a rank running a family a peer is still compiling)."""
    model = Transformer(tiny_args())
    families = [*gemm_families(model), *op_families(model)]
    world = 3
    assert len(families) > world
    first_passes: list[list] = []
    for r in range(world):
        events = _warm_up_as_rank(monkeypatch, model, r, world)
        assert events.count("barrier") == 1, r
        cut = events.index("barrier")
        assert events[cut + 1 :] == families, r
        first_passes.append(events[:cut])
    compiled = [f for share in first_passes for f in share]
    assert len(compiled) == len(families) and set(compiled) == set(families)  # each once, over all the ranks
    assert all(abs(len(share) - len(families) / world) < 1 for share in first_passes)
