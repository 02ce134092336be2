"""convert.memory: the `plan` memory figures against the bundled model's own tensors and buffers."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.memory import DEFAULT_SEQ, cache_bytes, memory_figures, tp1_tensors, widened
from dsv41_convert.convert.plan import ConversionPlan, ExpertRun, OutTensor, build_plan
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


def _subset(plan: ConversionPlan, keep) -> ConversionPlan:
    """`plan` with only the parts (tensors, expert runs) whose name or prefix `keep` accepts."""
    files = []
    for f in plan.files:
        parts = tuple(p for p in f.parts if keep(p.prefix if type(p) is ExpertRun else p.name))
        files.append(dataclasses.replace(f, parts=parts))
    return dataclasses.replace(plan, files=tuple(files))


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> tuple[ConversionPlan, ModelArgs]:
    from tiny_ckpt import make_tiny

    src = make_tiny(tmp_path_factory.mktemp("mem") / "src")
    return build_plan(src, 1), load_model_args(src / "config.json")


def test_verify_working_memory_is_the_largest_weight_dequantized_whole(tiny_plan):
    """With no prompts (no logits, no hidden states) a rank's working memory is the largest fp8/fp4 weight
    dequantized to float32 by the CPU kernels: 4 bytes a value. An Engram table is looked up row by row, never
    dequantized whole. Bugs guarded: an fp8 weight counted at 2 bytes a value, and the Engram table counted
    (here the largest quantized tensor of a rank holding it and one small fp8 weight)."""
    plan, args = tiny_plan

    def dequantized(t: OutTensor) -> int:  # values of the logical shape (an F4 shape counts values) x 4 bytes
        if t.dtype not in ("F8_E4M3", "F4") or ".engram.embed." in t.name:
            return 0
        return 4 * math.prod(t.shape)

    (rank,) = memory_figures(plan, args, prompts=0, tokens=0)["verify"]
    assert rank["working"] == max(dequantized(t) for t in plan.files[0].tensors)
    table, small = "layers.1.engram.embed.", "layers.0.attn.wkv.weight"
    sub = _subset(plan, lambda name: name.startswith(table) or name == small)
    shapes = {t.name: t.shape for t in sub.files[0].tensors}
    assert math.prod(shapes[table + "weight"]) > math.prod(shapes[small])  # the table is the largest
    (rank,) = memory_figures(sub, args, prompts=0, tokens=0)["verify"]
    assert rank["working"] == 4 * math.prod(shapes[small])


def test_streamed_largest_unit_is_the_one_with_the_highest_peak(tiny_plan):
    """A unit's peak is its weights in the model plus its dense part again as read from the files (the
    provider's buffer). The head (bf16 on disk, float32 in the model) holds the most bytes here, while layer
    0's dense part (f32 and fp8 tensors, kept as they are) peaks higher: layer 0 is the largest unit. Bug
    guarded: the largest unit chosen by its bytes, which reported the head and a peak 16 KiB short. In-model
    bytes from the bundled model's own parameters."""
    plan, args = tiny_plan
    dense0 = ("layers.0.hc_attn_fn", "layers.0.hc_ffn_fn", "layers.0.attn.wq_b.weight")
    sub = _subset(plan, lambda name: name == "head.weight" or name in dense0)
    params = {name: p for name, (p, _) in expected_tensors(_meta_model(args, 1, DEFAULT_SEQ)).items()}
    file_bytes = {t.name: t.end - t.begin for t in sub.files[0].tensors}
    model_bytes = {name: params[name].numel() * params[name].element_size() for name in file_bytes}
    head = model_bytes["head.weight"] + file_bytes["head.weight"]
    layer0 = sum(model_bytes[n] + file_bytes[n] for n in dense0)
    assert model_bytes["head.weight"] > sum(model_bytes[n] for n in dense0) and layer0 > head  # the two orders differ
    s = memory_figures(sub, args, prompts=0, tokens=0)["streamed"]
    assert s["largest_unit"] == "layers.0" and s["unit"] == sum(model_bytes[n] for n in dense0)
    assert s["peak"] - s["caches"] - s["working"] == layer0


@pytest.mark.parametrize(("prompts", "tokens", "reached"), [(1, 1, 2), (1, 2, 4), (3, 40, 8)])
def test_streamed_unit_holds_the_experts_the_prompts_can_reach(tiny_plan, prompts, tokens, reached):
    """Each prefill position routes to num_experts_per_tok (2) of the layer's 8 experts: 1 position reaches 2
    of them, 2 positions 4, verify's 120 positions every one; all experts have the same bytes. Bug guarded:
    the unit counting only the top-k experts (2 of 8) whatever the positions, half or a quarter of what the
    streamed reference holds at its peak."""
    plan, args = tiny_plan
    assert (args.n_routed_experts, args.n_activated_experts) == (8, 2)
    sub = _subset(plan, lambda name: name.startswith("layers.0."))
    experts = sum(t.end - t.begin for t in sub.files[0].tensors if t.name.startswith("layers.0.ffn.experts."))
    assert experts % 8 == 0
    none = memory_figures(sub, args, prompts=0, tokens=0)["streamed"]
    some = memory_figures(sub, args, prompts=prompts, tokens=tokens)["streamed"]
    assert none["largest_unit"] == some["largest_unit"] == "layers.0"
    assert some["unit"] - none["unit"] == experts // 8 * reached
