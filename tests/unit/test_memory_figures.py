"""convert.memory: the `plan` memory figures against the bundled model's own tensors and buffers."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.memory import DEFAULT_SEQ, cache_bytes, memory_figures, tp1_tensors, widened
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.model.load import expected_tensors
from dsv41_convert.model.transformer import Transformer
from dsv41_convert.synth.presets import MEDIUM, TINY, hf_config
from dsv41_convert.synth.write import write_checkpoint


def test_tp1_weights_and_caches_equal_the_models(tmp_path):
    """At tp 1 a rank holds the whole model: the figure must equal its parameters (fp32 widening included,
    which a count of file bytes alone would miss) and its caches at the runtime verify builds."""
    src = write_checkpoint(tmp_path / "src", TINY, vision=True)["out"]
    plan = build_plan(src, 1)
    args = load_model_args(tmp_path / "src" / "config.json")
    figures = memory_figures(plan, args)
    model = Transformer(args.with_runtime(max_batch_size=1, max_seq_len=DEFAULT_SEQ, temperature=0.0),
                        tmp_path / "src" / "tokenizer.json")  # fmt: skip
    params = sum(p.numel() * p.element_size() for p, _ in expected_tensors(model).values())
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if not n.endswith("freqs_cis"))
    (rank,) = figures["verify"]
    assert rank["weights"] == params
    assert rank["caches"] == buffers
    assert rank["total"] == rank["weights"] + rank["caches"] + rank["working"]
    file_bytes = plan.files[0].nbytes - len(plan.files[0].header)
    assert rank["weights"] > file_bytes  # the fp32 heads are bf16 on disk


def test_streamed_unit_is_a_bounded_part_of_the_model(tmp_path):
    src = write_checkpoint(tmp_path / "src", TINY, vision=False)["out"]
    plan1, plan2 = build_plan(src, 1), build_plan(src, 2)
    args = load_model_args(tmp_path / "src" / "config.json")
    figures = memory_figures(plan2, args)
    assert figures["streamed"] == memory_figures(plan1, args)["streamed"]  # streaming reads tp 1 at any tp
    assert len(figures["verify"]) == 2
    assert figures["verify"][0]["weights"] < memory_figures(plan1, args)["verify"][0]["weights"]
    s = figures["streamed"]
    assert s["largest_unit"].startswith(("layers.", "mtp.", "embed", "head"))
    assert 0 < s["unit"] < figures["verify"][0]["weights"]
    assert s["unit"] + s["caches"] + s["working"] < s["peak"] < 2 * s["unit"] + s["caches"] + s["working"]


def test_tp1_view_of_a_tp_n_plan_is_the_tp1_plan(tmp_path):
    """Merging the ranks back (dim0/dim1 added up, Engram padding taken off, experts once) gives exactly the
    tensors a tp-1 plan lays out; a dropped rank or a planted wrong merge would differ."""
    src = write_checkpoint(tmp_path / "src", TINY, vision=True)["out"]
    want = sorted((t.name, t.dtype, t.shape) for t in build_plan(src, 1).files[0].tensors)
    padded = False
    for tp in (2, 4, 8):
        plan = build_plan(src, tp)
        assert sorted(tp1_tensors(plan)) == want, tp
        padded |= any(t.pad_rows for f in plan.files for t in f.tensors)
    assert padded  # the Engram padding path was exercised


def _meta_model(args: ModelArgs, batch: int, seq: int) -> Transformer:
    """The bundled model on the meta device, one routed expert per active slot (dtypes and buffers do not
    depend on the expert count), with a token map of the full vocabulary as a tokenizer's would be."""
    small = dataclasses.replace(
        args, n_routed_experts=args.n_activated_experts, dspark_n_routed_experts=args.dspark_n_activated_experts
    ).with_runtime(max_batch_size=batch, max_seq_len=seq, temperature=0.0)
    token_map = None
    if args.engram_layer_ids:
        folded = args.engram_compressed_vocab_size
        token_map = list(range(folded)) + [0] * (args.vocab_size - folded)
    with torch.device("meta"):
        return Transformer(small, token_map)


def _configs() -> dict[str, ModelArgs]:
    from tests.reference_data import REAL_CONFIG

    out = {"published": load_model_args(REAL_CONFIG)}
    for preset in (TINY, MEDIUM):
        for vision in (True, False):
            hf = hf_config(preset, compressed_vocab_size=preset.vocab_size // 2, vision=vision)
            out[f"{preset.name}-{'vision' if vision else 'text'}"] = ModelArgs.from_hf_dict(hf)
    return out


@pytest.mark.parametrize("name", sorted(_configs()))
@pytest.mark.parametrize(("batch", "seq"), [(1, DEFAULT_SEQ), (3, 256)])
def test_torch_free_view_equals_the_models(name, batch, seq):
    """plan's figures come from the config alone (no torch import): the float32 weights and the cache bytes
    must be exactly the model's own, for the published config and the presets, text and vision."""
    args = _configs()[name]
    model = _meta_model(args, batch, seq)
    for tensor, (p, _) in expected_tensors(model).items():
        assert widened(tensor, args) == (p.dtype == torch.float32 and tensor.endswith(".weight")), tensor
    buffers = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if not n.endswith("freqs_cis"))
    assert cache_bytes(args, batch, seq) == buffers


def test_plan_does_not_import_torch(tmp_path):
    """The figures are why `plan` would import torch (~1 s of its time on the real layout); it must not."""
    src = write_checkpoint(tmp_path / "src", TINY, vision=True)["out"]
    code = (
        "import sys; from dsv41_convert.cli import main; sys.argv = ['dsv41-convert', 'plan', sys.argv[1], "
        "'--tp', '2', '--json']\ntry:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "assert 'torch' not in sys.modules, 'plan imported torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"memory"' in proc.stdout
