"""verify.fits: the weights a model holds are sized (plan's per-rank figures) before any model is built, so a
model larger than the host's RAM is refused (exit 2) rather than ended by the allocator (a helper's hunt:
`RuntimeError: DefaultCPUAllocator: can't allocate memory ... 98305579008 bytes`, an Engram table)."""

from __future__ import annotations

import pytest
from cli_run import run_cli
from tiny_ckpt import make_tiny

from dsv41_convert.config import load_model_args
from dsv41_convert.convert.memory import memory_figures
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.verify import fits


def _weights(src, tp: int) -> list[int]:
    """plan's figure (`plan --tp N`'s memory table): the weights each rank's model holds."""
    plan = build_plan(src, tp)
    return [rank["weights"] for rank in memory_figures(plan, load_model_args(src / "config.json"))["verify"]]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("weights") / "src")


def test_reference_logits_is_refused_when_the_weights_exceed_ram_and_runs_when_they_fit(
    src, tmp_path, monkeypatch, capsys
):
    (need,) = _weights(src, 1)
    monkeypatch.setattr(fits, "physical_memory", lambda: need - 1)
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(tmp_path / "ref.safetensors"))
    assert code == 2, err
    assert "Traceback" not in err and "the model's weights need" in err, err
    assert "physical memory" in err and "--stream-layers" in err and "a larger host" in err, err
    assert not (tmp_path / "ref.safetensors").exists()
    monkeypatch.setattr(fits, "physical_memory", lambda: need)  # the caches and prompts fit in that too
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(tmp_path / "ref.safetensors"))
    assert code == 0, err
    assert (tmp_path / "ref.safetensors").is_file()


def test_the_ranks_on_this_host_are_counted_together(src, tmp_path, monkeypatch, capsys):
    """reference-logits --tp 2 starts both ranks here: their weights add up."""
    ranks = _weights(src, 2)
    assert max(ranks) < sum(ranks) - 1
    monkeypatch.setattr(fits, "physical_memory", lambda: sum(ranks) - 1)
    out = tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(out), "--tp", "2")
    assert code == 2, err
    assert "2 ranks on this host" in err and "--stream-layers" in err, err


def test_verify_refuses_rank_files_larger_than_ram_before_any_model(src, tmp_path, monkeypatch, capsys):
    conv = tmp_path / "conv"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")
    assert code == 0, err
    monkeypatch.setattr(fits, "physical_memory", lambda: sum(_weights(src, 2)) - 1)
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference", str(src))
    assert code == 2, err
    assert "the model's weights need" in err and "2 ranks on this host" in err, err
    assert "--stream-layers" in err and "reference: " not in err, err  # refused before the reference is computed
