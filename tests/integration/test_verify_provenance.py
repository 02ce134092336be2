"""`verify --reference-logits FILE` checks CONVERTED against what FILE records it was computed from
(verify/provenance.py). Faults planted, each a PASS (exit 0) before (an audit):
- CONVERTED/config.json edited (swiglu_limit, which the tiny prompts never reach; norm_eps);
- CONVERTED's tokenizer.json with two vocabulary entries swapped, tokenizer_config.json removed;
- FILE computed from CONVERTED's own rank files (`reference-logits MP --stream-layers`) after one rank's
  head was overwritten with another's: its own tp-1 replay, so it passed the fault.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsv41_convert.config import load_model_args
from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.errors import VerifyInputError
from dsv41_convert.store.safetensors_header import read_header
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify import reffile
from dsv41_convert.verify.prompts import Prompt
from dsv41_convert.verify.reference import compute_reference
from dsv41_convert.verify.run import VerifyOptions, verify
from dsv41_convert.verify.streamed import compute_streamed_reference

pytestmark = pytest.mark.slow  # runs the tiny model for the references and some verifies

PROMPTS = [Prompt([5, 9, 13, 17, 21, 25], "six")]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """A tiny source, its tp-1 and tp-2 conversions and a tp-1 reference file of the source."""
    root = tmp_path_factory.mktemp("provenance")
    src = root / "src"
    write_checkpoint(src, TINY, seed=0, vision=False)
    for tp in (1, 2):
        execute(build_plan(src, tp), root / f"mp{tp}")
    # at the one thread _verify runs with (bit equality follows the sums' order): in process, the reference ran at
    # whatever count an earlier test's run left (reference-logits sets its own), and the logits differed (CI)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = compute_reference(src, PROMPTS, n_decode=1, capture_hidden=False).reference
    finally:
        torch.set_num_threads(before)
    reffile.save(ref, root / "ref.safetensors")
    return {"src": src, "mp1": root / "mp1", "mp2": root / "mp2", "ref": root / "ref.safetensors"}


def _recorded(ref: Path) -> dict:
    with safe_open(str(ref), "pt") as f:
        return json.loads(f.metadata()["provenance"])


def _verify(conv: Path, ref: Path):
    return verify(VerifyOptions(conv, reference_logits=ref, threads=1))


def test_a_reference_records_its_model_tokenizer_and_source(work):
    prov = _recorded(work["ref"])
    model = json.loads(json.dumps(load_model_args(work["src"] / "config.json").to_inference_dict()))
    assert prov["model"] == model and prov["made_from"] == "source"
    digest = hashlib.sha256((work["src"] / "tokenizer.json").read_bytes()).hexdigest()
    assert prov["tokenizer"]["tokenizer.json"] == digest and "tokenizer_config.json" in prov["tokenizer"]
    assert prov["hf_config"] == hashlib.sha256((work["src"] / "config.json").read_bytes()).hexdigest()


@pytest.mark.parametrize("manifest", ["kept", "removed"])
def test_a_changed_hf_config_fails_naming_the_file(work, tmp_path, manifest):
    """hf_config.json (the source's config.json, copied unchanged; the bundled model reads config.json) with
    routed_scaling_factor changed passed every --reference-logits mode once the manifest was gone or made to
    match (an audit; only the twin compared it): the reference records its digest."""
    conv = shutil.copytree(work["mp2"], tmp_path / "mp2")
    hf = json.loads((conv / "hf_config.json").read_text())
    hf["text_config"]["routed_scaling_factor"] *= 2
    (conv / "hf_config.json").write_text(json.dumps(hf))
    if manifest == "removed":
        (conv / "manifest.json").unlink()
    result = _verify(conv, work["ref"])
    assert result.verdict == "FAIL", (result.failures, result.checks)
    said = f"hf config: {conv / 'hf_config.json'} differs from the config.json {work['ref']} was computed with"
    assert said in "\n".join(result.failures), result.failures
    assert [f for f in result.failures if not f.startswith(("hf config:", "manifest:"))] == [], result.failures
    (conv / "hf_config.json").unlink()  # upstream convert.py writes none: nothing to compare
    assert _verify(conv, work["ref"]).verdict == ("PASS" if manifest == "removed" else "FAIL")


@pytest.mark.parametrize(("field", "value"), [("swiglu_limit", 1000.0), ("norm_eps", 1e-6)])
def test_a_changed_config_is_refused_naming_config_json_and_the_field(work, tmp_path, field, value):
    conv = shutil.copytree(work["mp2"], tmp_path / "mp2")
    cfg = json.loads((conv / "config.json").read_text())
    before = cfg[field]
    cfg[field] = value
    (conv / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VerifyInputError) as err:
        _verify(conv, work["ref"])
    msg = str(err.value)
    assert (
        f"{conv / 'config.json'}: not the model {work['ref']} was computed with ({field} {before!r} -> {value!r})"
        in msg
    )


def test_a_changed_tokenizer_fails_naming_the_file(work, tmp_path):
    conv = shutil.copytree(work["mp1"], tmp_path / "mp1")
    tok = json.loads((conv / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab)[300:302]  # ids the prompt does not hold
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (conv / "tokenizer.json").write_text(json.dumps(tok))
    (conv / "tokenizer_config.json").unlink()
    result = _verify(conv, work["ref"])
    assert result.verdict == "FAIL", (result.failures, result.checks)
    assert f"tokenizer: {conv / 'tokenizer.json'} differs from the tokenizer.json {work['ref']}" in "\n".join(
        result.failures
    )
    assert any(f"tokenizer: {conv / 'tokenizer_config.json'} is missing" in f for f in result.failures)
    assert all(s.max_abs == 0 for s in result.overall.values())  # the logits alone could not have told


def _overwrite_rank_tensor(folder: Path, name: str, from_rank: int, to_rank: int, tp: int) -> None:
    """Rank `to_rank`'s `name` bytes replaced in place by rank `from_rank`'s (the manifest left as it was)."""
    src_h = read_header(folder / f"model{from_rank}-mp{tp}.safetensors")
    dst_h = read_header(folder / f"model{to_rank}-mp{tp}.safetensors")
    a, b = src_h.tensors[name], dst_h.tensors[name]
    data = (folder / f"model{from_rank}-mp{tp}.safetensors").read_bytes()[a.begin : a.begin + a.nbytes]
    with open(folder / f"model{to_rank}-mp{tp}.safetensors", "r+b") as f:
        f.seek(b.begin)
        f.write(data)


def _manifest_as_the_files_are(folder: Path) -> None:
    """manifest.json rewritten with every listed file's sha256 as it is now: a faulty converter's own record."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, rec in manifest["files"].items():
        rec["sha256"] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))


def test_a_reference_of_the_rank_files_themselves_is_refused(work, tmp_path):
    conv = shutil.copytree(work["mp2"], tmp_path / "mp2")
    _overwrite_rank_tensor(conv, "head.weight", 0, 1, 2)
    _manifest_as_the_files_are(conv)  # a converter's fault (reference-logits refuses files changed since)
    assert _verify(conv, work["ref"]).verdict == "FAIL"  # the source's reference sees it
    own = tmp_path / "refs" / "own.safetensors"
    reffile.save(compute_streamed_reference(conv, PROMPTS, 1)[0], own)
    made = _recorded(own)["made_from"]
    assert made["tp"] == 2 and sorted(made["files"]) == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    with pytest.raises(VerifyInputError, match=rf"computed from the rank files in {conv} .* own \(the same files\)"):
        _verify(conv, own)
    copy = shutil.copytree(conv, tmp_path / "copy")  # other files, the same bytes by its manifest
    with pytest.raises(VerifyInputError, match=r"own .a copy: both manifests give the same sha256"):
        _verify(copy, own)
    # a copy whose bytes changed after the reference read it keeps the manifest's sha256: it is still this
    # conversion's copy, and the refusal says so (it said "the rank files in COPY themselves": an audit)
    before = (copy / "model0-mp2.safetensors").read_bytes()
    _overwrite_rank_tensor(copy, "layers.0.attn.wq_b.weight", 1, 0, 2)
    assert (copy / "model0-mp2.safetensors").read_bytes() != before
    with pytest.raises(VerifyInputError, match=rf"rank files in {conv}.*which are {copy}'s own .a copy: both"):
        _verify(copy, own)
    # a reference of a copy without a manifest (cp -r of a folder upstream convert.py wrote): other inodes,
    # no recorded sha256; it passed the faulty files as their own replay (an audit). Their size and sampled
    # blocks say it is a copy
    bare = shutil.copytree(conv, tmp_path / "bare")
    (bare / "manifest.json").unlink()
    (conv / "manifest.json").unlink()
    of_bare = tmp_path / "refs" / "of-bare.safetensors"
    reffile.save(compute_streamed_reference(bare, PROMPTS, 1)[0], of_bare)
    with pytest.raises(VerifyInputError, match=r"own .a copy: the same sizes and sampled bytes.: a tp-1 replay"):
        _verify(conv, of_bare)
    assert _verify(work["mp1"], own).verdict == "FAIL"  # another conversion: judged against it, not refused


def test_a_malformed_provenance_is_named_with_the_other_problems(work, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(work["ref"]))
    with safe_open(str(work["ref"]), "pt") as f:
        meta = f.metadata()
    for bad, said in (("[1]", "must be a JSON object"), ("{", "is not JSON"),
                      ('{"tokenizer": {"tokenizer.json": 5}}', "provenance.tokenizer must map"),
                      # any other name made verify hash that path, even outside CONVERTED, and FAIL a correct set
                      ('{"tokenizer": {"../src/tokenizer.json": "' + "0" * 64 + '"}}', "provenance.tokenizer names"),
                      ('{"tokenizer": {"config.json": "' + "0" * 64 + '"}}', "only ['tokenizer.json', "),
                      ('{"tokenizer": {"tokenizer.json": "abc"}}', "(64 hex digits)"),
                      ('{"hf_config": 5}', "provenance.hf_config must be a sha256 string"),
                      ('{"made_from": {"files": [1]}}', "provenance.made_from must be"),
                      ('{"weights": {"tp": 2, "expert_dtype": "fp4", "ranks": [{}]}}', "provenance.weights must be"),
                      ('{"weights": {"tp": 1, "expert_dtype": "fp4", "ranks": [{"a": 1}]}}',
                       "provenance.weights: every digest must be")):  # fmt: skip
        meta["provenance"] = bad
        save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
        problems = reffile.validate_reference_file(tmp_path / "bad.safetensors")
        assert any(said in p for p in problems), (bad, problems)


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda w: w.update(tp=0, ranks=[]), 'provenance.weights must be {"tp"'),
        (lambda w: w.update(expert_dtype="fp8"), "provenance.weights.expert_dtype 'fp8', but the model it ran"),
        (lambda w: w["ranks"][0].update({"norm.weight": "zz"}), "every digest must be 64 lowercase hex digits"),
        # names dropped or added: "not in the reference's record" failed CONVERTED (exit 1), whose rank files
        # load into the model strictly (its tensors, no others); the record is what is wrong
        (lambda w: w["ranks"][0].pop("norm.weight"), "norm.weight: not in the reference's record"),
        (lambda w: w["ranks"][0].update({"layers.0.extra": "0" * 64}), "layers.0.extra: not in the rank files"),
        # the routed experts as fp8 (experts_as): of the wrong dtype, or holding a tensor that is no expert's
        (lambda w: w.update(experts_as={"expert_dtype": "fp4", "sha256": {}}), "experts_as must be"),
        (
            lambda w: w.update(experts_as={"expert_dtype": "fp8", "sha256": {"norm.weight": "0" * 64}}),
            "norm.weight, which is not a routed expert's tensor",
        ),
    ],
)
def test_an_edited_weights_record_is_an_input_error(work, tmp_path, monkeypatch, capsys, edit, said):
    """A weights record that does not fit the file's model: tp 0 crashed verify (ZeroDivisionError, exit 1, no
    JSON), an expert dtype edited to fp8 switched the experts' comparison off (a faulty expert passed), a
    digest "zz" failed CONVERTED (an audit). Each is the file's problem: exit 2, one JSON document."""
    from cli_run import run_cli
    from safetensors.torch import load_file, save_file

    with safe_open(str(work["ref"]), "pt") as f:
        meta = f.metadata()
    prov = json.loads(meta["provenance"])
    edit(prov["weights"])
    bad = tmp_path / "edited.safetensors"
    save_file(load_file(str(work["ref"])), str(bad), metadata=meta | {"provenance": json.dumps(prov)})
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(work["mp2"]), "--reference-logits", str(bad), "--json")
    doc = json.loads(out)
    assert code == 2 and doc["exit_code"] == 2 and said in doc["error"] and str(bad) in doc["error"], (out, err)


def test_a_reference_without_its_model_checks_the_config_from_hf_config_or_says_it_did_not(
    work, tmp_path, monkeypatch, capsys
):
    """A FILE whose provenance lacks `model` (hand-edited, another tool): verify skipped the config check without
    a word, and CONVERTED/config.json with swiglu_limit x1000 (which the tiny prompts never reach) passed. Where
    CONVERTED's hf_config.json is the config.json FILE's run recorded (provenance.hf_config), the model it
    describes is checked; else the run says the config was not checked (a line, and `config` in --json)."""
    from cli_run import run_cli
    from safetensors.torch import load_file, save_file

    with safe_open(str(work["ref"]), "pt") as f:
        meta = f.metadata()
    prov = json.loads(meta["provenance"])
    del prov["model"]
    bare = tmp_path / "no-model.safetensors"
    save_file(load_file(str(work["ref"])), str(bare), metadata=meta | {"provenance": json.dumps(prov)})
    conv = shutil.copytree(work["mp1"], tmp_path / "mp1")
    cfg = json.loads((conv / "config.json").read_text())
    cfg["swiglu_limit"] = 1000.0
    (conv / "config.json").write_text(json.dumps(cfg))
    (conv / "manifest.json").unlink()  # the edit is not the manifest's to find here
    with pytest.raises(VerifyInputError, match=r"config.json: not the model .* \(swiglu_limit .* -> 1000.0\)"):
        _verify(conv, bare)
    (conv / "hf_config.json").unlink()  # nothing left to check the config against
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(bare), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["config"] == "not checked", (out, err)
    assert "records no model (provenance.model)" in doc["config_note"], doc["config_note"]
    code, out, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(bare))
    assert code == 0 and "config: not checked" in " ".join(out.split()), (out, err)
    assert _verify(work["mp1"], work["ref"]).config == "held"
