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
    from dsv41_convert.convert.memory import reference_weights

    ((state, model),) = reference_weights(build_plan(src, 1), load_model_args(src / "config.json"))
    need = state + model  # the rank file computed in memory and the model, whole at once
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


@pytest.fixture(scope="module")
def bf16_src(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("weights16") / "src", quantized=False)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("unquantized", [True, False])
def test_a_reference_ranks_figures_are_the_state_and_the_model_it_holds(bf16_src, unquantized):
    """memory.reference_weights: a reference rank's state dict (plan_state) and the model it is copied into, byte
    for byte: a bf16 source run unquantized holds its quantizing weights bf16 (no scales) in both."""
    from dsv41_convert.config import ModelArgs
    from dsv41_convert.convert.memory import rank_weights, reference_weights
    from dsv41_convert.model.load import expected_tensors
    from dsv41_convert.model.transformer import Transformer
    from dsv41_convert.verify.source import plan_state

    plan = build_plan(bf16_src, 1)
    src_args = load_model_args(bf16_src / "config.json")
    args = src_args if unquantized else ModelArgs.from_inference_dict(plan.inference_config)
    ((state, model),) = reference_weights(plan, src_args, unquantized)
    assert state == _bytes(plan_state(plan, skip_quant=unquantized).values())
    built = Transformer(args.with_runtime(max_batch_size=1, max_seq_len=128), bf16_src / "tokenizer.json")
    assert model == _bytes(p for p, _ in expected_tensors(built).values())
    if unquantized:  # plan's figure is the quantized model's: less than either half
        assert rank_weights(plan, src_args)[0] < min(state, model)
    plan2 = build_plan(bf16_src, 2)
    for rank, (state, _) in enumerate(reference_weights(plan2, src_args, unquantized)):
        assert state == _bytes(plan_state(plan2, rank, skip_quant=unquantized).values())


def test_a_bf16_source_run_unquantized_is_counted_with_its_state_in_bf16(bf16_src, tmp_path, monkeypatch, capsys):
    """reference-logits of a bf16 source (unquantized, the default) holds the bf16 state dict and the bf16 model
    at once: on a host short of that it was counted the quantized model's bytes (plan's figure) and started."""
    from dsv41_convert.convert.memory import reference_weights

    ((state, model),) = reference_weights(build_plan(bf16_src, 1), load_model_args(bf16_src / "config.json"), True)
    out = tmp_path / "ref.safetensors"
    monkeypatch.setattr(fits, "physical_memory", lambda: state + model - 1)
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(bf16_src), str(out))
    assert code == 2, err
    assert f"the model's weights need {(state + model) / fits.GIB:,.1f} GiB" in err, err
    assert "physical memory" in err and "--stream-layers" in err and "Traceback" not in err, err
    assert not out.exists()
    monkeypatch.setattr(fits, "physical_memory", lambda: state + model)
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(bf16_src), str(out))
    assert code == 0, err


def test_a_card_is_asked_for_the_model_only(monkeypatch):
    """The state dict stays on the host (the model is moved to the card once loaded): the card needs the model's
    bytes, the host both."""
    have = {"cpu": 100, "cuda:0": 60}
    monkeypatch.setattr(fits, "machine_bytes", lambda where: have[where])
    fits.require_weights_fit([90], "cuda:0", "SRC at tp 1", "--stream-layers", [50])
    with pytest.raises(fits.VerifyInputError, match=r"need 0\.0 GiB, more than all of cuda:0's memory"):
        fits.require_weights_fit([90], "cuda:0", "SRC at tp 1", "--stream-layers", [61])
    with pytest.raises(fits.VerifyInputError, match="physical memory"):
        fits.require_weights_fit([101], "cuda:0", "SRC at tp 1", "--stream-layers", [50])


def test_the_tp1_replay_is_asked_for_the_whole_model_and_its_merged_state(src, tmp_path, monkeypatch, capsys):
    """After a tp-2 run against a tp-1 file verify merges the rank files back to tp 1 and replays them in one
    process: the whole model and the merged state dict at once, more than the two ranks' models together; it was
    not asked for, and a host that held the ranks started it."""
    from dsv41_convert.convert.memory import model_bytes, tp1_tensors
    from dsv41_convert.store.safetensors_header import nbytes

    conv, ref = tmp_path / "conv", tmp_path / "ref.safetensors"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(src), str(ref))
    assert code == 0, err
    args = load_model_args(conv / "config.json")
    merged = [(name, dtype, nbytes(dtype, shape)) for name, dtype, shape in tp1_tensors(build_plan(src, 2))]
    replay = sum(size for _, _, size in merged) + model_bytes(merged, args)
    assert sum(_weights(src, 2)) < replay - 1  # the ranks fit, the replay does not
    monkeypatch.setattr(fits, "physical_memory", lambda: replay - 1)
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref))
    assert code == 2, err
    assert "merged back to tp 1 (the replay, after the tp-2 run, in one process): the model's weights need " in err
    assert f"{replay / fits.GIB:,.1f} GiB" in err and "physical memory" in err, err
    assert "--no-replay" in err and "--stream-layers" in err and "converted: " not in err, err  # before the ranks
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref), "--no-replay")
    assert code != 2 and "weights need" not in err, err
    monkeypatch.setattr(fits, "physical_memory", lambda: replay)
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref))
    assert code != 2 and "check replay: exact" in out, err  # tiny_ckpt's random model is chaotic: a FAIL at tp 2


def _torchrun(monkeypatch, rank: int, world: int, local_world: int, local_rank: int | None) -> None:
    """The environment torchrun gives one process of a launch over several hosts."""
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": local_world, "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(name, str(value))
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))


@pytest.mark.parametrize(
    ("rank", "local_rank", "refused"),
    [(2, 0, True), (3, 1, True), (0, 0, False), (1, 1, False), (0, None, True)],  # None: the largest counted
)
def test_a_host_of_a_multi_host_launch_counts_the_ranks_it_runs(monkeypatch, rank, local_rank, refused):
    """torchrun over two hosts, two ranks each: the host of ranks 2-3 holds 10 bytes, not the two smallest ranks'
    2 (which were counted on every host)."""
    _torchrun(monkeypatch, rank, 4, 2, local_rank)
    monkeypatch.setattr(fits, "physical_memory", lambda: 9)
    if not refused:
        fits.require_weights_fit([1, 1, 5, 5], "cpu", "SRC at tp 4", "--stream-layers")
        return
    which = "ranks 2-3 of 4" if local_rank is not None else "the largest 2 of 4, LOCAL_RANK unset"
    with pytest.raises(fits.VerifyInputError, match=f"need 0.0 GiB \\(2 ranks on this host: {which},"):
        fits.require_weights_fit([1, 1, 5, 5], "cpu", "SRC at tp 4", "--stream-layers")


def test_reference_logits_under_a_multi_host_launch_names_the_ranks_of_this_host(src, tmp_path, monkeypatch, capsys):
    """reference-logits --tp 2 under torchrun on two hosts, one rank each: the host of rank 1 is asked for rank 1's
    weights, and the message says which rank it counted (a valid conversion's ranks are of one size: the message
    is what shows it)."""
    from dsv41_convert.convert.memory import reference_weights
    from dsv41_convert.verify import reference

    figures = reference_weights(build_plan(src, 2), load_model_args(src / "config.json"))
    held = [state + model for state, model in figures]
    monkeypatch.setattr(fits, "physical_memory", lambda: held[1] - 1)
    monkeypatch.setattr(reference, "launch", lambda *a, **k: pytest.fail("the ranks started"))
    _torchrun(monkeypatch, 1, 2, 1, 0)
    code, _, err = run_cli(
        monkeypatch, capsys, "reference-logits", str(src), str(tmp_path / "ref.safetensors"), "--tp", "2"
    )
    assert code == 2, err
    assert f"at tp 2: the model's weights need {held[1] / fits.GIB:,.1f} GiB (1 rank on this host: rank 1 of 2)" in err
    assert "--stream-layers" in err and "physical memory" in err, err


def test_verify_reference_src_under_a_launch_counts_the_reference_of_each_process_of_this_host(
    src, tmp_path, monkeypatch, capsys
):
    """Under torchrun every process of `verify --reference SRC` computes the whole tp-1 reference (its state and its
    model) before the ranks join: a host of two processes holds two. It was asked for one (the caches of that model
    were already counted for every process), so a host that held one started both and met the allocator."""
    from dsv41_convert.convert.memory import reference_weights
    from dsv41_convert.verify import reference

    conv = tmp_path / "conv"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")
    assert code == 0, err
    ((state, model),) = reference_weights(build_plan(src, 1), load_model_args(src / "config.json"))
    assert sum(_weights(src, 2)) < state + model  # the ranks' figure fits: the references are what is refused
    monkeypatch.setattr(fits, "physical_memory", lambda: 2 * (state + model) - 1)
    monkeypatch.setattr(reference, "reference_state", lambda *a, **k: pytest.fail("the reference was computed"))
    _torchrun(monkeypatch, 0, 2, 2, 0)
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference", str(src))
    assert code == 2, err
    assert f"the model's weights need {2 * (state + model) / fits.GIB:,.1f} GiB" in err, err
    assert "each of the 2 processes on this host" in err and "physical memory" in err, err


def test_verify_reference_src_counts_its_ranks_beside_the_reference_it_keeps(src, tmp_path, monkeypatch, capsys):
    """`verify --reference SRC` keeps the tp-1 reference's state (and the twin, the same tensors here: an fp8 source,
    fp4 experts) while its ranks run: the ranks were asked for alone and the reference alone, so a host holding either
    but not both passed, and met the allocator (make-tiny --preset medium at tp 2 on a 23 GiB host: SIGKILL). Here a
    host one byte short of the reference's state and the ranks' weights, which both old checks passed."""
    from dsv41_convert.convert.memory import reference_weights
    from dsv41_convert.verify import reference, run

    conv = tmp_path / "conv"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")
    assert code == 0, err
    ((state, model),) = reference_weights(build_plan(src, 1), load_model_args(src / "config.json"))
    host = state + sum(_weights(src, 2)) - 1
    assert host >= max(state + model, sum(_weights(src, 2)))  # each alone fits
    monkeypatch.setattr(fits, "physical_memory", lambda: host)
    monkeypatch.setattr(run, "memory_backed", lambda path: False)  # the ranks' payload file in the page cache
    monkeypatch.setattr(reference, "reference_state", lambda *a, **k: pytest.fail("the reference was computed"))
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference", str(src))
    assert code == 2, err
    assert f"{conv} at tp 2 beside the tp-1 reference of {src} and the twin: the model's weights need" in err, err
    assert f"{state / fits.GIB:,.1f} GiB beside them" in err and f"`reference-logits {src} FILE` once" in err, err


@pytest.mark.parametrize("launched", [False, True])
def test_verify_reference_src_asks_each_card_for_its_model_alone(src, tmp_path, monkeypatch, capsys, launched):
    """`verify --reference SRC` on cuda: a rank moves its model to its card; the twin's pieces it copies as it cuts
    them, and (under torchrun) the reference and twin its process keeps, stay in the host's memory. They were
    counted on the card too, so a card that holds the rank's model was refused ("more than all of cuda's memory ...
    or a larger card"): under torchrun by the whole tp-1 reference and twin."""
    from dsv41_convert.convert.unshard import RankFiles
    from dsv41_convert.verify import run
    from dsv41_convert.verify.source import reference_plan

    conv = tmp_path / "conv"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")[0] == 0
    if launched:
        _torchrun(monkeypatch, 0, 2, 2, 0)
    card = max(_weights(src, 2))  # plan's figure: the model each rank moves onto its card
    monkeypatch.setattr(fits, "machine_bytes", lambda where: 1 << 50 if where == "cpu" else card)
    opts = run.VerifyOptions(conv, reference=src, device="cuda")
    with RankFiles(conv, None) as ranks:
        run._ranks_fit(opts, ranks, load_model_args(conv / "config.json"), reference=reference_plan(src))
        monkeypatch.setattr(fits, "machine_bytes", lambda where: 1 << 50 if where == "cpu" else card - 1)
        with pytest.raises(fits.VerifyInputError, match=r"more than all of cuda's memory"):
            run._ranks_fit(opts, ranks, load_model_args(conv / "config.json"), reference=reference_plan(src))


def test_verify_reference_src_at_tp1_counts_no_copies_of_the_twin(src, tmp_path, monkeypatch, capsys):
    """At tp 1 every piece of the twin is the twin's own tensor (verify.twin.cut: the rank's shape is the whole
    one), but the column-split tensors were counted as copies, so a host that held the run was refused and the
    refusal's figure was not the model's weights (plan --tp 1) and the reference's state beside them."""
    from dsv41_convert.convert.memory import reference_weights
    from dsv41_convert.convert.unshard import RankFiles
    from dsv41_convert.verify import run
    from dsv41_convert.verify.source import reference_plan

    conv = tmp_path / "conv"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "1")[0] == 0
    ((state, _model),) = reference_weights(build_plan(src, 1), load_model_args(src / "config.json"))
    need = sum(_weights(src, 1)) + state  # the model; the reference's state, which is the twin (fp4 experts)
    opts = run.VerifyOptions(conv, reference=src)
    with RankFiles(conv, None) as ranks:
        monkeypatch.setattr(fits, "physical_memory", lambda: need)
        run._ranks_fit(opts, ranks, load_model_args(conv / "config.json"), reference=reference_plan(src))
        monkeypatch.setattr(fits, "physical_memory", lambda: need - 1)
        with pytest.raises(fits.VerifyInputError, match=f"need {need / fits.GIB:,.1f} GiB"):
            run._ranks_fit(opts, ranks, load_model_args(conv / "config.json"), reference=reference_plan(src))


@pytest.mark.parametrize("in_memory", [False, True], ids=["disk", "tmpfs"])
def test_the_ranks_payload_counts_where_the_temporary_folder_is_held_in_memory(
    src, tmp_path, monkeypatch, capsys, in_memory
):
    """The spawned ranks map the twin from a file in the temporary folder (launch's payload): on a disk its pages are
    the page cache's, dropped and read again under pressure; on a tmpfs (a common /tmp) the file takes the host's
    memory as a process does, one twin more (a helper's reading), and was not counted."""
    from dsv41_convert.convert.memory import reference_weights
    from dsv41_convert.convert.unshard import RankFiles
    from dsv41_convert.verify import run
    from dsv41_convert.verify.source import reference_plan

    conv = tmp_path / "conv"
    assert run_cli(monkeypatch, capsys, "shard", str(src), str(conv), "--tp", "2")[0] == 0
    ((state, _model),) = reference_weights(build_plan(src, 1), load_model_args(src / "config.json"))
    monkeypatch.setattr(run, "memory_backed", lambda path: in_memory)
    opts, args = run.VerifyOptions(conv, reference=src), load_model_args(conv / "config.json")
    with RankFiles(conv, None) as ranks:
        merges = run._merges(ranks)
        copies = sum(run._cut_copies(h, r, merges) for r, h in enumerate(ranks.headers))
        need = sum(_weights(src, 2)) + copies + state + (state if in_memory else 0)  # the twin is the state here
        monkeypatch.setattr(fits, "physical_memory", lambda: need)
        run._ranks_fit(opts, ranks, args, reference=reference_plan(src))
        monkeypatch.setattr(fits, "physical_memory", lambda: need - 1)
        with pytest.raises(fits.VerifyInputError, match="beside the tp-1 reference"):
            run._ranks_fit(opts, ranks, args, reference=reference_plan(src))
