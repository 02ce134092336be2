"""What a reference-logits file records of the folder it was computed from, and what `verify` checks of it.

Recorded (reffile metadata `provenance`, a JSON object; files written before it have none):

    model       the model's inference config (ModelArgs.to_inference_dict) the reference ran
    tokenizer   {file name: sha256} of the tokenizer files beside it (Engram hashes the token ids)
    hf_config   the sha256 of the HF config.json `shard` copies beside the rank files as hf_config.json: the
                source's config.json, or a converted folder's hf_config.json (absent where it has none, and
                in files written before 2026-12-05)
    made_from   "source", or for a folder of converted rank files (`reference-logits MP --stream-layers`)
                {"folder", "tp", "files": {rank file: {"size", "dev", "ino", "sha256": its manifest's or "",
                "sampled": store.file_digest.sampled_sha256}}}
    weights     where it ran converted weights: the sha256 of each of their tensors (weight_digests.py)

Checked by `verify CONVERTED --reference-logits FILE` (check_converted):
    - CONVERTED/config.json describes the same model, but for the format fields (FORMAT_FIELDS): a changed
      swiglu_limit the prompts never reach, or a changed norm_eps blamed on a weight, was a PASS or a
      misleading FAIL before. The model is `model`; in a file without it, the one CONVERTED's hf_config.json
      describes where that is the recorded `hf_config`; else not checked, which verify says (config_unchecked:
      a file without `model` skipped the check without a word);
    - CONVERTED's tokenizer files are the recorded bytes (a failure of the run, as with --reference SRC), and
      so is its hf_config.json where it has one (the bundled model does not read it; a serving stack may);
    - the file was not computed from CONVERTED's own rank files (the same files, files its manifest gives the
      same sha256, or files with the same size and sampled blocks: a copy): such a reference is their own
      tp-1 replay, so it passes any fault in them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.tp import rank_file_tps
from dsv41_convert.errors import VerifyInputError
from dsv41_convert.store.file_digest import SHA256_HEX, sampled_sha256, sha256_file
from dsv41_convert.store.manifest import HF_CONFIG, SIDECARS
from dsv41_convert.store.manifest_check import our_manifest
from dsv41_convert.store.rank_names import rank_file_name
from dsv41_convert.verify import weight_digests

FORMAT_FIELDS = ("dtype", "expert_dtype")  # what a conversion may change of the model's config


def record(folder: Path, args: ModelArgs, weights: dict[str, Any] | None = None) -> dict[str, Any]:
    """The provenance of a reference computed from `folder` (a source checkpoint, or converted rank files)
    running the model `args` (its config.json's); `weights`: the digests of the converted weights it ran
    (weight_digests.record), where it ran such weights."""
    folder = Path(folder)
    made_from: Any = "source"
    tps = rank_file_tps(folder)
    if len(tps) == 1:
        rank_tp = tps[0]
        made_from = {"folder": str(folder.resolve()), "tp": rank_tp, "files": _rank_files(folder, rank_tp)}
    out = {"model": args.to_inference_dict(), "tokenizer": _tokenizer_digests(folder), "made_from": made_from}
    hf_config = folder / (HF_CONFIG if made_from != "source" else "config.json")
    if hf_config.is_file():
        out["hf_config"] = sha256_file(hf_config)
    return out if weights is None else out | {"weights": weights}


def problems(prov: Any) -> list[str]:
    """What is wrong with a recorded provenance's shape (reffile's validation), [] when nothing."""
    if not isinstance(prov, dict):
        return [f"metadata provenance must be a JSON object, found {type(prov).__name__}"]
    out = []
    if "model" in prov and not isinstance(prov["model"], dict):
        out.append("metadata provenance.model must be an object (the inference config)")
    tok = prov.get("tokenizer", {})
    if not (isinstance(tok, dict) and all(isinstance(v, str) for v in tok.values())):
        out.append("metadata provenance.tokenizer must map file names to sha256 strings")
    else:  # only what _tokenizer_digests records: any other name made verify hash that path (an audit)
        other = sorted(n for n in tok if n not in SIDECARS)
        if other:
            out.append(f"metadata provenance.tokenizer names {other}: only {list(SIDECARS)} are recorded")
        if not all(SHA256_HEX.fullmatch(v) for v in tok.values()):
            out.append("metadata provenance.tokenizer must map file names to sha256 strings (64 hex digits)")
    if "hf_config" in prov and not (isinstance(prov["hf_config"], str) and SHA256_HEX.fullmatch(prov["hf_config"])):
        out.append("metadata provenance.hf_config must be a sha256 string (64 hex digits)")
    made = prov.get("made_from", "source")
    files = made.get("files") if isinstance(made, dict) else None
    if made != "source" and not (isinstance(files, dict) and all(isinstance(f, dict) for f in files.values())):
        out.append('metadata provenance.made_from must be "source" or an object with `files`')
    if "weights" in prov:
        out += weight_digests.problems(prov["weights"], prov.get("model"))
    return out


def check_converted(prov: dict[str, Any], conv: Path, conv_args: ModelArgs, tp: int, file: Path) -> list[str]:
    """Raise VerifyInputError where CONVERTED cannot be judged by the reference in `file` (another model's
    config, or the reference replays CONVERTED's own rank files); -> the tokenizer files and the hf_config.json
    that differ, as the run's failures (`tokenizer: ...`, `hf config: ...`)."""
    recorded, how = _recorded_model(prov, conv)
    if recorded is not None:
        differ = config_differences(recorded, conv_args.to_inference_dict())
        if differ:
            raise VerifyInputError(
                f"{conv / 'config.json'}: not the model {file} was computed with{how} ({', '.join(differ[:8])}); "
                "a changed config changes what the same weights compute: verify against a reference of this model"
            )
    made = prov.get("made_from", "source")
    same = _same_rank_files(made, conv, tp) if isinstance(made, dict) else None
    if same:
        raise VerifyInputError(
            f"{file} was computed from the rank files in {made.get('folder')} (reference-logits --stream-layers), "
            f"which are {conv}'s own ({same}): a tp-1 replay of a conversion's rank files passes any fault in them; "
            "compute the reference from the source checkpoint"
        )
    found = []
    for name, digest in sorted(prov.get("tokenizer", {}).items()):
        ours = conv / name
        if not ours.is_file():
            found.append(f"tokenizer: {ours} is missing; {file} was computed with a {name} (sha256 {digest[:12]}...)")
        elif sha256_file(ours) != digest:
            found.append(
                f"tokenizer: {ours} differs from the {name} {file} was computed with (sha256 {digest[:12]}...)"
            )
    digest, ours = prov.get("hf_config"), conv / HF_CONFIG
    if digest is not None and ours.is_file() and sha256_file(ours) != digest:
        found.append(
            f"hf config: {ours} differs from the config.json {file} was computed with (sha256 {digest[:12]}...), "
            "which shard copies there unchanged"
        )
    return found


def config_unchecked(prov: dict[str, Any] | None, conv: Path, file: Path) -> str:
    """Why check_converted could not compare CONVERTED/config.json with the model `file`'s run recorded, ""
    where it did (`prov`: the file's provenance, None where it records none)."""
    if prov is None:
        return (
            f"{file} records no provenance (written before it, or by another tool): {conv / 'config.json'} and its "
            "tokenizer files were not compared with what the reference ran"
        )
    if _recorded_model(prov, conv)[0] is not None:
        return ""
    if prov.get("hf_config") is None:
        where = "nor a config.json's sha256 (provenance.hf_config)"
    elif (conv / HF_CONFIG).is_file():
        where = f"and {conv / HF_CONFIG} is not the config.json it recorded (provenance.hf_config)"
    else:
        where = f"and {conv} has no {HF_CONFIG} to match the config.json it recorded (provenance.hf_config)"
    return (
        f"{file} records no model (provenance.model), {where}: {conv / 'config.json'} was not compared with the "
        "model the reference ran"
    )


def _recorded_model(prov: dict[str, Any], conv: Path) -> tuple[dict[str, Any] | None, str]:
    """The inference config the reference ran and how it is known ("" from provenance.model; " (as
    CONVERTED/hf_config.json, the config.json it recorded, describes it)"), or (None, "") where neither tells."""
    if prov.get("model") is not None:
        return prov["model"], ""
    digest, hf = prov.get("hf_config"), conv / HF_CONFIG
    if digest is None or not hf.is_file() or sha256_file(hf) != digest:
        return None, ""
    how = f" (as {hf}, the config.json it recorded, describes it)"
    return load_model_args(hf).to_inference_dict(), how


def config_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """`field theirs -> ours` for each inference config field (ModelArgs.to_inference_dict) that differs, but
    for the format fields a conversion changes; [] when the two describe one model."""
    theirs, ours = json.loads(json.dumps(theirs)), json.loads(json.dumps(ours))  # tuples as lists, as recorded
    differ = sorted(k for k in theirs.keys() | ours.keys() if k not in FORMAT_FIELDS and theirs.get(k) != ours.get(k))
    return [f"{k} {theirs.get(k)!r} -> {ours.get(k)!r}" for k in differ]


def _same_rank_files(made: dict[str, Any], conv: Path, tp: int) -> str | None:
    """How the recorded rank files are CONVERTED's, None where they are not: the same files (device and
    inode); the same conversion by the two manifests' sha256 (the recorded ones are the manifest's of the
    folder the reference read, not hashed then: a copy of CONVERTED whose bytes were changed since is still
    this conversion's); or the same size and sampled blocks (a copy of the folder, with or without its
    manifest: `cp -r` keeps none of the first; an audit's reference of a copy was not refused)."""
    files = made.get("files", {})
    if made.get("tp") != tp or set(files) != {rank_file_name(r, tp) for r in range(tp)}:
        return None
    ours = _rank_files(conv, tp, sampled=False)
    if all((ours[n]["dev"], ours[n]["ino"]) == (rec.get("dev"), rec.get("ino")) for n, rec in files.items()):
        return "the same files"
    if all(ours[n]["sha256"] and ours[n]["sha256"] == rec.get("sha256") for n, rec in files.items()):
        return "a copy: both manifests give the same sha256 for every rank file"
    same = all(
        ours[n]["size"] == rec.get("size") and rec.get("sampled") == sampled_sha256(conv / n)
        for n, rec in files.items()
    )
    return "a copy: the same sizes and sampled bytes" if same else None


def _rank_files(folder: Path, tp: int, sampled: bool = True) -> dict[str, dict[str, Any]]:
    """Each rank file's size, device and inode, its sha256 as `folder`'s manifest.json records it ("" without
    one; the bytes are not hashed here) and, with `sampled`, its sampled_sha256."""
    listed = (our_manifest(folder) or {"files": {}})["files"]
    out = {}
    for r in range(tp):
        name = rank_file_name(r, tp)
        st = os.stat(folder / name)
        entry = listed.get(name, {})
        sha = entry["sha256"] if entry.get("size") == st.st_size else ""
        out[name] = {"size": st.st_size, "dev": st.st_dev, "ino": st.st_ino, "sha256": sha}
        if sampled:
            out[name]["sampled"] = sampled_sha256(folder / name)
    return out


def _tokenizer_digests(folder: Path) -> dict[str, str]:
    return {name: sha256_file(folder / name) for name in SIDECARS if (folder / name).is_file()}
