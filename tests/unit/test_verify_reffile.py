"""verify.reffile: the reference-logits file round-trips and rejects malformed files by name."""

import pytest
import torch
from safetensors.torch import save_file

from dsv41_convert.errors import VerifyInputError
from dsv41_convert.verify import reffile
from dsv41_convert.verify.runner import ModelInput, PromptRun


def _run(seq: int, vocab: int = 11, steps: int = 2, k: int = 3, seed: int = 0) -> PromptRun:
    g = torch.Generator().manual_seed(seed)
    return PromptRun(
        logits_all=torch.randn(seq, vocab, generator=g),
        decode_ids=torch.randint(0, vocab, (steps + 1,), generator=g),
        decode_logits=torch.randn(steps, vocab, generator=g),
        draft_logits=torch.randn(steps, k, vocab, generator=g),
        hidden={"embed": torch.randn(seq, 4, generator=g).bfloat16()},
        last=torch.randn(vocab, generator=g),
    )


def test_round_trip_with_prompts_of_different_lengths(tmp_path):
    inputs = [ModelInput(torch.arange(5)), ModelInput(torch.arange(3) + 7)]
    runs = [_run(5, seed=1), _run(3, seed=2)]
    ref = reffile.Reference(inputs, runs, ["a", "b"], 96, "fp8", "cpu")
    reffile.save(ref, tmp_path / "r.safetensors")
    back = reffile.load(tmp_path / "r.safetensors", 128)
    assert back.labels == ["a", "b"] and back.max_seq_len == 96 and back.source_format == "fp8"
    for want, got, inp_w, inp_g in zip(runs, back.runs, inputs, back.inputs, strict=True):
        assert torch.equal(inp_w.input_ids, inp_g.input_ids)
        for key in ("logits_all", "decode_ids", "decode_logits", "draft_logits", "last"):
            assert torch.equal(getattr(want, key), getattr(got, key)), key
        assert torch.equal(want.hidden["embed"], got.hidden["embed"])


def test_minimal_file_needs_only_ids_and_logits(tmp_path):
    save_file({"input_ids": torch.zeros(2, 4, dtype=torch.int64), "logits": torch.zeros(2, 9)}, str(tmp_path / "m"))
    back = reffile.load(tmp_path / "m", 128)
    assert not back.has_logits_all and back.n_decode == 0 and back.max_seq_len == 128
    assert back.runs[0].logits.shape == (9,)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"input_ids": torch.zeros(2, 4, dtype=torch.int64)}, r"no `logits` tensor"),
        ({"input_ids": torch.zeros(2, 4), "logits": torch.zeros(2, 9)}, r"input_ids is torch.float32"),
        ({"input_ids": torch.zeros(2, 4, dtype=torch.int64), "logits": torch.zeros(3, 9)}, r"3 rows"),
        (
            {"input_ids": torch.zeros(2, 4, dtype=torch.int64), "logits": torch.zeros(2, 9),
             "logits_all": torch.zeros(2, 5, 9)},
            r"logits_all has shape \[2, 5, 9\], expected \[2, 4, 9\]",
        ),
        (
            {"input_ids": torch.zeros(2, 4, dtype=torch.int64), "logits": torch.zeros(2, 9),
             "decode_logits": torch.zeros(2, 1, 9)},
            r"without decode_ids",
        ),
    ],
)  # fmt: skip
def test_malformed_files_are_input_errors(tmp_path, tensors, match):
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(VerifyInputError, match=match):
        reffile.load(tmp_path / "bad.safetensors", 128)


def test_not_safetensors(tmp_path):
    (tmp_path / "x").write_bytes(b"hello")
    with pytest.raises(VerifyInputError, match="not a readable safetensors file"):
        reffile.load(tmp_path / "x", 128)


def test_what_decides_bit_equality_round_trips(tmp_path):
    ref = reffile.Reference([ModelInput(torch.arange(5))], [_run(5)], ["a"], 96, "bf16", "cuda")
    ref.tp, ref.threads, ref.torch_version, ref.weights = 4, 3, "2.13.0", "converted"
    reffile.save(ref, tmp_path / "r.safetensors")
    back = reffile.load(tmp_path / "r.safetensors", 128)
    assert (back.tp, back.threads, back.torch_version, back.weights) == (4, 3, "2.13.0", "converted")
    assert back.device == "cuda"


@pytest.mark.parametrize(("source_format", "weights"), [("fp8", "converted"), ("bf16", "bf16"), (None, "")])
def test_unrecorded_fields_are_unknown(tmp_path, source_format, weights):
    meta = {"source_format": source_format} if source_format else {}
    save_file(
        {"input_ids": torch.zeros(1, 4, dtype=torch.int64), "logits": torch.zeros(1, 9)}, str(tmp_path / "m"), meta
    )
    back = reffile.load(tmp_path / "m", 128)
    assert (back.tp, back.threads, back.torch_version, back.weights) == (1, 0, "", weights)


def test_bad_tp_metadata_is_named(tmp_path):
    save_file({"input_ids": torch.zeros(1, 4, dtype=torch.int64), "logits": torch.zeros(1, 9)}, str(tmp_path / "m"),
              {"tp": "two"})  # fmt: skip
    with pytest.raises(VerifyInputError, match=r"metadata tp 'two' is not an integer"):
        reffile.load(tmp_path / "m", 128)
