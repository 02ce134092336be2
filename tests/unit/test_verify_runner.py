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


def test_a_recorded_image_span_of_another_grid_is_refused_naming_the_image(tmp_path):
    """attach_images: a reference file whose token_types hold an image span of another grid than this model cuts
    the image into (the reference ran other vision settings: an older file without provenance, or another
    implementation's) is refused naming the image; it was a rank's RuntimeError "shape mismatch" traceback (exit 1)
    where the span was as long as this model's or longer."""
    from PIL import Image

    from dsv41_convert.config import ModelArgs
    from dsv41_convert.errors import VerifyInputError
    from dsv41_convert.model.image_processor import IMAGE_END, image_token_types, load_image, num_image_tokens
    from dsv41_convert.synth.presets import TINY, hf_config
    from dsv41_convert.verify.runner import attach_images

    args = ModelArgs.from_hf_dict(hf_config(TINY, compressed_vocab_size=405))
    path = tmp_path / "a.png"
    Image.new("RGB", (200, 150), (10, 20, 30)).save(path)
    _, _, _, n_llm_h, n_llm_w = load_image(path, args)
    ours = image_token_types(n_llm_h, n_llm_w)

    def recorded(span: torch.Tensor) -> ModelInput:
        types = torch.cat([torch.full((3,), -1), span])
        ids = torch.cat([torch.tensor([5, 6, 7]), torch.full((span.numel(),), args.image_token_id)])
        return ModelInput(ids, types, None, str(path))

    assert attach_images(recorded(ours), args).images[0].types.tolist() == ours.tolist()  # this model's own span
    longer = image_token_types(n_llm_h + 1, n_llm_w)  # the reference's grid had one row more
    rows = next(h for h in range(1, 64) if h != n_llm_h and n_llm_h * (n_llm_w + 1) % h == 0)
    same_length = image_token_types(rows, n_llm_h * (n_llm_w + 1) // rows - 1)  # another grid, as long a span
    assert same_length.numel() == num_image_tokens(n_llm_h, n_llm_w) and not torch.equal(same_length, ours)
    assert longer[-1] == IMAGE_END
    for span in (longer, same_length):
        with pytest.raises(VerifyInputError, match=rf"image {path}: .*{n_llm_h}x{n_llm_w}"):
            attach_images(recorded(span), args)
