"""verify.reffile: the reference-logits file round-trips and rejects malformed files by name."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("short_first", [False, True], ids=["short-last", "short-first"])
def test_a_prompt_too_short_for_an_indexer_keeps_the_others_indexer_choices(tmp_path, short_first):
    """A prompt shorter than the compress ratio runs no indexer, so its run records no `layers.i.attn.indexer`
    (teacher.required_keys asks for none). The file's hidden states were those of the first prompt's keys: with
    the short prompt last, `reference-logits --prompts` died with `KeyError: 'layers.1.attn.indexer'` (exit 1,
    a traceback, nothing written); with it first, the other prompts' indexer choices were dropped without a
    word, so the teacher check could not apply. Every prompt's record is kept; the short one stays without it."""
    chosen = torch.tensor([[0, -1], [1, 0], [1, 2], [0, 2]])  # [S, k] int64, 4 positions, the model's rows
    runs = [_run(4, seed=1), _run(1, seed=2)]
    runs[0].hidden["layers.1.attn.indexer"] = chosen
    inputs = [ModelInput(torch.arange(4)), ModelInput(torch.arange(1) + 7)]
    if short_first:
        runs, inputs = runs[::-1], inputs[::-1]
    reffile.save(reffile.Reference(inputs, runs, ["a", "b"], 96, "fp8", "cpu"), tmp_path / "r.safetensors")
    back = reffile.load(tmp_path / "r.safetensors", 128)
    for want, got in zip(runs, back.runs, strict=True):
        assert sorted(got.hidden) == sorted(want.hidden)
        for key, value in want.hidden.items():
            assert torch.equal(got.hidden[key], value), key


def test_a_file_in_a_folder_whose_name_is_not_utf8_loads(tmp_path):
    """Linux names are bytes: safetensors opens a path only as UTF-8 text, so verify refused a reference file in
    a folder named b"bad\\xffname" ("not a readable safetensors file (Path ... is not valid UTF-8)"), exit 2,
    though reference-logits had written it there."""
    folder = tmp_path / os.fsdecode(b"bad\xffname")
    inputs, runs = [ModelInput(torch.arange(5))], [_run(5, seed=3)]
    reffile.save(reffile.Reference(inputs, runs, ["a"], 96, "fp8", "cpu"), folder / "r.safetensors")
    assert reffile.validate_reference_file(folder / "r.safetensors") == []
    back = reffile.load(folder / "r.safetensors", 128)
    assert back.labels == ["a"] and back.max_seq_len == 96 and back.source_format == "fp8"
    assert torch.equal(back.inputs[0].input_ids, torch.arange(5))
    assert torch.equal(back.runs[0].logits_all, runs[0].logits_all)


def test_saving_twice_in_two_processes_gives_the_same_bytes(tmp_path):
    script = (
        "import sys, torch;"
        "from dsv41_convert.verify import reffile;"
        "from dsv41_convert.verify.runner import ModelInput;"
        "sys.path.insert(0, sys.argv[2]);"
        "from test_verify_reffile import _run;"
        "ref = reffile.Reference([ModelInput(torch.arange(5))], [_run(5)], ['a'], 96, 'fp8', 'cpu');"
        "reffile.save(ref, sys.argv[1])"
    )
    here = str(Path(__file__).parent)
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name), here], check=True)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert not list(tmp_path.glob("*.partial"))


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


def test_a_folder_or_a_loop_of_links_is_named_for_what_it_is(tmp_path):
    """A folder was "not a readable safetensors file (No such device (os error 19))", a link loop "No such file
    or directory" (an audit)."""
    (tmp_path / "ref").mkdir()
    with pytest.raises(VerifyInputError, match=r"ref: not a regular file \(a folder\)"):
        reffile.load(tmp_path / "ref", 128)
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(VerifyInputError, match=r"a: not a regular file \(a link that leads in a loop\)"):
        reffile.load(tmp_path / "a", 128)
    (tmp_path / "c").symlink_to(tmp_path / "gone")
    with pytest.raises(VerifyInputError, match=r"c: not a regular file \(a link that leads to no file"):
        reffile.load(tmp_path / "c", 128)
    with pytest.raises(VerifyInputError, match=r"d: not a readable safetensors file \(No such file"):
        reffile.load(tmp_path / "d", 128)  # nothing there: the reader's own words


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


@pytest.mark.parametrize(
    ("meta", "match"),
    [({"tp": "two"}, r"metadata tp 'two': expected an integer >= 1"), ({"tp": "0"}, r"metadata tp '0'"),
     ({"threads": "-1"}, r"metadata threads '-1'"), ({"weights": "fp8"}, r"metadata weights 'fp8'")],
)  # fmt: skip
def test_bad_bit_equality_metadata_is_named(tmp_path, meta, match):
    save_file({"input_ids": torch.zeros(1, 4, dtype=torch.int64), "logits": torch.zeros(1, 9)}, str(tmp_path / "m"),
              meta)  # fmt: skip
    with pytest.raises(VerifyInputError, match=match):
        reffile.load(tmp_path / "m", 128)


# --- validate_reference_file: one planted damage per rule, on a valid file of the layout -------------------

B, S, T = 2, 5, 2


def _args():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_ckpt import tiny_config

    from dsv41_convert.config import ModelArgs

    return ModelArgs.from_hf_dict(tiny_config())  # vocab 256, DSpark block 5, 2 MTP stages


def _valid(args) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A file of every tensor: 2 prompts (5 and 3 tokens), 2 decode steps, drafts, one hidden state."""
    v, k = args.vocab_size, args.dspark_block_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (B, S), generator=g)
    ids[1, 3:] = reffile.PAD_ID
    tensors = {
        "input_ids": ids,
        "lengths": torch.tensor([5, 3]),
        "logits": torch.randn(B, v, generator=g),
        "logits_all": torch.randn(B, S, v, generator=g),
        "decode_ids": torch.randint(0, v, (B, T + 1), generator=g),
        "decode_logits": torch.randn(B, T, v, generator=g),
        "draft_logits": torch.randn(B, T, k, v, generator=g),
        "token_types": torch.full((B, S), -1),
        "hidden.embed": torch.randn(B, S, args.dim, generator=g).bfloat16(),
    }
    meta = {"format": reffile.FORMAT, "max_seq_len": "64", "labels": '["a", "b"]', "images": '["", ""]'}
    return tensors, meta


def _problems(tmp_path, change=None, args=None):
    args = args or _args()
    tensors, meta = _valid(args)
    if change is not None:
        change(tensors, meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"), metadata=meta)
    return reffile.validate_reference_file(tmp_path / "ref.safetensors", args)


def test_the_valid_file_has_no_problems_and_loads(tmp_path):
    assert _problems(tmp_path) == []
    ref = reffile.load(tmp_path / "ref.safetensors", 128, _args())
    assert [len(i.input_ids) for i in ref.inputs] == [5, 3] and ref.n_decode == T and ref.max_seq_len == 64


def _set(key, value):
    return lambda t, m: t.__setitem__(key, value(t))


V = 256
DAMAGES = {
    # dtypes and shapes of every tensor
    "input_ids float": (_set("input_ids", lambda t: t["input_ids"].float()), "input_ids is torch.float32"),
    "logits bf16": (_set("logits", lambda t: t["logits"].bfloat16()), "logits is torch.bfloat16 [2, 256], expected"),
    "unknown tensor": (_set("extra", lambda t: torch.zeros(1)), "extra: not a tensor of this format"),
    "hidden fp32": (_set("hidden.embed", lambda t: t["hidden.embed"].float()), "hidden.embed is torch.float32"),
    "hidden rows": (_set("hidden.embed", lambda t: t["hidden.embed"][:1]), "hidden.embed has shape [1, 5, 64]"),
    "logits rows": (_set("logits", lambda t: t["logits"][:1]), "logits has 1 rows, input_ids 2"),
    "logits_all positions": (
        _set("logits_all", lambda t: t["logits_all"][:, :4]),
        "logits_all has shape [2, 4, 256], expected [2, 5, 256] = [B, S, V] (B = 2 from input_ids [2, 5] = [B, S]",
    ),
    "token_types shape": (_set("token_types", lambda t: t["token_types"][:, :2]), "token_types has shape [2, 2]"),
    "lengths shape": (_set("lengths", lambda t: t["lengths"][:1]), "lengths has shape [1], expected [2] = [B]"),
    # the case: decode_logits [B, V]; T follows from decode_ids and the message says so
    "decode_logits [B, V]": (
        _set("decode_logits", lambda t: t["decode_logits"][:, 0]),
        "decode_logits has shape [2, 256], expected [2, 2, 256] = [B, T, V] "
        "(B = 2 from input_ids [2, 5] = [B, S]; T = 2 from decode_ids [2, 3] = [B, T + 1]; V = 256 from logits",
    ),
    "decode_logits steps": (
        _set("decode_logits", lambda t: t["decode_logits"][:, :1]),
        "decode_logits has shape [2, 1, 256], expected [2, 2, 256] = [B, T, V] "
        "(B = 2 from input_ids [2, 5] = [B, S]; T = 2 from decode_ids [2, 3] = [B, T + 1]; V = 256",
    ),
    "draft K": (
        _set("draft_logits", lambda t: t["draft_logits"][:, :, :3]),
        "draft_logits has shape [2, 2, 3, 256], expected [2, 2, 5, 256] = [B, T, K, V] "
        "(B = 2 from input_ids [2, 5] = [B, S]; T = 2 from decode_ids [2, 3] = [B, T + 1]; "
        "K = 5 from dspark_block_size in config.json",
    ),
    # decode_ids consistent with decode_logits
    "decode_logits alone": (lambda t, m: t.pop("decode_ids"), "decode_logits without decode_ids"),
    "decode_ids alone": (
        lambda t, m: [t.pop("decode_logits"), t.pop("draft_logits")],
        "decode_ids holds T = 2 steps (decode_ids [2, 3] = [B, T + 1]), but there is no decode_logits",
    ),
    "drafts without decode": (lambda t, m: t.pop("decode_logits"), "draft_logits without decode_logits"),
    # the vocabulary: the model's, and every id inside it
    "vocab 250": (
        lambda t, m: [t.__setitem__(k, t[k][..., :250]) for k in ("logits", "logits_all", "decode_logits",
                                                                   "draft_logits")],
        "logits: vocab 250 (V, its columns), the model has 256",
    ),
    "id outside the vocabulary": (
        _set("input_ids", lambda t: t["input_ids"].index_put((torch.tensor(0), torch.tensor(2)), torch.tensor(9999))),
        "input_ids: prompt 0, position 2: id 9999, outside the vocabulary 0 .. 255 (length 5 from lengths)",
    ),
    "decode id outside": (
        _set("decode_ids", lambda t: t["decode_ids"].index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(256))),
        "decode_ids: prompt 1, step 2: id 256 outside the vocabulary 0 .. 255",
    ),
    # lengths consistent with input_ids
    "padding inside a prompt": (
        _set("lengths", lambda t: torch.tensor([5, 4])),
        "input_ids: prompt 1, position 3: id -1, padding (-1) inside the prompt",
    ),
    "id after the length": (
        _set("lengths", lambda t: torch.tensor([4, 3])),
        "input_ids: prompt 0, position 4: id",
    ),
    "length 0": (_set("lengths", lambda t: torch.tensor([5, 0])), "lengths[1] = 0, expected 1 .. S = 5"),
    "no lengths, padded ids": (lambda t, m: t.pop("lengths"), "prompt 1, position 3: id -1, padding (-1) inside"),
    # max_seq_len
    "prompt too long": (
        lambda t, m: m.__setitem__("max_seq_len", "7"),
        "prompt 0: 5 tokens + 2 decode steps + 5 draft positions need max_seq_len >= 12, the file says 7",
    ),
    # after the last decode step the DSpark stages rope a block of positions beyond it: a file that left
    # them out passed, and verify crashed in the model (an audit: exit 1, a traceback)
    "no room for the drafts": (
        lambda t, m: m.__setitem__("max_seq_len", "10"),
        "prompt 0: 5 tokens + 2 decode steps + 5 draft positions need max_seq_len >= 12, the file says 10",
    ),
    "max_seq_len not an int": (lambda t, m: m.__setitem__("max_seq_len", "x"), "metadata max_seq_len 'x'"),
    # non-finite values in any logits tensor: tensor, prompt, position
    "NaN in logits": (
        _set("logits", lambda t: t["logits"].index_put((torch.tensor(1), torch.tensor(7)), torch.tensor(float("nan")))),
        "logits: prompt 1: NaN (1 of 256 logits)",
    ),
    "Inf in logits_all": (
        _set("logits_all", lambda t: t["logits_all"].index_fill(1, torch.tensor([3]), float("inf"))),
        "logits_all: prompt 0, position 3: Inf (256 of 256 logits)",
    ),
    "NaN in decode_logits": (
        _set("decode_logits", lambda t: t["decode_logits"].index_fill(1, torch.tensor([1]), float("nan"))),
        "decode_logits: prompt 0, decode step 1: NaN",
    ),
    "Inf in draft_logits": (
        _set("draft_logits", lambda t: t["draft_logits"].index_fill(2, torch.tensor([4]), -float("inf"))),
        "draft_logits: prompt 0, decode step 0, draft token 4: Inf",
    ),
    "NaN in draft_confidence": (
        _set("draft_confidence", lambda t: torch.zeros(2, 2, 5).index_fill(1, torch.tensor([1]), float("nan"))),
        "draft_confidence: prompt 0, decode step 1: NaN (5 of 5 logits)",
    ),
    # token types, labels, images
    "token type 7": (
        _set("token_types", lambda t: t["token_types"].index_fill(1, torch.tensor([2]), 7)),
        "token_types: prompt 0, position 2: 7, expected -1 (text) or 0 .. 3",
    ),
    "labels count": (lambda t, m: m.__setitem__("labels", '["a"]'), "metadata labels must be a list of 2 strings"),
    "image missing": (
        lambda t, m: m.__setitem__("images", '["", "/nonexistent/cat.png"]'),
        "metadata images[1] = '/nonexistent/cat.png': no such file",
    ),
    "image without token types": (
        lambda t, m: [m.__setitem__("images", f'["", "{__file__}"]'), t.pop("token_types")],
        "no token_types tensor for its image span",
    ),
    "format": (lambda t, m: m.__setitem__("format", "other/2"), "metadata format 'other/2'"),
    # the tp the logits ran at and the tp its weights record is of come from one run: an edit otherwise
    "tp beside another weights record": (
        lambda t, m: m.update(tp="2", provenance='{"weights": {"tp": 1, "expert_dtype": "fp4", "ranks": [{}]}}'),
        "metadata tp 2, but the weights it ran are recorded for tp 1 (provenance.weights.tp)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_each_damage_is_named(tmp_path, damage):
    change, message = DAMAGES[damage]
    problems = _problems(tmp_path, change)
    assert any(message in p for p in problems), problems
    with pytest.raises(VerifyInputError, match="problem"):
        reffile.load(tmp_path / "ref.safetensors", 128, _args())


def test_all_problems_at_once(tmp_path):
    def many(t, m):
        t["input_ids"][0, 1] = 9999
        t["logits"][1, 3] = float("nan")
        t["decode_logits"] = t["decode_logits"][:, 0]
        m["images"] = '["/nonexistent/a.png", ""]'

    problems = _problems(tmp_path, many)
    assert len(problems) == 4, problems
    with pytest.raises(VerifyInputError) as info:
        reffile.load(tmp_path / "ref.safetensors", 128, _args())
    assert "4 problems" in str(info.value) and "id 9999" in str(info.value) and "NaN" in str(info.value)


def test_drafts_for_a_model_without_dspark(tmp_path):
    import dataclasses

    args = dataclasses.replace(_args(), n_mtp_layers=0)
    assert any("the model has no DSpark stages" in p for p in _problems(tmp_path, args=args))


def test_an_image_prompt_for_a_model_without_a_vision_tower(tmp_path):
    """A file of an image prompt (without provenance: an older file, another implementation's) against a model
    without a vision tower is a problem of the file, named by the image; its ranks ended in a traceback,
    ZeroDivisionError in the image's grid plan (patch size 0), exit 1."""
    import dataclasses

    def image_prompt(t, m):
        m["images"] = f'["", "{__file__}"]'
        t["token_types"][1, :3] = torch.tensor([0, 1, 3])

    vision = [p for p in _problems(tmp_path, image_prompt) if "vision tower" in p]
    assert vision == []
    args = dataclasses.replace(_args(), vision_n_layers=0, vision_patch_size=0)
    problems = _problems(tmp_path, image_prompt, args=args)
    assert any(f"metadata images[1] = '{__file__}': an image prompt, but the model has no vision tower" in p
               for p in problems), problems  # fmt: skip


def _raw_safetensors(path: Path, dtype: str, shape: list[int], nbytes: int) -> Path:
    """A safetensors file of one tensor `w` of `dtype` (a name safetensors.torch may not map), `nbytes` zeros."""
    header = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(nbytes))
    return path


@pytest.mark.parametrize(("dtype", "shape", "nbytes"), [("F4", [2, 4], 4), ("F8_E8M0", [2, 2], 4)])
def test_a_rank_file_given_as_the_reference_is_named_not_a_traceback(tmp_path, dtype, shape, nbytes):
    """`verify MP --reference-logits MP/model0-mp2.safetensors` (a rank file, or a checkpoint shard, for the
    reference: both hold F4 or F8_E8M0 tensors, which safetensors.torch cannot load here) ended in a traceback
    (KeyError: 'F4'); it is an input error naming the file and the dtype, and validation's one problem."""
    path = _raw_safetensors(tmp_path / "model0-mp2.safetensors", dtype, shape, nbytes)
    with pytest.raises(VerifyInputError, match=rf"model0-mp2.safetensors: .*{dtype}.*reference-logits"):
        reffile.load(path, 128)
    problems = reffile.validate_reference_file(path)
    assert len(problems) == 1 and dtype in problems[0], problems


def test_unreadable_file_is_one_problem(tmp_path):
    (tmp_path / "x").write_bytes(b"\xff" * 64)
    problems = reffile.validate_reference_file(tmp_path / "x")
    assert len(problems) == 1 and "not a readable safetensors file" in problems[0]


def test_random_damage_never_raises_and_what_passes_loads(tmp_path):
    """Reshaped, cut, retyped, dropped, emptied tensors in any combination: problems, never an exception."""
    import random

    args, rng = _args(), random.Random(0)
    cuts = (
        lambda x: x.flatten(),
        lambda x: x[..., : max(1, x.shape[-1] - 1)],
        lambda x: x.float() if x.dtype == torch.int64 else x.long(),
        lambda x: x.unsqueeze(0),
        lambda x: x[:1],
        lambda x: x[:0],
        None,  # dropped
    )
    for _ in range(80):
        tensors, meta = _valid(args)
        for _ in range(rng.randint(1, 3)):
            key, cut = rng.choice(sorted(tensors)), rng.choice(cuts)
            if cut is None:
                tensors.pop(key)
            else:
                tensors[key] = cut(tensors[key])
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "r"), metadata=meta)
        if not reffile.validate_reference_file(tmp_path / "r", args):
            reffile.load(tmp_path / "r", 128, args)


def test_the_runtime_length_counts_the_drafts_after_the_last_step():
    """pick_max_seq_len sized prompt + steps + 1: a 120-token prompt with 5 decode steps got 128, and the
    drafts after the last step rope positions 125 .. 129 (a shape error deep in the model, exit 1)."""
    from dsv41_convert.verify.reference import pick_max_seq_len
    from dsv41_convert.verify.runner import draft_block, positions_needed

    args = _args()
    assert draft_block(args) == 5 and positions_needed(120, 5, 5) == 130 and positions_needed(120, 0, 5) == 121
    assert pick_max_seq_len([120], 5, None, draft_block(args)) == 192
    assert pick_max_seq_len([120], 5, None) == 128  # a model without DSpark stages: as before
    with pytest.raises(VerifyInputError, match=r"--max-seq-len 44: .* and the DSpark drafts after the last needs 48"):
        pick_max_seq_len([40], 3, 44, draft_block(args))
    assert pick_max_seq_len([40], 3, 48, draft_block(args)) == 48


def test_the_image_digest_is_of_the_bytes_the_run_cut_its_patches_from(tmp_path):
    """An image replaced while the reference ran (the real model's runs take hours): the file recorded the digest
    of the new image, read at the save, beside logits of the old one, so verify passed the digest check and
    replayed the new image, FAILing a correct conversion at `vision`. The digest is now taken of the bytes the
    patches were cut from, and verify refuses the replaced image instead."""
    import dataclasses
    import hashlib
    import json

    from PIL import Image

    from dsv41_convert.verify.prompts import Prompt
    from dsv41_convert.verify.runner import model_input

    args = dataclasses.replace(_args(), image_token_id=250)  # tiny_config's is the real one, past its vocabulary
    path = tmp_path / "a.png"
    Image.new("RGB", (60, 40), (10, 20, 30)).save(path)
    ran = hashlib.sha256(path.read_bytes()).hexdigest()
    inp = model_input(Prompt((5, 6, 7), "a", text="x", image=str(path)), args)
    Image.new("RGB", (60, 40), (200, 20, 30)).save(path)  # replaced during the run
    ref = reffile.Reference([inp], [_run(len(inp.input_ids), vocab=args.vocab_size)], ["a"], 128, "fp8", "cpu")
    reffile.save(ref, tmp_path / "r.safetensors")
    _, meta = reffile._read(tmp_path / "r.safetensors")
    assert json.loads(meta["image_sha256"]) == [ran]
    problems = reffile.validate_reference_file(tmp_path / "r.safetensors")
    assert any("not the image this file was computed with" in p for p in problems), problems


def _index_records(args) -> dict[str, torch.Tensor]:
    """What tiny_config's index source (layer 1, ratio 2) and candidate source (layer 2, ratio 1) record for _valid's
    prompts of 5 and 3 tokens, padded as file_tensors pads: every visible compressed row chosen (n + j), -1 where fewer
    are visible than the width, every visible block kept."""
    lengths = [5, 3]
    indexer = torch.full((B, S, min(args.index_topk, S // 2)), reffile.INDEXER_PAD)
    candidates = torch.full((B, S, S), reffile.INDEXER_PAD, dtype=torch.int8)
    for row, n in enumerate(lengths):
        width = min(args.index_topk, n // 2)
        for p in range(n):
            seen = list(range(n, n + (p + 1) // 2))[:width]
            indexer[row, p, :width] = torch.tensor(seen + [-1] * (width - len(seen)))
            candidates[row, p, :n] = 1
    return {"hidden.layers.1.attn.indexer": indexer, "hidden.layers.2.attn.candidates": candidates}


def _with_index_records(edit=None):
    def change(t, m):
        t.update(_index_records(_args()))
        if edit is not None:
            edit(t)

    return change


def _edit(key, index, value):
    return lambda t: t[key].__setitem__(index, value)


INDEXER, CANDIDATES = "hidden.layers.1.attn.indexer", "hidden.layers.2.attn.candidates"
HIDDEN_DAMAGES = {
    "indexer-narrower": (
        lambda t: t.__setitem__(INDEXER, t[INDEXER][..., :1].contiguous()),
        "hidden.layers.1.attn.indexer has shape [2, 5, 1], expected [2, 5, 2]",
    ),
    "candidates-wider": (
        lambda t: t.__setitem__(CANDIDATES, torch.cat([t[CANDIDATES], t[CANDIDATES][..., :1]], -1)),
        "hidden.layers.2.attn.candidates has shape [2, 5, 6], expected [2, 5, 5]",
    ),
    "candidates-4d": (
        lambda t: t.__setitem__(CANDIDATES, t[CANDIDATES][..., None].contiguous()),
        "hidden.layers.2.attn.candidates has shape [2, 5, 5, 1], expected [2, 5, 5]",
    ),
    "embed-width": (
        lambda t: t.__setitem__("hidden.embed", t["hidden.embed"][..., :8].contiguous()),
        "hidden.embed has shape [2, 5, 8], expected [2, 5, 64]",
    ),
    "candidates-of-no-candidate-source": (
        lambda t: t.__setitem__("hidden.layers.1.attn.candidates", t[CANDIDATES].clone()),
        "hidden.layers.1.attn.candidates: the model has no such module",
    ),
    "layer-the-model-lacks": (
        lambda t: t.__setitem__("hidden.layers.7.ffn", t["hidden.embed"].clone()),
        "hidden.layers.7.ffn: the model has no such module",
    ),
    "indexer-past-the-kv": (
        _edit(INDEXER, (0, 4, 0), 500),
        "prompt 0, position 4, column 0: 500, expected -1 or a compressed row 5 .. 6",
    ),
    "indexer-negative": (_edit(INDEXER, (0, 4, 1), -7), "prompt 0, position 4, column 1: -7"),
    "indexer-padding-inside": (_edit(INDEXER, (0, 4, 1), reffile.INDEXER_PAD), "position 4, column 1: -2"),
    "indexer-past-the-width": (
        _edit(INDEXER, (1, 2, 1), 3),
        "prompt 1, position 2, column 1: 3, expected padding -2 past the prompt's width 1",
    ),
    "candidates-5": (_edit(CANDIDATES, (0, 2, 3), 5), "prompt 0, position 2, column 3: 5, expected 0 or 1"),
    "candidates-minus-7": (_edit(CANDIDATES, (1, 0, 0), -7), "prompt 1, position 0, column 0: -7"),
    "candidates-no-kept-block": (
        _edit(CANDIDATES, (0, 3), 0),
        "hidden.layers.2.attn.candidates: prompt 0, position 3: no kept block",
    ),
}  # fmt: skip


def test_the_model_s_index_records_pass(tmp_path):
    assert _problems(tmp_path, _with_index_records()) == []
    back = reffile.load(tmp_path / "ref.safetensors", 128, _args())
    assert back.runs[1].hidden["layers.1.attn.indexer"].shape == (3, 1)  # prompt 1's own width
    assert back.runs[1].hidden["layers.2.attn.candidates"].shape == (3, 3)


@pytest.mark.parametrize("damage", sorted(HIDDEN_DAMAGES))
def test_hidden_states_the_model_cannot_have_are_named(tmp_path, damage):
    """A hidden.<module> of another width ran the teacher into a rank's traceback (exit 1); a key of a module the
    model lacks was ignored; an indexer row past the KV was a rank's IndexError; -7 or padding inside the width
    FAILed the conversion (layers.1.attn 46 ulps); a candidates value 5 or -7 or a row without a kept block PASSed.
    Each is now a problem of the file, naming the tensor (and prompt, position, column)."""
    edit, message = HIDDEN_DAMAGES[damage]
    problems = _problems(tmp_path, _with_index_records(edit))
    assert any(message in p for p in problems), problems
    with pytest.raises(VerifyInputError, match="problem"):
        reffile.load(tmp_path / "ref.safetensors", 128, _args())


def _blocks_args():
    """tiny_config's model with candidate blocks of 2 rows, 2 kept: prompt 0 (5 rows) has 3 blocks to choose from."""
    import dataclasses

    return dataclasses.replace(_args(), candidate_block_size=2, candidate_topk_blocks=2)


def _model_s_candidates(edit=None):
    """The candidate source's records as the model keeps them (model.indexer.select_candidate_blocks of random
    scores, unreachable rows -inf, ratio 1) for _valid's prompts of 5 and 3 tokens; then `edit` (candidates tensor)."""
    from dsv41_convert.model.indexer import select_candidate_blocks

    def change(t, m):
        t.update(_index_records(_args()))
        args, g = _blocks_args(), torch.Generator().manual_seed(3)
        candidates = torch.full((B, S, S), reffile.INDEXER_PAD, dtype=torch.int8)
        for row, n in enumerate([5, 3]):
            lens = torch.arange(1, n + 1)[:, None]
            scores = torch.randn(1, n, n, generator=g).masked_fill(torch.arange(n) >= lens, -torch.inf)
            keep = select_candidate_blocks(scores, lens, args.candidate_topk_blocks, args.candidate_block_size)
            candidates[row, :n, :n] = keep[0].to(torch.int8)
        t[CANDIDATES] = candidates
        if edit is not None:
            edit(candidates)

    return change


def test_the_model_s_candidate_blocks_pass(tmp_path):
    assert _problems(tmp_path, _model_s_candidates(), _blocks_args()) == []


def _keep(row, p, cols):
    return lambda c: c[row, p].__setitem__(slice(*cols), 1)


CANDIDATE_BLOCK_DAMAGES = {
    "a third block": (_keep(0, 4, (0, 5)), "prompt 0, position 4: 3 blocks kept, the model keeps at most 2"),
    "half a block": (
        lambda c: c[0, 4].copy_(torch.tensor([1, 0, 1, 1, 1], dtype=torch.int8)),
        "prompt 0, position 4: block 0 partly kept (the model keeps whole blocks of 2 rows)",
    ),
    "a block not visible yet": (_keep(1, 0, (2, 3)), "prompt 1, position 0: block 1 kept, past the 1 compressed rows"),
}


@pytest.mark.parametrize("damage", sorted(CANDIDATE_BLOCK_DAMAGES))
def test_candidate_blocks_the_model_cannot_keep_are_named(tmp_path, damage):
    """A candidates record keeping more blocks than candidate_topk_blocks, part of a block or a block of rows not
    visible yet passed the file's checks; the teacher forced it, and the converted model attended to rows the
    reference had not: a FAIL of a correct conversion. Now a problem of the file."""
    edit, message = CANDIDATE_BLOCK_DAMAGES[damage]
    problems = _problems(tmp_path, _model_s_candidates(edit), _blocks_args())
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("key", ["hidden.embed", "hidden.layers.0.pre_mix"])
def test_nan_in_a_hidden_state_is_a_problem_of_the_file(tmp_path, key):
    """NaN in a reference's hidden state was forced into the next module by the teacher, which then FAILed the
    conversion ("teacher layers.0.ffn: nan bf16 ulps > 2"); the file is what is wrong."""

    def change(t, m):
        if key not in t:
            t[key] = torch.rand(B, S, _args().hc_mult)
        t[key][1, 2, 0] = float("nan")

    problems = _problems(tmp_path, change)
    assert f"{key}: prompt 1, position 2: NaN or Inf" in problems, problems
