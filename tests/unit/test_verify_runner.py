"""runner.run_prompt's decode loop, on a stand-in model that records what it is fed: each step feeds the next
token of the teacher (or the model's own greedy choice) at the next position, n_decode steps, and a teacher too
short for them is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsv41_convert.verify.runner import ModelInput, run_prompt

V = 16


class Recorder(nn.Module):
    """Logits whose argmax is (last fed token + start position + 1) % V; records (tokens, start) of each call."""

    def __init__(self, stages: int = 0):
        super().__init__()
        self.mtp = nn.ModuleList(nn.Identity() for _ in range(stages))
        self.calls: list[tuple[list[int], int]] = []
        self.spec: list[tuple[int, int]] = []

    @staticmethod
    def _logits(ids: torch.Tensor, start: int) -> torch.Tensor:
        pos = start + torch.arange(ids.shape[1])
        return nn.functional.one_hot((ids[0] + pos + 1) % V, V).float()  # [S, V]

    def forward(self, ids, start, images=None, types=None, all_logits=False, hidden_states=None):
        self.calls.append((ids[0].tolist(), start))
        logits = self._logits(ids, start)
        if hidden_states is not None:
            hidden_states["norm"] = logits[None]
        return None, logits[None] if all_logits else logits[-1:], logits[None]

    def head(self, h, full_logits=False):
        return h[:, -1]

    def forward_spec(self, tok, main_hidden, start):
        self.spec.append((int(tok), start))
        return None, torch.zeros(1, 2, V), torch.zeros(1, 2)


PROMPT = ModelInput(torch.tensor([3, 1, 4, 1], dtype=torch.int64))


def test_teacher_forced_steps_feed_the_next_teacher_token_at_the_next_position():
    model = Recorder()
    teacher = torch.tensor([7, 9, 2, 5])
    run = run_prompt(model, PROMPT, 3, teacher)
    assert model.calls == [([3, 1, 4, 1], 0), ([7], 4), ([9], 5), ([2], 6)]
    assert run.decode_ids.tolist() == [7, 9, 2, 5]
    assert run.decode_logits.shape == (3, V)
    assert run.decode_logits.argmax(-1).tolist() == [(7 + 4 + 1) % V, (9 + 5 + 1) % V, (2 + 6 + 1) % V]


def test_greedy_steps_feed_the_model_own_choice():
    model = Recorder()
    run = run_prompt(model, PROMPT, 2)
    first = (1 + 3 + 1) % V  # the last prompt token at position 3
    second = (first + 4 + 1) % V
    assert model.calls[1:] == [([first], 4), ([second], 5)]
    assert run.decode_ids.tolist() == [first, second, (second + 5 + 1) % V]


def test_drafts_follow_each_step_from_the_token_it_chose():
    model = Recorder(stages=1)
    run = run_prompt(model, PROMPT, 2, torch.tensor([7, 9, 2]))
    assert model.spec == [(7, 0), (9, 4), (2, 5)]  # the seed, then after each step
    assert run.draft_logits.shape == (2, 2, V)


def test_a_teacher_one_token_short_is_refused():
    with pytest.raises(ValueError, match="teacher holds 3 tokens, 3 decode steps feed 4"):
        run_prompt(Recorder(), PROMPT, 3, torch.tensor([7, 9, 2]))
