"""`verify --reference-logits FILE` on a tiny tp-1 conversion: a damaged FILE is bad input (exit 2, every
problem named, through the installed entry point), never a mismatch (exit 1) or a traceback; a FILE
holding only the required and documented-valid tensors runs.

Damages planted (issue 22 and 14.4): an id outside the vocabulary, a NaN in logits, decode_logits
[B, V], a vocabulary other than the model's, a garbage header, an image file that is not there, and
all of them at once.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_cli_usage import entry_point

from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify import reffile
from dsv41_convert.verify.arithmetic import arithmetic
from dsv41_convert.verify.prompts import Prompt
from dsv41_convert.verify.reference import compute_reference
from dsv41_convert.verify.run import DRAFTS_UNREACHED, VerifyOptions, verify
from dsv41_convert.verify.table import render

pytestmark = pytest.mark.slow  # runs the tiny model once for the reference, and the CLI per damage


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> tuple[Path, Path]:
    """(tp-1 conversion, its reference file: 2 prompts of 6 and 4 tokens, 2 decode steps, drafts)."""
    root = tmp_path_factory.mktemp("reffile")
    src = root / "src"
    write_checkpoint(src, TINY, seed=0, vision=False)
    conv = root / "mp1"
    execute(build_plan(src, 1), conv)
    prompts = [Prompt([5, 9, 13, 17, 21, 25], "six"), Prompt([30, 31, 32, 33], "four")]
    ref = compute_reference(src, prompts, n_decode=2, capture_hidden=False).reference
    reffile.save(ref, root / "ref.safetensors")
    return conv, root / "ref.safetensors"


def damaged(ref: Path, out: Path, change) -> Path:
    tensors = load_file(str(ref))
    with safe_open(str(ref), "pt") as f:
        meta = f.metadata()
    change(tensors, meta)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), metadata=meta)
    return out


def test_only_ids_logits_logits_all_runs(work, tmp_path):
    """The documented minimum (plus logits_all): no decode steps, so no teacher tokens; it must run, exact,
    but without decode steps the DSpark stages never ran: INCONCLUSIVE, saying so, unless the file records
    the digests of the weights it ran (the stages' bytes compared: PASS)."""
    conv, ref = work
    keep = ("input_ids", "lengths", "logits", "logits_all")

    def strip(t, m, digests: bool):
        for k in [k for k in t if k not in keep]:
            t.pop(k)
        if not digests:
            prov = json.loads(m["provenance"])
            del prov["weights"]
            m["provenance"] = json.dumps(prov, sort_keys=True)

    digested = damaged(ref, tmp_path / "min-digests.safetensors", lambda t, m: strip(t, m, True))
    result = verify(VerifyOptions(conv, reference_logits=digested, threads=1))
    assert result.verdict == "PASS" and result.decisive == ["reference", "weights"], result.failures
    minimal = damaged(ref, tmp_path / "min.safetensors", lambda t, m: strip(t, m, False))
    assert sorted(load_file(str(minimal))) == sorted(keep)
    result = verify(VerifyOptions(conv, reference_logits=minimal, threads=1))
    assert result.verdict == "INCONCLUSIVE" and not result.failures, result.failures
    assert "reference without decode steps" in result.advice and "--decode-steps" in result.advice
    assert set(result.overall) == {"last", "all"}
    assert all(s.max_abs == 0 for s in result.overall.values())  # tp 1, fp8 source: exact
    # --statistical makes it a PASS; no bound judged a draft (none was computed), so the stages are what no
    # prompt ran, not "the DSpark drafts on statistical bounds only" (an audit: a doubled scale in an MTP
    # stage passed, reported as judged)
    result = verify(VerifyOptions(conv, reference_logits=minimal, threads=1, statistical=True))
    assert result.verdict == "PASS" and not result.drafts_statistical
    # the PASS needed --statistical: said so (`statistical` was false, as for a PASS checks decided: an audit)
    doc = result.to_json()
    assert doc["statistical"] and doc["drafts_unchecked"] and result.decisive == ["reference"]
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(render(result))
    assert "drafts compared by nothing (no decode steps), accepted by --statistical" in console.export_text()
    # the same at tp 2 without the replay: statistical bounds only, the drafts compared by nothing either
    conv2 = tmp_path / "mp2"
    execute(build_plan(conv.parent / "src", 2), conv2)
    result = verify(VerifyOptions(conv2, reference_logits=minimal, threads=1, statistical=True, replay=False))
    doc = result.to_json()
    assert result.verdict == "PASS" and result.decisive == [] and doc["statistical"] and doc["drafts_unchecked"]
    assert DRAFTS_UNREACHED in result.unreached and result.to_json()["unreached"] == result.unreached
    assert DRAFTS_UNREACHED not in verify(VerifyOptions(conv, reference_logits=ref, threads=1)).unreached


def _run_verify(conv: Path, ref: Path) -> subprocess.CompletedProcess[str]:
    args = [entry_point(), "verify", str(conv), "--reference-logits", str(ref), "--threads", "1"]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def _nan_logits(t, m):
    t["logits"][1, 7] = float("nan")


def _id_9999(t, m):
    t["input_ids"][0, 2] = 9999


def _decode_b_v(t, m):
    t["decode_logits"] = t["decode_logits"][:, 0]


def _vocab_500(t, m):
    for key in ("logits", "logits_all", "decode_logits", "draft_logits"):
        t[key] = t[key][..., :500]


def _missing_image(t, m):
    m["images"] = json.dumps(["", "/nonexistent/cat.png"])
    t["token_types"] = torch.full_like(t["input_ids"], -1)


def _image_span_without_its_image(t, m):
    t["token_types"] = torch.full_like(t["input_ids"], -1)
    t["token_types"][1, 1:3] = torch.tensor([0, 1])  # an image span in prompt 1, whose images entry is ""
    m["images"] = json.dumps(["", ""])


def _threads(t, m, value: str = "²"):
    m["threads"] = value


DAMAGES = {
    "id outside the vocabulary": (_id_9999, ["input_ids: prompt 0, position 2: id 9999, outside the vocabulary"]),
    "NaN in logits": (_nan_logits, ["logits: prompt 1: NaN (1 of 512 logits)"]),
    "decode_logits [B, V]": (
        _decode_b_v,
        ["decode_logits has shape [2, 512], expected [2, 2, 512] = [B, T, V]", "T = 2 from decode_ids [2, 3]"],
    ),
    "vocab 500": (_vocab_500, ["logits: vocab 500 (V, its columns), the model has 512"]),
    "image not there": (_missing_image, ["images[1] = '/nonexistent/cat.png': no such file"]),
    # the prompt ran as text and a correct conversion FAILed, "replay last: max_abs 4.27" (an audit)
    "image span without its image": (
        _image_span_without_its_image,
        ["token_types: prompt 1 holds an image span, but metadata images names no image for it"],
    ),
    # "²".isdigit() is True, int("²") a ValueError traceback; 100000 threads ended in a panic (an audit)
    "threads not an integer": (_threads, ["metadata threads '²': expected an integer >= 0 and <= 1024"]),
    # any string passed, took the replay's bit equality away and PASSed on the weights alone (an audit)
    "device unknown": (lambda t, m: m.update(device="gpu"), ["metadata device 'gpu': expected 'cpu' or 'cuda'"]),
    "threads past the limit": (
        lambda t, m: _threads(t, m, "100000"),
        ["metadata threads '100000': expected an integer >= 0 and <= 1024"],
    ),
    "tp edited": (  # its weights record is of tp 1: a run at tp 2 blamed the conversion (an audit)
        lambda t, m: m.update(tp="2"),
        ["metadata tp 2, but the weights it ran are recorded for tp 1 (provenance.weights.tp)"],
    ),
    "all at once": (
        lambda t, m: [f(t, m) for f in (_id_9999, _nan_logits, _decode_b_v, _missing_image)],
        # the image prompt is a problem twice: its image is not there, and this source has no vision tower
        ["5 problems", "id 9999", "NaN", "decode_logits has shape [2, 512]", "no such file", "no vision tower"],
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_reference_is_bad_input(work, tmp_path, damage):
    conv, ref = work
    change, messages = DAMAGES[damage]
    proc = _run_verify(conv, damaged(ref, tmp_path / "bad.safetensors", change))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "error:" in proc.stderr
    err = " ".join(proc.stderr.split())
    for message in messages:
        assert message in err, err


def test_garbage_header_is_bad_input(work, tmp_path):
    conv, _ = work
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    proc = _run_verify(conv, tmp_path / "junk.safetensors")
    assert proc.returncode == 2 and "not a readable safetensors file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_prompts_of_other_lengths_with_hidden_states(work, tmp_path):
    """The indexer's hidden state is [n, min(index_topk, n // ratio)]: wider for a longer prompt. save()
    assumed one width and ended in a RuntimeError after the whole computation (an audit: two prompts of 5
    and 4 tokens); the narrower prompt is now padded and loads back as it was, and verify runs on it."""
    conv, _ = work
    src = conv.parent / "src"
    prompts = [Prompt(list(range(3, 43)), "forty"), Prompt(list(range(50, 55)), "five")]
    ref = compute_reference(src, prompts, n_decode=1, capture_hidden=True).reference
    path = tmp_path / "ref.safetensors"
    reffile.save(ref, path)
    back = reffile.load(path, 128)
    widths = set()
    for want, got in zip(ref.runs, back.runs, strict=True):
        assert set(want.hidden) == set(got.hidden)
        for key, h in want.hidden.items():
            assert got.hidden[key].shape == h.shape and torch.equal(got.hidden[key], h.to(got.hidden[key].dtype)), key
            if key.endswith(".indexer"):
                widths.add(h.shape[-1])
    assert len(widths) > 1  # the prompts' indexer widths differ: the case that crashed
    result = verify(VerifyOptions(conv, reference_logits=path, threads=1))
    assert result.verdict == "PASS", (result.failures, result.checks)


def _verified(conv: Path, ref: Path):
    """verify against `ref` with the file's own threads (no --threads)."""
    return verify(VerifyOptions(conv, reference_logits=ref))


def _off_by_an_ulp(t, m):
    """The reference as another machine's kernels compute it: a few logits one ulp away."""
    for k in ("logits", "logits_all", "decode_logits"):
        flat = t[k].view(-1)
        flat[::97] = torch.nextafter(flat[::97], torch.tensor(float("inf")))


def _without_digests(t, m):
    prov = json.loads(m["provenance"])
    del prov["weights"]
    m["provenance"] = json.dumps(prov, sort_keys=True)


def test_logits_off_where_every_weight_held_fail_saying_what_that_can_mean(work, tmp_path):
    """A reference whose sums came out other than this run's (another CPU's kernels: an audit's
    MKL_ENABLE_INSTRUCTIONS=AVX2 run of an AVX-512 host's file; or edited threads) FAILed a correct set
    blaming a layer, though the weights check held. Taking such a difference as the arithmetic's and passing on
    the weights let a weights record edited to a faulty set's digests PASS (two reviews): it stays a FAIL,
    and the check says what it can mean and how to tell (recompute the reference here). Without the digests
    it is a FAIL without that note."""
    conv, ref = work
    ulp = damaged(ref, tmp_path / "ulp.safetensors", _off_by_an_ulp)
    result = _verified(conv, ulp)
    assert result.verdict == "FAIL" and result.weights == "held", result.failures
    check = next(c for c in result.checks if c.name == "reference")
    assert not check.exact and check.expected_exact and check.failures
    assert "every tensor is the bytes the reference's weights record names" in check.note
    assert "recompute the reference on this machine" in check.note

    bare = damaged(ulp, tmp_path / "ulp-bare.safetensors", _without_digests)
    result = _verified(conv, bare)
    check = next(c for c in result.checks if c.name == "reference")
    assert result.verdict == "FAIL" and "weights record" not in check.note, result.failures


def test_a_reference_of_other_kernels_expects_no_bit_equality(work, tmp_path, monkeypatch):
    """reference-logits records what picks its kernels (verify.arithmetic); a run whose own differs (here
    MKL capped at AVX2, as an AVX2-only host runs) does not expect the reference's bits, and says why."""
    conv, ref = work
    with safe_open(str(ref), "pt") as f:
        recorded = f.metadata()["arithmetic"]
    assert recorded == arithmetic("cpu") and torch.backends.cpu.get_cpu_capability() in recorded
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    result = _verified(conv, ref)
    assert result.verdict == "PASS" and "weights" in result.decisive, result.failures  # equal bits still certify
    check = next(c for c in result.checks if c.name == "reference")
    assert not check.expected_exact and "MKL_ENABLE_INSTRUCTIONS=AVX2" in check.note, check.note
