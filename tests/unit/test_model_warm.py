"""GEMM warm-up: the families found from the parameters are exactly the GEMM shapes a forward pass uses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_testing import random_state_dict, tiny_args, write_shards

from dsv41_convert.kernels import dispatch
from dsv41_convert.model import Transformer, load_shards
from dsv41_convert.model import layers as layers_module
from dsv41_convert.model.warm import GemmFamily, gemm_families, run_family, warm_up_gemms


def _recording_ops(seen: set[GemmFamily]):
    """ops_for() whose GEMMs note the weight they were called with, then run the reference."""

    def ops_for(device):
        ops = dispatch.ops_for(device)

        def note(gemm):
            def call(xq, xs, weight, scale, *args, **kw):
                seen.add(GemmFamily(str(weight.dtype), weight.shape[0], weight.shape[1], tuple(scale.shape)))
                return gemm(xq, xs, weight, scale, *args, **kw)

            return call

        return dataclasses.replace(ops, fp8_gemm=note(ops.fp8_gemm), fp4_gemm=note(ops.fp4_gemm))

    return ops_for


@pytest.mark.parametrize("overrides", [{}, {"dtype": "bf16"}], ids=["fp8", "bf16-dense"])
def test_families_are_the_gemms_a_forward_pass_runs(tmp_path, monkeypatch, overrides):
    args = tiny_args(**overrides)
    write_shards(random_state_dict(args, seed=0), args, tmp_path, 1)
    model = Transformer(args)
    load_shards(model, tmp_path)
    seen: set[GemmFamily] = set()
    monkeypatch.setattr(layers_module, "ops_for", _recording_ops(seen))
    ids = torch.randint(0, args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
        model(ids[:, -1:], start_pos=24)  # a decode step goes through the same weights
    families = gemm_families(model)
    assert families == sorted(set(families))
    assert set(families) == seen
    assert {f.dtype for f in families} == (
        {str(torch.float8_e4m3fn), str(torch.float4_e2m1fn_x2)} if "dtype" not in overrides
        else {str(torch.float4_e2m1fn_x2)}
    )  # fmt: skip


def test_run_family_calls_linear_with_the_family_shapes(monkeypatch):
    args = tiny_args()
    families = gemm_families(Transformer(args))
    seen: set[GemmFamily] = set()
    monkeypatch.setattr(layers_module, "ops_for", _recording_ops(seen))
    for f in families:
        run_family(f, "cpu")
    assert seen == set(families)


def test_warm_up_is_a_no_op_on_the_cpu():
    model = Transformer(tiny_args())
    got = warm_up_gemms(model, "cpu")
    assert got == {"families": len(gemm_families(model)), "seconds": 0.0} and got["families"] > 0
