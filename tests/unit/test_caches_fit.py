"""verify.fits: the model's caches are sized from the config before a model allocates them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from model_testing import tiny_args

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.memory import cache_bytes
from dsv41_convert.errors import ConfigError, VerifyInputError
from dsv41_convert.synth.presets import TINY, hf_config
from dsv41_convert.verify import fits
from dsv41_convert.verify.runner import shortest_drafted


def _config(tmp_path: Path, nested: bool) -> Path:
    path = tmp_path / "config.json"
    path.write_text('{"text_config": {}}' if nested else "{}")
    return path


@pytest.mark.parametrize("nested", [True, False])
def test_caches_that_fit_pass_and_one_byte_more_is_refused(tmp_path, monkeypatch, nested):
    """At exactly the caches' bytes the model is built; one byte less memory and the positions are named with
    the numbers (the config was blamed for a --max-seq-len of 4e8: an audit); a window that does not alone
    exceed the memory is not blamed."""
    args = tiny_args().with_runtime(max_batch_size=2, max_seq_len=64, temperature=0.0)
    need = cache_bytes(args, 2, 64)
    config = _config(tmp_path, nested)
    monkeypatch.setattr(fits, "machine_bytes", lambda _device: need)
    fits.require_caches_fit(args, "cpu", config)
    monkeypatch.setattr(fits, "machine_bytes", lambda _device: need - 1)
    said = r"^the model's caches need .* at batch 2 and 64 positions \(--max-seq-len, or the reference file's\)"
    with pytest.raises(VerifyInputError, match=said):  # the positions, not the file, are what is too large
        fits.require_caches_fit(args, "cpu", config)


@pytest.mark.parametrize(("nested", "key"), [(True, "text_config.sliding_window"), (False, "window_size")])
def test_a_window_alone_too_large_is_named_by_its_key(tmp_path, nested, key):
    args = tiny_args(window_size=10**12).with_runtime(max_batch_size=1, max_seq_len=64, temperature=0.0)
    with pytest.raises(ConfigError, match=rf"{key} = 1000000000000: its KV rings alone"):
        fits.require_caches_fit(args, "cpu", _config(tmp_path, nested))


@pytest.mark.parametrize(("nested", "key"), [(True, "text_config.dspark_block_size"), (False, "dspark_block_size")])
def test_a_draft_block_alone_too_large_is_named_by_its_key(tmp_path, monkeypatch, nested, key):
    """A config without a YaRN context (no positions bound) and a dspark_block_size of 10**9: the run's length
    is the drafts', and the refusal blamed "--max-seq-len" that no one gave (a carried item, 2026-12-07). Where
    the shortest run with drafts (a 1-token prompt, one decode step, the block) alone cannot fit, the key is
    named; a length the block does not make is still the positions' to fix."""
    staged = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405, vision=False))  # make-tiny's stages
    args = dataclasses.replace(staged, dspark_block_size=10**9).with_runtime(max_batch_size=1, max_seq_len=10**9 + 64)
    monkeypatch.setattr(fits, "machine_bytes", lambda _device: 1 << 30)
    # the way out fits verify too, which runs its reference file's decode steps (it said only "--decode-steps 0")
    said = rf"{key} = 1000000000: the DSpark drafts after a decode step .*--decode-steps 0; verify --reference-logits"
    with pytest.raises(ConfigError, match=said):
        fits.require_caches_fit(args, "cpu", _config(tmp_path, nested), shortest_drafted(args))
    args = staged.with_runtime(max_batch_size=1, max_seq_len=10**9 + 64)  # a block of 5
    with pytest.raises(VerifyInputError, match=r"--max-seq-len, or the reference file's"):
        fits.require_caches_fit(args, "cpu", _config(tmp_path, nested), shortest_drafted(args))
    assert shortest_drafted(args) == 7 and shortest_drafted(tiny_args()) == 0  # no stages, no drafts


def test_a_run_built_with_a_draft_block_alone_too_large_names_it(tmp_path, monkeypatch):
    """build_model, where verify's ranks and reference-logits ask, passes the drafts' positions."""
    from dsv41_convert.verify.runner import build_model

    staged = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405, vision=False))
    args = dataclasses.replace(staged, dspark_block_size=10**9).with_runtime(max_batch_size=1, max_seq_len=10**9 + 64)
    monkeypatch.setattr(fits, "machine_bytes", lambda _device: 1 << 30)
    _config(tmp_path, True)
    with pytest.raises(ConfigError, match=r"text_config.dspark_block_size = 1000000000"):
        build_model(args, tmp_path, "cpu")


def test_the_card_is_asked_too(tmp_path, monkeypatch):
    """A model run on a card is built on the host first: both memories are asked, the one short is named."""
    args = tiny_args().with_runtime(max_batch_size=1, max_seq_len=64, temperature=0.0)
    sizes = {"cpu": 1 << 40, "cuda": 1}
    monkeypatch.setattr(fits, "machine_bytes", lambda device: sizes[device])
    with pytest.raises(ConfigError, match="more than all of cuda's memory"):
        fits.require_caches_fit(args, "cuda", _config(tmp_path, True))


def test_a_model_moved_to_the_card_after_loading_is_checked_against_the_card(tmp_path, monkeypatch):
    """verify's ranks and reference-logits build the model on the host and move it to the card once loaded:
    only the host's memory was asked (an audit)."""
    from dsv41_convert.verify.runner import build_model

    args = tiny_args().with_runtime(max_batch_size=1, max_seq_len=64, temperature=0.0)
    sizes = {"cpu": 1 << 40, "cuda": cache_bytes(args, 1, 64) - 1}
    monkeypatch.setattr(fits, "machine_bytes", lambda device: sizes[device])
    _config(tmp_path, True)
    with pytest.raises(VerifyInputError, match="more than all of cuda's memory"):
        build_model(args, tmp_path, "cpu", runs_on="cuda")


@pytest.mark.parametrize(("world", "local", "sharing"), [(4, None, 4), (8, "2", 2), (1, None, 1)])
def test_the_ranks_on_one_host_are_added_up(tmp_path, monkeypatch, world, local, sharing):
    """verify's tp ranks each build their caches in the host's memory at once (a torchrun launch: its
    LOCAL_WORLD_SIZE of them): the check asked for one process's caches (a known gap until 2026-12-05)."""
    from dsv41_convert.model import parallel

    args = tiny_args().with_runtime(max_batch_size=1, max_seq_len=64, temperature=0.0)
    each = cache_bytes(args, 1, 64)
    monkeypatch.setattr(parallel, "world_size", lambda: world)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if local is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    monkeypatch.setattr(fits, "machine_bytes", lambda _device: each * sharing)
    fits.require_caches_fit(args, "cpu", _config(tmp_path, True))
    monkeypatch.setattr(fits, "machine_bytes", lambda _device: each * sharing - 1)
    said = f"{sharing} processes on this host" if sharing > 1 else "need"
    with pytest.raises(VerifyInputError, match=said):
        fits.require_caches_fit(args, "cpu", _config(tmp_path, True))


def test_a_card_holds_one_ranks_caches_and_the_host_those_of_every_rank(tmp_path, monkeypatch):
    """tp 4 ranks on one host, each on its own card: the host builds all four ranks' caches, a card holds one
    rank's. A card with room for exactly one passes; the host is asked too, and named when it is short."""
    from dsv41_convert.model import parallel

    args = tiny_args().with_runtime(max_batch_size=1, max_seq_len=64, temperature=0.0)
    each = cache_bytes(args, 1, 64)
    monkeypatch.setattr(parallel, "world_size", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    sizes = {"cpu": 4 * each, "cuda": each}
    monkeypatch.setattr(fits, "machine_bytes", lambda device: sizes[device])
    fits.require_caches_fit(args, "cuda", _config(tmp_path, True))
    sizes.update(cpu=4 * each - 1, cuda=1 << 50)
    with pytest.raises(VerifyInputError, match=r"more than all of cpu's memory.* or fewer ranks on this host$"):
        fits.require_caches_fit(args, "cuda", _config(tmp_path, True))


def test_the_window_rings_of_the_mtp_stages_count_toward_the_window_blamed(tmp_path, monkeypatch):
    """Every layer holds a window ring, the MTP stages' included (6 + 3 here): memory just short of
    all nine rings blames the config's window, naming the nine, though six alone would fit."""
    ratios = (*tiny_args().compress_ratios, 0, 0, 0)  # the MTP stages' own entries
    args = tiny_args(window_size=4096, n_mtp_layers=3, compress_ratios=ratios)
    args = args.with_runtime(max_batch_size=1, max_seq_len=64, temperature=0.0)
    assert (args.n_layers, args.n_mtp_layers) == (6, 3)
    nine = 9 * args.window_size * args.head_dim * 2  # one bf16 row of head_dim per window position, per ring
    monkeypatch.setattr(fits, "machine_bytes", lambda _device: nine - 1)
    with pytest.raises(ConfigError, match=r"its KV rings alone are .* \(9 rings: a layer's each, at batch 1\)"):
        fits.require_caches_fit(args, "cpu", _config(tmp_path, False))
