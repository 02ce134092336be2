"""convert.memory: the `plan` memory figures against the bundled model's own tensors and buffers."""

from __future__ import annotations

from dsv41_convert.config import load_model_args
from dsv41_convert.convert.memory import DEFAULT_SEQ, memory_figures, tp1_tensors
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.model.load import expected_tensors
from dsv41_convert.model.transformer import Transformer
from dsv41_convert.synth.presets import TINY
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
