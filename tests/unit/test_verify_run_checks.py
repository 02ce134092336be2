"""verify/run.py's pieces that turn comparisons into checks, a verdict's report and a localization: each is fed
small hand-made runs and stats, so a check that holds where a section differs, a failure given to the wrong check,
a FAIL that names decisive checks, or a localization that blames the wrong module shows here without the model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.verify import weight_digests
from dsv41_convert.verify.metrics import compare
from dsv41_convert.verify.ranks import RankResult
from dsv41_convert.verify.run import (
    VerifyResult,
    _compare_all,
    _config_fits_rank_files,
    _copied_files_differ,
    _expected,
    _localize,
    _reference_check,
    _sections,
    _streamable,
    _twin_check,
    _weights_check,
    not_run_by,
)
from dsv41_convert.verify.runner import ModelInput, PromptRun
from dsv41_convert.verify.thresholds import default_thresholds
from dsv41_convert.verify.verdict import FAIL, INCONCLUSIVE, PASS, Check

V = 8


def _logits(shift: float = 0.0) -> torch.Tensor:
    out = torch.arange(3 * V, dtype=torch.float32).reshape(3, V) / 10
    out[-1, 0] += shift
    return out


def _run(shift: float = 0.0, draft_shift: float = 0.0, confidence_shift: float = 0.0, hidden=None) -> PromptRun:
    """A run of a 3-token prompt with one decode step and a 2-token draft block; `*_shift` moves one value."""
    draft = torch.linspace(-1, 1, 2 * V).reshape(1, 2, V)
    draft[0, 1, 3] += draft_shift
    confidence = torch.tensor([[0.25, 0.75]])
    confidence[0, 0] += confidence_shift
    return PromptRun(_logits(shift), torch.tensor([1]), torch.linspace(-2, 2, V)[None], draft, hidden or {}, None,
                     confidence)  # fmt: skip


def _result(failures: list[str] | None = None, verdict: str = FAIL, mode: str = "reduction") -> VerifyResult:
    result = VerifyResult("conv", "ref", 1, "cpu", default_thresholds(mode), [], {}, list(failures or []))
    result.verdict = verdict
    return result


def test_the_reference_check_is_exact_only_where_every_section_is():
    """A decode step that differs beside an equal last-position logit: the reference check is not exact, so
    not decisive, expected exact or not (an `any` in place of `all` made such a run a decisive PASS)."""
    result = _result(["decode: max_abs 0.001 > 0"])
    result.overall = {"last": compare(_logits(), _logits()), "decode": compare(_logits(), _logits(1e-3))}
    ref = SimpleNamespace(tp=1, device="cpu")
    for blockers in ([], ["the reference ran at tp 2, this run at tp 1"]):
        check = _reference_check(result, blockers, ref)
        assert not check.exact and not check.decisive, blockers
    assert _reference_check(result, [], ref).failures == ["decode: max_abs 0.001 > 0"]


def test_a_reference_check_not_expected_exact_carries_the_bounds_it_broke():
    """Against a reference of another tp the reference check is judged by the statistical bounds: where they
    broke (a NaN block scale: KL inf) the check carries those failures, so the report says `differs`, not
    `held, not bit for bit` beside the FAIL they made."""
    failures = ["last: kl_mean inf > 1", "twin last: max_abs 0.5 > 0"]
    result = _result(failures)
    result.overall = {"last": compare(_logits(), _logits(0.5))}
    blocked = ["the reference ran at tp 1, this run at tp 2"]
    check = _reference_check(result, blocked, SimpleNamespace(tp=1, device="cpu"))
    assert check.failures == ["last: kl_mean inf > 1"] and not check.expected_exact and not check.decisive
    held = _result([])
    held.overall = {"last": compare(_logits(), _logits(0.5))}
    assert _reference_check(held, blocked, SimpleNamespace(tp=1, device="cpu")).failures == []


def test_the_reference_check_leaves_the_twins_failures_and_the_load_error_to_their_checks():
    """The reference check's failures are the comparison with the reference: the twin's own (and a load error)
    are reported by their checks, so the report says which check failed."""
    failures = ["twin last: max_abs 0.5 > 0", "twin weights: layers.0.attn.wq_a.weight", "last: max_abs 0.5 > 0"]
    result = _result(failures)
    result.overall = {"last": compare(_logits(), _logits(0.5))}
    check = _reference_check(result, [], SimpleNamespace(tp=1, device="cpu"))
    assert check.failures == ["last: max_abs 0.5 > 0"]


def test_the_twin_check_fails_on_weights_that_differ_from_the_twins_even_where_the_logits_agree():
    """A rank file whose bytes are not the twin's, on a path no prompt output shows: the twin check is not exact
    (it was decisive, and the run a PASS, where only its logits were looked at)."""
    result = _result(["twin weights: layers.1.ffn.experts.3.w2.weight: rank 1 differs"])
    result.twin = {"last": compare(_logits(), _logits()), "all": compare(_logits(), _logits())}
    check = _twin_check(result)
    assert not check.exact and not check.decisive
    assert check.failures == ["twin weights: layers.1.ffn.experts.3.w2.weight: rank 1 differs"]
    assert _twin_check(_result([])).exact  # no difference at all: exact


def test_the_drafts_and_the_confidence_head_are_compared_with_the_converted_run():
    """The draft and confidence sections compare the reference's run with the converted one (a comparison of the
    reference with itself, or a skipped section, passed wrong DSpark stages)."""
    sections = _sections(_run(), _run(draft_shift=0.25, confidence_shift=0.125), True)
    assert set(sections) == {"last", "all", "decode", "draft", "confidence"}
    assert sections["draft"].max_abs == 0.25
    assert sections["confidence"].max_abs == 0.125
    assert sections["last"].max_abs == sections["decode"].max_abs == 0


def test_a_twin_that_differs_within_the_statistical_bounds_is_a_failure_of_the_run():
    """The twin must agree bit for bit: overall too, a difference the loose bounds of the reduction mode accept is
    one of the run's failures (not only of the prompt's)."""
    ref = SimpleNamespace(
        labels=["p"], inputs=[ModelInput(torch.tensor([5, 6, 7]))], runs=[_run()], has_logits_all=True
    )
    th = default_thresholds("reduction")
    result = _result()
    _compare_all(result, ref, RankResult([_run()], [_run(shift=1e-3)]), th)
    assert result.overall["last"].max_abs == 0 and result.twin["last"].max_abs > 0
    assert any(f.startswith("twin last: ") for f in result.prompts[0].failures)
    assert any(f.startswith("twin last: ") for f in result.failures)
    assert not any(f.startswith(("last", "all", "decode")) for f in result.failures)


def _ranks(rows: int, dim: int, tp: int) -> SimpleNamespace:
    embed = SimpleNamespace(shape=[rows, dim])
    return SimpleNamespace(folder=Path("conv"), tp=tp, headers=[SimpleNamespace(tensors={"embed.weight": embed})])


def test_the_config_fits_rank_files_that_split_the_vocabulary():
    """At tp 2 each rank file holds vocab/2 embedding rows: a config of the whole vocabulary fits them; one of
    another vocabulary or dim does not (forgetting the split refused every tp > 1 conversion)."""
    args = SimpleNamespace(vocab_size=16, dim=4)
    _config_fits_rank_files(_ranks(8, 4, 2), args)
    _config_fits_rank_files(_ranks(16, 4, 1), args)
    with pytest.raises(VerifyInputError, match=r"vocab_size 16, dim 4, but its rank files hold embed.weight \[16, 4\]"):
        _config_fits_rank_files(_ranks(16, 4, 2), args)
    with pytest.raises(VerifyInputError, match=r"dim 4"):
        _config_fits_rank_files(_ranks(8, 8, 2), args)


def test_a_fail_names_no_decisive_check_and_only_a_pass_is_ok():
    """`decisive` is what a verdict rests on: a FAIL rests on none, though a check of another kind held;
    INCONCLUSIVE (exit 3) is not ok."""
    fail = _result(["tokenizer: conv/tokenizer.json differs"], FAIL)
    fail.checks = [Check("replay", True, True)]
    assert fail.decisive == [] and fail.held == ["replay"]
    assert fail.to_json()["decisive"] == [] and fail.to_json()["exit_code"] == 1 and not fail.ok
    unsure = _result([], INCONCLUSIVE)
    assert not unsure.ok and unsure.to_json()["ok"] is False and unsure.to_json()["exit_code"] == 3
    ok = _result([], PASS)
    ok.checks = [Check("replay", True, True)]
    assert ok.ok and ok.to_json()["exit_code"] == 0 and ok.decisive == ["replay"]


def test_a_statistical_pass_without_a_decisive_check_says_so():
    """--statistical: a PASS that no decisive check holds rests on statistical bounds only, and the JSON says so;
    a PASS with a decisive check covering everything does not."""
    bounds_only = _result([], PASS)
    bounds_only.statistical = True
    bounds_only.checks = [Check("reference", False, False)]
    assert bounds_only.to_json()["statistical"] is True
    decided = _result([], PASS)
    decided.statistical = True
    decided.checks = [Check("reference", True, True)]
    assert decided.to_json()["statistical"] is False


def test_the_vision_tower_is_reached_by_any_image_prompt():
    """One prompt with an image runs the vision tower: it is not reported unreached; none with one is."""
    args = SimpleNamespace(vision_enabled=True)
    text, image = SimpleNamespace(image=None), SimpleNamespace(image="cat.png")
    assert not_run_by([text, image], args) == []
    assert len(not_run_by([text, text], args)) == 1
    assert not_run_by([text], SimpleNamespace(vision_enabled=False)) == []


def test_copied_files_that_differ_in_bytes_of_the_same_length_are_failures(tmp_path):
    """The tokenizer files and hf_config.json `shard` copies from SRC are compared byte for byte: an edit that
    keeps the length (a changed id, a changed value) is a failure, as is a missing tokenizer file."""
    src, conv = tmp_path / "src", tmp_path / "conv"
    src.mkdir(), conv.mkdir()
    (src / "tokenizer.json").write_text('{"a": 1}')
    (conv / "tokenizer.json").write_text('{"a": 2}')
    (src / "config.json").write_text('{"rope_theta": 10000}')
    (conv / "hf_config.json").write_text('{"rope_theta": 20000}')
    found = _copied_files_differ(src, conv)
    assert [f.split(":")[0] for f in found] == ["tokenizer", "hf config"], found
    (conv / "tokenizer.json").write_text('{"a": 1}')
    (conv / "hf_config.json").write_text('{"rope_theta": 10000}')
    assert _copied_files_differ(src, conv) == []
    (conv / "tokenizer.json").unlink()
    assert [f.split(":")[0] for f in _copied_files_differ(src, conv)] == ["tokenizer"]


def _hidden(**bumped: float) -> dict[str, torch.Tensor]:
    keys = ("embed", "layers.0.attn", "layers.0.ffn", "layers.1.attn", "layers.1.ffn", "norm")
    return {k: torch.linspace(1, 2, 16) * (1 + bumped.get(k.replace(".", "_"), 0.0)) for k in keys}


def _localized(failures: list[str], conv_hidden: dict, ref_tp: int = 2, tp: int = 2):
    """_localize of a reduction-mode run (tolerance > 0, no twin, no replay) without a tensor diff."""
    result = _result(failures)
    ref = SimpleNamespace(runs=[_run(hidden=_hidden())], tp=ref_tp)
    out = RankResult([_run(hidden=conv_hidden)], None)
    args = SimpleNamespace(n_layers=2)
    return _localize(result, ref, out, None, SimpleNamespace(tp=tp), args, default_thresholds("reduction"), None)


def test_a_weight_the_digests_name_is_blamed_over_a_noisy_hidden_state():
    """Against the tolerance of the reduction mode a hidden state's divergence may be noise; the weight whose
    bytes differ from the record is where the fault is (layers.1.attn, not the noisy layers.0.attn)."""
    failures = ["weights: layers.1.attn.wkv.weight: sha256 differs", "last: kl_max 0.9 > 0.5"]
    loc = _localized(failures, _hidden(layers_0_attn=0.5))
    assert loc.module == "layers.1.attn"
    assert loc.note.startswith("layers.1.attn.wkv.weight: sha256 differs")


def test_only_the_drafts_failing_is_localized_in_the_dspark_stages():
    """Every hidden state agrees: a failure of the drafts alone points at mtp.*, one of the logits at the head."""
    drafts = _localized(["draft: kl_max 0.9 > 0.5"], _hidden())
    assert drafts.module == "mtp" and drafts.note.startswith("the backbone agrees; the DSpark stages (mtp.*) differ")
    logits = _localized(["last: kl_max 0.9 > 0.5"], _hidden())
    assert logits.module == "head"


def test_a_reference_of_another_tp_is_not_localized_from_reduction_noise():
    """Against a reference of another tp every module differs by reduction noise: the report says the module is
    not localized; against one of the same tp the first module past the tolerance is named."""
    failures = ["last: kl_max 0.9 > 0.5"]
    other = _localized(failures, _hidden(layers_1_ffn=0.5), ref_tp=1, tp=2)
    assert other.module is None and other.note.startswith("not localized: the reference ran at tp 1")
    same = _localized(failures, _hidden(layers_1_ffn=0.5), ref_tp=2, tp=2)
    assert same.module == "layers.1.ffn"


def test_a_replay_held_to_bounds_is_not_localized_bit_for_bit():
    """A replay that broke the statistical bounds against a reference no replay matches bit for bit (the bf16
    model) differs from it everywhere by quantization: its first differing bit is no fault's module. Only a
    replay expected bit for bit localizes at a tolerance of 0."""
    failures = ["last: kl_mean inf > 1", "replay last: kl_mean inf > 1"]
    result = _result(failures)
    ref = SimpleNamespace(runs=[_run(hidden=_hidden())], tp=1)
    out = RankResult([_run(hidden=_hidden(layers_1_ffn=1e-3))], None)
    replayed = [_run(hidden=_hidden(embed=1e-6, layers_1_ffn=1e-3))]
    args, th = SimpleNamespace(n_layers=2), default_thresholds("quantized")
    result.checks = [Check("replay", False, False, ["replay last: kl_mean inf > 1"])]
    loc = _localize(result, ref, out, None, SimpleNamespace(tp=2), args, th, replayed)
    assert loc.module is None and loc.note.startswith("not localized: the reference ran at tp 1")
    result.checks = [Check("replay", False, True, ["replay last: max_abs 0.1 > 0 (bit equality expected)"])]
    assert _localize(result, ref, out, None, SimpleNamespace(tp=2), args, th, replayed).module == "embed"


@pytest.mark.parametrize(
    ("teacher_failures", "module"),
    [
        (["teacher logits: 4.47 bf16 ulps > 2 (line-1)"], "head"),
        (["teacher layers.1.attn.indexer: top-k differs at 5 of 24 positions (line-1)"], "layers.1.attn"),
        (["teacher layers.1.pre_mix: 4.83 bf16 ulps > 2 (line-1)"], "layers.1.ffn"),
        (
            [
                "teacher layers.0.attn.indexer: top-k differs at 5 of 24 positions (line-1)",
                "teacher layers.1.attn: 12.1 bf16 ulps > 2 (line-1)",
            ],
            "layers.0.attn",
        ),
        (
            ["teacher norm: 3 bf16 ulps > 2 (line-1)", "teacher layers.0.pre_mix: 3 bf16 ulps > 2 (line-1)"],
            "layers.0.ffn",
        ),
        (["teacher logits: 3 bf16 ulps > 2 (line-1)", "teacher norm: 3 bf16 ulps > 2 (line-1)"], "norm"),
    ],
)
def test_a_teacher_failure_is_localized_to_a_module_of_the_readme(teacher_failures, module):
    """The teacher check measures outputs that are not modules of their own: the logits (the head's output, the
    head run on the reference's final norm), an indexer's top-k (part of its layer's attention) and the pre_mix
    collapse weights a block hands on (its FFN side's hc mixing: `layers.i.hc_ffn_*`, layers.i.ffn's scope).
    The module named was that key itself ("first diverging module: logits", "layers.1.attn.indexer",
    "layers.2.pre_mix" through the CLI, measured on make-tiny with the replay off: a head byte, indexer.wq_b's rows
    reversed, hc_ffn_base[0] x4), none of the README's modules, and sorted after every layer (module_order knew
    none of them), so an indexer of layer 0 lost to layer 1's attention. Expected: the README's module in
    forward order."""
    failures = [*teacher_failures, "last: kl_max 0.9 > 0.5"]
    loc = _localized(failures, _hidden(), ref_tp=1, tp=2)
    assert loc.module == module, loc
    assert loc.note.startswith("the first module the teacher check failed"), loc


def test_a_weights_comparison_that_skipped_the_routed_experts_is_not_decisive(monkeypatch):
    """The reference's digests compared for every tensor but the routed experts (stored in another dtype here):
    the check holds for what it compared, but a PASS cannot rest on it."""
    monkeypatch.setattr(weight_digests, "compare", lambda recorded, ranks, done=None: ([], "experts skipped"))
    monkeypatch.setattr(weight_digests, "compares_every_weight", lambda recorded, ranks: False)
    result = _result([])
    _weights_check(result, {}, SimpleNamespace(), "ref.safetensors")
    assert result.weights == "partial"
    (check,) = result.checks
    assert check.name == "weights" and not check.decisive and not check.expected_exact


def test_a_rank_file_tensor_the_record_lacks_is_the_reference_files_error(monkeypatch):
    """The rank files loaded into the model strictly, so a tensor of theirs that the record does not list means the
    record is wrong: an input error naming the file, not a failure of CONVERTED."""
    lacking = f"layers.0.attn.wq_a.weight: {weight_digests.NOT_RECORDED}"
    monkeypatch.setattr(weight_digests, "compare", lambda recorded, ranks, done=None: ([lacking], "compared"))
    monkeypatch.setattr(weight_digests, "compares_every_weight", lambda recorded, ranks: True)
    result = _result([])
    with pytest.raises(VerifyInputError, match=r"ref.safetensors: its weights record .*wq_a"):
        _weights_check(result, {}, SimpleNamespace(), "ref.safetensors")
    assert result.failures == []


def test_the_streamed_replay_goes_only_with_a_tp_1_reference(monkeypatch):
    """--stream-layers replays the rank files at tp 1: a reference file of tp 2 (or more) cannot judge it bit for
    bit, so it is refused before any unit is read; a tp-1 one is accepted."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    opts = SimpleNamespace(replay=True)
    _streamable(opts, SimpleNamespace(tp=1), "ref.safetensors")
    for tp in (2, 4):
        with pytest.raises(VerifyInputError, match=rf"ref.safetensors: a tp-{tp} reference; --stream-layers"):
            _streamable(opts, SimpleNamespace(tp=tp), "ref.safetensors")


def test_the_twin_is_the_reference_state_only_for_an_fp8_sources_fp4_conversion(monkeypatch):
    """The published (fp8) source converted to fp4 experts is a pass-through: the reference's weights are the tp-1
    output. Any other pair (a bf16 source, fp8 experts) needs the converter's output computed from the source."""
    from dsv41_convert.verify import source

    monkeypatch.setattr(source, "expected_shards", lambda src, expert_dtype: ("converter", expert_dtype))
    for fmt, experts, want in (
        ("fp8", "fp4", "reference state"),
        ("bf16", "fp4", ("converter", "fp4")),
        ("fp8", "fp8", ("converter", "fp8")),
        ("bf16", "fp8", ("converter", "fp8")),
    ):
        src_ref = SimpleNamespace(reference=SimpleNamespace(source_format=fmt), state="reference state")
        assert _expected(src_ref, Path("src"), SimpleNamespace(expert_dtype=experts)) == want, (fmt, experts)


def test_rank_files_that_do_not_merge_fail_the_weights_check(monkeypatch):
    """Rank files whose replicated copies disagree cannot be compared with the tp-1 record as one model: that is a
    fault of the conversion (a failure, the weights "differs"), not a comparison that could not run."""
    from dsv41_convert.errors import ShardConsistencyError

    def disagree(recorded, ranks, done=None):
        raise ShardConsistencyError("layers.0.attn.wkv.scale: replicated, but rank 1's copy differs")

    monkeypatch.setattr(weight_digests, "compare", disagree)
    monkeypatch.setattr(weight_digests, "compares_every_weight", lambda recorded, ranks: True)
    result = _result([])
    _weights_check(result, {}, SimpleNamespace(), "ref.safetensors")
    assert result.weights == "differs"
    assert result.failures == ["weights: layers.0.attn.wkv.scale: replicated, but rank 1's copy differs"]
    (check,) = result.checks
    assert not check.decisive and check.failures == result.failures


def test_exactly_one_reference_and_the_streamed_replay_only_with_a_file(tmp_path):
    """verify takes SRC or FILE, not both (FILE was ignored), and --stream-layers only with FILE; a folder without a
    config.json is then the next thing said."""
    from dsv41_convert.errors import ConfigError
    from dsv41_convert.verify.run import VerifyOptions, verify

    ref = tmp_path / "ref.safetensors"
    with pytest.raises(VerifyInputError, match=r"give exactly one of --reference SRC and --reference-logits FILE"):
        verify(VerifyOptions(tmp_path, reference=tmp_path, reference_logits=ref))
    with pytest.raises(VerifyInputError, match=r"give exactly one"):
        verify(VerifyOptions(tmp_path))
    with pytest.raises(VerifyInputError, match=r"--stream-layers goes with --reference-logits FILE"):
        verify(VerifyOptions(tmp_path, reference=tmp_path, stream_layers=True))
    with pytest.raises(ConfigError, match=r"config.json: not found"):
        verify(VerifyOptions(tmp_path, reference_logits=ref, stream_layers=True))
