"""verify.streamed without running the model: the decode tokens it fixes, the prompts it refuses, and what the
streamed tp-1 replay feeds the streamed model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.model.stream_records import StreamResult
from dsv41_convert.verify import streamed
from dsv41_convert.verify.prompts import Prompt
from dsv41_convert.verify.runner import ModelInput, PromptRun


def test_decode_ids_must_cover_every_step_and_the_draft_start():
    """n decode steps feed n + 1 tokens (step t feeds decode_ids[t], the last starts the drafts): n given for n
    steps is refused; an empty prompt's default rule feeds token 0."""
    with pytest.raises(VerifyInputError, match=r"^p.jsonl:2: 3 decode_ids, 3 decode steps need 4"):
        streamed.fixed_decode_ids(Prompt((5, 6), "line-2", decode_ids=(9, 8, 7), origin="p.jsonl:2"), 3)
    assert streamed.fixed_decode_ids(Prompt((5, 6), "a", decode_ids=(9, 8, 7)), 2).tolist() == [9, 8, 7]
    assert streamed.fixed_decode_ids(Prompt((), "empty"), 2).tolist() == [0, 0, 0]


def test_decode_ids_no_step_feeds_are_warned():
    """decode_ids past the first n + 1, or any with --decode-steps 0, are never fed: the user is told, not left
    believing the reference ran them; exactly n + 1 is no warning."""
    assert streamed.unfed_decode_ids(Prompt((5,), "a", decode_ids=(1, 2, 3)), 2) is None
    assert streamed.unfed_decode_ids(Prompt((5,), "a", decode_ids=(1, 2, 3, 4)), 2) == (
        "a: 4 decode_ids, 2 decode steps feed the first 3 (--decode-steps 3 feeds them all)"
    )
    assert streamed.unfed_decode_ids(Prompt((5,), "a", decode_ids=(1,)), 0) == (
        "a: 1 decode_ids, but --decode-steps 0 feeds none of them"
    )


def test_a_prompt_shorter_than_the_largest_compress_ratio_of_the_main_layers_is_refused():
    """The largest compress ratio among the n_layers main layers (the last one included; the MTP stages' entries
    after them not) is the shortest prompt the streamed model can run."""
    args = SimpleNamespace(compress_ratios=(0, 2, 4, 0, 8), n_layers=3)
    inputs = [ModelInput(torch.arange(4)), ModelInput(torch.arange(7)), ModelInput(torch.arange(3))]
    streamed._long_enough(["a", "b"], inputs[:2], args, "")
    with pytest.raises(VerifyInputError, match=r"^c: a 3-token prompt: streaming needs 4 tokens \(the largest"):
        streamed._long_enough(["a", "b", "c"], inputs, args, "")


def _replay(monkeypatch, decode: list[torch.Tensor], n_decode: int, hidden: bool) -> dict:
    """replay_streamed over a reference of one 5-token prompt per `decode`, the streamed model replaced by a
    recorder of what it is fed; -> what it was fed."""
    fed = {}

    def run_streamed(args, weights, prompts, tokenizer, capture, device, progress):
        fed.update(prompts=prompts, capture=capture)
        v = 3
        return [StreamResult(torch.zeros(5, v), torch.zeros(v), torch.zeros(len(p.decode_ids) - 1, v), None)
                for p in prompts], []  # fmt: skip

    monkeypatch.setattr(streamed, "run_streamed", run_streamed)
    monkeypatch.setattr(streamed, "fit_merged", lambda ranks, args: None)
    monkeypatch.setattr(streamed, "require_caches_fit", lambda args, device, config, drafted: None)
    monkeypatch.setattr(streamed.RankWeights, "over", staticmethod(lambda ranks: "weights"))
    args = SimpleNamespace(compress_ratios=(0, 2), n_layers=2, n_mtp_layers=0, with_runtime=lambda **_: args)
    ranks = SimpleNamespace(args=args, folder=streamed.Path("converted"))
    runs = [PromptRun(torch.zeros(5, 3), d, torch.zeros(0, 3), None, {"x": torch.zeros(1)} if hidden else {})
            for d in decode]  # fmt: skip
    ref = SimpleNamespace(max_seq_len=32, inputs=[ModelInput(torch.arange(5)) for _ in decode], runs=runs,
                          labels=[f"p{i}" for i in range(len(decode))], n_decode=n_decode)  # fmt: skip
    fed["runs"] = streamed.replay_streamed(ranks, ref)
    return fed


def test_the_streamed_replay_feeds_the_references_decode_tokens_and_asks_for_its_hidden_states(monkeypatch):
    """n decode steps feed the reference's first n + 1 decode tokens (the last starts the drafts); a reference
    that recorded hidden states gets them captured again, to be compared."""
    fed = _replay(monkeypatch, [torch.tensor([4, 3, 2, 1])], 2, hidden=True)
    assert fed["prompts"][0].decode_ids.tolist() == [4, 3, 2]
    assert fed["capture"] is True
    assert fed["runs"][0].decode_ids.tolist() == [4, 3, 2, 1]
    assert _replay(monkeypatch, [torch.tensor([4, 3, 2])], 2, hidden=False)["capture"] is False


def test_a_reference_short_of_decode_tokens_is_refused_by_the_streamed_replay(monkeypatch):
    with pytest.raises(VerifyInputError, match=r"^prompt p1: the reference records 2 decode tokens for 2 decode"):
        _replay(monkeypatch, [torch.tensor([4, 3, 2]), torch.tensor([4, 3])], 2, hidden=False)
