"""Manifest fragments: manifest.json for a conversion whose rank files were written on several machines.

A run that leaves some rank files of its plan unwritten (`shard --ranks 0,3`, or a torchrun share) writes
OUT/manifest-fragment-mp{N}-r{ranks}.json (e.g. manifest-fragment-mp4-r0_3.json, ranks joined by `_`):

  {"format": "dsv41-convert manifest fragment v1", "complete": false, "plan_digest": ..., "source": {...},
   "options": {...}, "rank_files": [every rank file of the plan], "files": {name: {"size", "sha256"}},
   "side_files": {name: {"size", "sha256"}}}

`side_files`: the side files (SIDE_FILES: config.json, hf_config.json, tokenizer files) in the share's OUT
when it wrote the fragment, which `execute` writes before any rank file. The plan digest does not cover
them (a share run from another copy of the source may have another tokenizer.json), so they are recorded.

It is not a manifest (other name, other format: `check` refuses it). Once every rank file and fragment is
gathered in one folder, `merge` checks each rank file's size and sha256 against the fragments, checks that
all fragments (and done records) come from one plan, checks the side files (below), writes a done record
for each file (so `shard --resume` there skips it), writes manifest.json and removes the fragments it
supersedes (drop_superseded_fragments; also once `shard` writes manifest.json, and for fragments an earlier
version left beside a manifest that lists their files as they record them). `import_fragments` lets `shard
--resume` do the same (it writes the side files again from its own source, so it checks none).

Also refused at merge: a fragment whose rank_files are not one conversion's output files or whose files are
not size-and-sha256 records of some of them, a .safetensors file in the folder that is not a rank file of
the plan, fragments whose sources name different Hub revisions, and (no fragments left) a manifest.json that
does not describe the folder; with the caller's `shares_agree` (the CLI's: convert.unshard.shares_agree, also
run by `shard --resume` of a gathered folder), shares converted from sources of one layout but other bytes (the
plan digest covers the index and the headers, not the weights) whose replicated tensors differ. Not caught: such
sources that differ only in the tensors split across the ranks.

Side files at merge. Caught: one that differs in size or sha256 from the fragments' record, one recorded but
missing, one that two fragments record differently or that one records and another does not, one in the
folder that no fragment records. Not caught: anything in a fragment without `side_files` (written before
this version; the merge names those fragments in `side_files_unchecked`, and when none has the record it
only requires config.json and hf_config.json), and a share whose own side files were wrong when it wrote
its fragment (it records what it finds).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsv41_convert import interrupts
from dsv41_convert.errors import NOT_JSON, OutputError, first_few
from dsv41_convert.file_kinds import refuse_non_file
from dsv41_convert.progress import Progress
from dsv41_convert.store.file_digest import Recorded, mismatches, sha256_file
from dsv41_convert.store.index import INDEX_NAME
from dsv41_convert.store.lock import LOCK_NAME, hold, refuse_held
from dsv41_convert.store.manifest import (
    DONE_DIR,
    FRAGMENT_GLOB,
    MANIFEST,
    REQUIRED_SIDECARS,
    SIDE_FILES,
    SIDECARS,
    atomic_write,
    fsync_path,
    read_done,
    remove_stale_temporaries,
    source_info,
    write_done,
    write_manifest_from,
)
from dsv41_convert.store.manifest_check import check_folder, finish_export, our_manifest, read_manifest
from dsv41_convert.store.manifest_check import is_record as _is_record
from dsv41_convert.store.rank_names import RANK_FILE, rank_file_name, rank_files_in

FRAGMENT_FORMAT = "dsv41-convert manifest fragment v1"
COPY_IT = "; copy it from the machine that wrote it"


def fragment_name(tp: int, ranks: list[int]) -> str:
    return f"manifest-fragment-mp{tp}-r{'_'.join(str(r) for r in sorted(ranks))}.json"


def write_fragment(out: Path, plan, options: dict[str, Any], done: list[str]) -> Path:
    """The fragment for the rank files in `done` (each has a done record for this plan) and the side files in
    `out` (the run wrote them before its rank files)."""
    files = {}
    for name in done:
        rec = read_done(out, name)
        files[name] = {"size": rec["size"], "sha256": rec["sha256"]}
    side_files = {}
    for name in SIDE_FILES:
        path = out / name
        if path.is_file():
            side_files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    ranks = [f.rank for f in plan.files if f.file in files]
    fragment = {
        "format": FRAGMENT_FORMAT,
        "complete": False,
        "plan_digest": plan.digest(),
        "source": source_info(plan),
        "options": options,
        "rank_files": [f.file for f in plan.files],
        "files": files,
        "side_files": side_files,
    }
    path = out / fragment_name(plan.tp, ranks)
    atomic_write(path, (json.dumps(fragment, indent=2) + "\n").encode())
    return path


# what a merge reads besides the lists, and the JSON kind of each
_FRAGMENT_FIELDS = {"plan_digest": (str, "a string"), "source": (dict, "an object"), "options": (dict, "an object")}


def read_fragments(out: Path) -> dict[str, dict[str, Any]]:
    """{fragment file name: fragment} for every fragment in `out`; OutputError names an unreadable one."""
    frags = {}
    for path in sorted(Path(out).glob(FRAGMENT_GLOB)):
        refuse_non_file(path, OutputError)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, *NOT_JSON) as exc:
            raise OutputError(
                f"{path}: not readable JSON ({exc}); copy it again from the machine that wrote it"
            ) from exc
        ok = isinstance(data, dict) and data.get("format") == FRAGMENT_FORMAT
        ok = ok and isinstance(data.get("files"), dict) and isinstance(data.get("rank_files"), list)
        side = data.get("side_files", {}) if isinstance(data, dict) else None
        ok = ok and isinstance(side, dict) and all(_is_record(rec) for rec in side.values())
        if not ok:
            raise OutputError(f"{path}: not a {FRAGMENT_FORMAT!r} file")
        wrong = [
            f"{key} is not {what}"
            for key, (kind, what) in _FRAGMENT_FIELDS.items()
            if not isinstance(data.get(key), kind)
        ]
        if wrong:
            raise OutputError(f"{path}: {'; '.join(wrong)}; copy it again from the machine that wrote it")
        problem = _bad_entries(data)
        if problem:
            raise OutputError(f"{path}: {problem}; copy it again from the machine that wrote it")
        frags[path.name] = data
    return frags


def _bad_entries(frag: dict[str, Any]) -> str:
    """What is wrong with a fragment's lists ("" when nothing): rank_files must name a conversion's output
    files, plain .safetensors names in OUT (a shard's: model0-mpN ... model{N-1}-mpN, in rank order), files a
    size and sha256 for some of them, side_files only the SIDE_FILES."""
    names = frag["rank_files"]
    plain = all(isinstance(n, str) and n.endswith(".safetensors") and Path(n).name == n for n in names)
    if not names or not plain or len(set(names)) != len(names):
        return f"rank_files {first_few([str(n) for n in names]) or '[]'} are not the output files of one conversion"
    if RANK_FILE.fullmatch(names[0]) and names != [rank_file_name(r, len(names)) for r in range(len(names))]:
        return f"rank_files {first_few(names)} are not the {len(names)} rank files of one tp-{len(names)} conversion"
    stray = [str(n) for n in frag["files"] if n not in names]
    if stray:
        return f"files lists {first_few(stray)}, not among its rank_files"
    bad = [n for n, rec in frag["files"].items() if not _is_record(rec)]
    if bad:
        return f"files[{bad[0]!r}] is not a record of size and sha256"
    odd = [str(n) for n in frag.get("side_files", {}) if n not in SIDE_FILES]
    if odd:  # write_fragment records SIDE_FILES only
        return f"side_files lists {first_few(odd)}, not a side file a share writes ({', '.join(SIDE_FILES)})"
    return ""


def import_fragments(out: Path, plan_digest: str) -> list[str]:
    """For `shard --resume` in a gathered folder: a done record for each rank file that a fragment of this
    plan lists and whose size and sha256 match. -> the files recorded. A fragment of another plan is an error."""
    recorded = []
    for name, frag in read_fragments(out).items():
        if frag.get("plan_digest") != plan_digest:
            # its rank files go with it: the fragment alone removed, they were refused next as no run's of ours
            theirs = [f for f in sorted(frag["files"]) if (out / f).exists()]
            with_them = f" and the rank files it lists ({first_few(theirs)})" if theirs else ""
            raise OutputError(
                f"{out / name}: a fragment from a run with other options or another source (plan digest "
                f"{str(frag.get('plan_digest'))[:12]}, now {plan_digest[:12]}); remove it{with_them}, or use "
                "--overwrite"
            )
        listed = {}
        for file, rec in frag["files"].items():
            done = read_done(out, file)
            if done is None or done.get("plan_digest") != plan_digest:
                listed[file] = (out / file, Recorded(rec["size"], rec["sha256"], name))
        for file, problem in mismatches(listed).items():
            if problem is None:
                rec = frag["files"][file]
                write_done(out, file, rec["size"], rec["sha256"], plan_digest)
                recorded.append(file)
    return recorded


def forget_stale(out: Path, plan_digest: str, rewriting: frozenset[str] = frozenset()) -> list[str]:
    """Before a run (re)writes rank files in `out`: remove manifest.json, which would describe files about
    to change, every fragment of another plan (an --overwrite replaces that conversion), and each fragment of
    this plan that records a file in `rewriting` (its record is of the bytes about to be replaced: a merge
    would call the new file corrupt) where each of its other files has a done record of this plan here (the
    folder's own record of it, which the run's manifest or fragment carries on; a fragment of a share gathered
    from another machine, whose files have none, is kept).
    -> the names removed"""
    gone = [MANIFEST] if (out / MANIFEST).is_file() else []
    frags = read_fragments(out)
    gone += [name for name, frag in frags.items() if frag.get("plan_digest") != plan_digest]
    gone += [name for name, frag in frags.items() if name not in gone and _superseded(out, frag, rewriting)]
    for name in gone:
        (out / name).unlink(missing_ok=True)  # a share of the ranks beside us may have done it
    if gone:
        fsync_path(out)
    return gone


def drop_superseded_fragments(out: Path) -> list[str]:
    """Once manifest.json is written: remove the fragments it supersedes (of its plan, each file they record
    listed in it with that size and sha256), so that a finished folder holds the manifest and no fragment a
    later `manifest OUT` would merge again (a side file the manifest lists and they do not, such as a tokenizer
    a gathered folder's resume copied in, was refused there while `check` passed). The folder is put on the
    disk first: a power cut leaves the manifest with or without them, never neither. A fragment that records
    other bytes stays (a share gathered again: the next merge names it).
    -> the names removed"""
    gone = superseded(out, read_fragments(out))
    if gone:
        fsync_path(out)  # the manifest's rename first (atomic_write puts its bytes, not the folder's entry, there)
        for name in gone:
            (out / name).unlink(missing_ok=True)  # another share finishing at once may have done it
        fsync_path(out)
    return gone


def superseded(out: Path, frags: dict[str, dict[str, Any]]) -> list[str]:
    """The names of `frags` (read_fragments') that `out`'s manifest.json supersedes: of its plan, each file
    they record listed in it with that size and sha256 ([] without a manifest of ours)."""
    manifest = our_manifest(out)
    if manifest is None:
        return []
    listed = manifest["files"]
    return [
        name
        for name, frag in frags.items()
        if frag.get("plan_digest") == manifest.get("plan_digest")
        and all(_entry(listed.get(file)) == _entry(rec) for file, rec in frag["files"].items())
    ]


def _entry(rec: dict[str, Any] | None) -> tuple[Any, Any] | None:
    return None if rec is None else (rec.get("size"), rec.get("sha256"))


def _superseded(out: Path, frag: dict[str, Any], rewriting: frozenset[str]) -> bool:
    """Whether a fragment of this plan records a file in `rewriting` and each of its other files has a done
    record of that plan in `out` (forget_stale)."""
    files = frag["files"]
    digest = frag.get("plan_digest")
    return bool(rewriting & files.keys()) and all(
        file in rewriting or (read_done(out, file) or {}).get("plan_digest") == digest for file in files
    )


def merge(
    out: Path, progress: Progress | None = None, shares_agree: Callable[[Path, int], list[str]] | None = None
) -> dict[str, Any]:
    """Check every rank file of a gathered folder against its fragment and write manifest.json.

    shares_agree(out, tp): once every file holds its record, what else keeps the manifest from being written
    (the CLI's: the replicated tensors compared across the rank files, which shares of two sources with one
    layout fail: their plan digests are equal)
    Raises OutputError naming every missing, resized or corrupt file and every fragment of another plan.
    -> summary: out, manifest path, rank files, fragments read
    Holds `out` alone (store/lock.py): no `shard` may be writing there meanwhile.
    """
    out = Path(out)
    check_mergeable(out)
    interrupts.check()  # one postponed since an import: before the lock and the hashes (an audit: it merged)
    with hold(out):
        # the temporary of a merge killed while it wrote the manifest: `check` listed it as unchecked ever after
        remove_stale_temporaries(out, lambda name: name == MANIFEST)
        return _merge(out, progress, shares_agree)


def check_mergeable(out: Path) -> None:
    """OutputError (LockedError) for what `merge` refuses of `out` as found, before it holds it: no folder, nothing
    to merge, another run holding it (refuse_held: the lock's words). Nothing is locked or written: the CLI calls
    it before its progress display (a refusal after the display's title read as if the merge had started)."""
    if not out.is_dir():
        what = "not a folder" if out.exists() else "no such folder"
        raise OutputError(f"{out}: {what}; gather the rank files and fragments of every machine in a folder")
    # a source checkpoint, or any folder no run of ours ever held, gets no lock file (one being written does:
    # in use, said by the lock)
    if (out / INDEX_NAME).is_file() or not ((out / LOCK_NAME).exists() or (out / DONE_DIR).exists()):
        _nothing_to_merge(out)
    refuse_held(out)


def _nothing_to_merge(out: Path) -> None:
    """OutputError when `out` holds neither fragments nor a manifest (nothing `manifest` could do there)."""
    if any(out.glob(FRAGMENT_GLOB)) or (out / MANIFEST).is_file():
        return
    what = ""
    if (out / INDEX_NAME).is_file():
        what = " (a Hugging Face checkpoint: `shard` reads it)"
    elif rank_files_in(out) and not (out / DONE_DIR).exists():
        what = (
            " (rank files no dsv41-convert run wrote, e.g. upstream convert.py's: `manifest` records only the files"
            " of `shard` shares; `shard` SRC OUT writes a set with its manifest, `verify` checks these without one)"
        )
    raise OutputError(
        f"{out}: no {FRAGMENT_GLOB} files{what}; copy the fragment each `shard --ranks` run left in its OUT, "
        "with its rank files, into this folder"
    )


def _merge(
    out: Path, progress: Progress | None, shares_agree: Callable[[Path, int], list[str]] | None
) -> dict[str, Any]:
    frags = read_fragments(out)
    if not frags and (out / MANIFEST).is_file():  # the shares finished together: each saw every file done
        return _already_merged(out, progress)
    _nothing_to_merge(out)  # again under the lock: a share may have merged and removed them meanwhile
    first_name, first = _reference_fragment(out, frags)
    exported = {n: f for n, f in frags.items() if f["options"].get("format") is not None}
    if (
        exported
        and (out / MANIFEST).is_file()
        and all(f.get("plan_digest") == read_manifest(out).get("plan_digest") for f in exported.values())
    ):  # an export its last share finished: the fragments are its shares' records
        return _already_merged(out, progress, exported=sorted(exported))
    if superseded(out, frags) == list(frags):  # left beside the manifest that finished them (an earlier version;
        # a run killed before it removed them): merged again, a side file it lists and they do not (a tokenizer a
        # gathered folder's resume copied in) was refused while `check` passed
        return _already_merged(out, progress) | {"fragments_removed": drop_superseded_fragments(out)}
    _not_an_export(out, frags)
    digest = first.get("plan_digest")
    records: dict[str, tuple[dict[str, Any], str]] = {}  # file -> (size/sha256, where it came from)
    problems = []
    foreign: set[str] = set()  # files that a fragment of another plan lists (said once, above)
    for name, frag in frags.items():
        if frag.get("plan_digest") != digest or frag["rank_files"] != first["rank_files"]:
            problems.append(
                f"{name}: from another plan (digest {str(frag.get('plan_digest'))[:12]}) than {first_name} "
                f"(digest {str(digest)[:12]}): other options or another source"
            )
            foreign.update(frag["files"])
            continue
        for file, rec in frag["files"].items():
            _add(records, problems, file, rec, name)
    for file in first["rank_files"]:
        rec = read_done(out, file)
        if rec is not None and rec.get("plan_digest") != digest:
            problems.append(f"{DONE_DIR}/{file}.done.json: from another plan (digest {rec.get('plan_digest')})")
        elif rec is not None:
            _add(records, problems, file, rec, f"{DONE_DIR}/{file}.done.json")
    listed = {}
    for file in first["rank_files"]:
        if file not in records:
            if file not in foreign:
                problems.append(f"{file}: no fragment lists it; gather its rank file and fragment into {out}")
            continue
        rec, where = records[file]
        listed[file] = (out / file, Recorded(rec["size"], rec["sha256"], where, COPY_IT))
    side, unchecked = _side_records(out, frags, problems)
    for file, (rec, where) in side.items():
        listed[file] = (out / file, Recorded(rec["size"], rec["sha256"], where, COPY_IT))
    problems += [problem for problem in mismatches(listed, progress=progress).values() if problem]
    missing = [n for n in REQUIRED_SIDECARS if n not in side and not (out / n).is_file()]
    problems += [f"{n}: missing (every `shard` run writes it); copy it from any machine's OUT" for n in missing]
    problems += [
        f"{p.name}: a .safetensors file that is not a rank file of this conversion; remove it (check would fail)"
        for p in sorted(out.glob("*.safetensors"))
        if p.name not in first["rank_files"]
    ]
    problems += _other_revisions(frags)
    if not problems and shares_agree is not None:
        problems += shares_agree(out, len(first["rank_files"]))
    if problems:
        raise OutputError(f"{out}: cannot write {MANIFEST}: " + "; ".join(problems))
    rank_files = {file: records[file][0] for file in first["rank_files"]}
    interrupts.check()  # one dropped while the files were hashed (interrupts.py): no record after it
    for file, rec in rank_files.items():
        write_done(out, file, rec["size"], rec["sha256"], digest)
    devices = sorted({str(f["options"].get("device")) for f in frags.values()})
    options = first["options"] | {"device": ",".join(devices)}
    if unchecked == list(frags):  # no record at all: as before side files were recorded
        extra = [n for n in SIDECARS if (out / n).is_file()] + list(REQUIRED_SIDECARS)
    else:
        extra = [n for n in SIDE_FILES if n in side]
    path = write_manifest_from(out, first["source"], options, digest, rank_files, extra)
    return {"out": str(out), "manifest": str(path), "rank_files": list(rank_files), "fragments": list(frags),
            "side_files": sorted(side), "side_files_unchecked": unchecked,
            "fragments_removed": drop_superseded_fragments(out)}  # fmt: skip


def _reference_fragment(out: Path, frags: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """(name, fragment) the merge compares every other fragment with: one of the plan whose rank files `out` holds
    the most of, then of the plan most fragments are of, then the first by name. The first by name alone let a
    stale fragment (an earlier tp-2 attempt's, `mp2` sorting before `mp4`) be the plan: the merge called every
    share's fragment foreign, asked for that attempt's rank files to be gathered and the ones there removed."""

    def weight(item: tuple[str, dict[str, Any]]) -> tuple[int, int]:
        frag = item[1]
        held = sum((out / file).is_file() for file in frag["rank_files"])
        alike = sum(
            f.get("plan_digest") == frag.get("plan_digest") and f["rank_files"] == frag["rank_files"]
            for f in frags.values()
        )
        return held, alike

    return max(frags.items(), key=weight)  # the first of the heaviest: the first by name among equals


def _not_an_export(out: Path, frags: dict[str, dict[str, Any]]) -> None:
    """Refuse the fragments of an export's shares (their options name a --format): its config.json and index
    come from the export's plan of SRC, which only `export` makes; merged here, the folder was refused for
    lacking hf_config.json, a file no export writes (an audit)."""
    for name, frag in frags.items():
        fmt = frag["options"].get("format")
        if fmt is not None:
            src = (frag.get("source") or {}).get("path") or "SRC"
            raise OutputError(
                f"{out / name}: a fragment of `export --format {fmt}`, not of `shard`: gather every share's shards "
                f"and fragments here, then {finish_export(out, fmt, src)} (it checks the gathered shards against "
                "their fragments, writes what is missing, config.json, the index and manifest.json)"
            )


def _side_records(
    out: Path, frags: dict[str, dict[str, Any]], problems: list[str]
) -> tuple[dict[str, tuple[dict[str, Any], str]], list[str]]:
    """The side files the fragments agree on, to check against the folder; appends to `problems` each one
    that two fragments record differently, one records and another does not, or that is in `out` with no
    record. -> ({name: (size/sha256, which fragments record it)}, fragments without side-file records)"""
    unchecked = [name for name, frag in frags.items() if "side_files" not in frag]
    recording = {name: frag["side_files"] for name, frag in frags.items() if "side_files" in frag}
    if not recording:
        return {}, unchecked
    side: dict[str, tuple[dict[str, Any], str]] = {}
    for file in SIDE_FILES:
        have = [name for name, recs in recording.items() if file in recs]
        lack = [name for name in recording if name not in have]
        if not have:
            if (out / file).is_file():
                problems.append(
                    f"{file}: no fragment records it (no share wrote it); remove it, or convert again with it in SRC"
                )
            continue
        if lack:
            problems.append(f"{file}: {have[0]} records it, {lack[0]} does not: shares from different sources?")
            continue
        entries = {name: {k: recording[name][file][k] for k in ("size", "sha256")} for name in have}
        first, *others = have
        differ = [name for name in others if entries[name] != entries[first]]
        if differ:
            a, b = entries[differ[0]], entries[first]
            problems.append(
                f"{file}: {differ[0]} and {first} record different files ({a['size']} bytes, sha256 "
                f"{a['sha256'][:16]}... against {b['size']} bytes, {b['sha256'][:16]}...): shares from different "
                "sources? convert them from one"
            )
            continue
        where = first if not others else f"{first} (and {len(others)} more)"
        side[file] = (entries[first], where)
    return side, unchecked


def _already_merged(out: Path, progress: Progress | None, exported: list[str] | None = None) -> dict[str, Any]:
    """The summary of a folder whose last share wrote manifest.json itself (no fragments left to merge), once
    its files hold the sizes and sha256 it lists and no other .safetensors is there, as a merge checks them
    (it compared sizes only: a changed byte, an edited config passed, exit 0; an audit); an OutputError names
    each that does not (a manifest of another conversion, copied in; a file changed since). exported: the
    fragment names of an export its last share finished, which stay beside it (`manifest` merges no export's);
    the summary lists them as `export_fragments` (the CLI said "no fragment left" beside them: an audit)."""
    problems = check_folder(out, progress).problems
    if problems:
        advice = (
            "restore them, or finish the export again with `export SRC OUT --format F --resume`"
            if exported
            else "restore them or convert again; for gathered shares, remove it and merge their fragments again"
        )
        held = "beside its shares' fragments" if exported else "and no fragments"
        raise OutputError(
            f"{out}: holds a {MANIFEST} {held}, but the folder is not the conversion it describes: "
            + "; ".join(problems[:8])
            + ("; ..." if len(problems) > 8 else "")
            + f" (a {MANIFEST} of another conversion, or its files changed since it was written: {advice})"
        )
    rank_files = [f for f in read_manifest(out)["files"] if f.endswith(".safetensors")]
    return {"out": str(out), "manifest": str(out / MANIFEST), "rank_files": rank_files, "fragments": [],
            "export_fragments": exported or [], "already_merged": True}  # fmt: skip


def _other_revisions(frags: dict[str, dict[str, Any]]) -> list[str]:
    """Shares whose sources name different Hub revisions (the download record's; a copy made otherwise names
    none, and is not compared): their rank files need not agree even where the plan digests do."""
    named = {name: rev for name, frag in frags.items() if (rev := (frag.get("source") or {}).get("revision"))}
    if len(set(named.values())) < 2:
        return []
    a, rev_a = next(iter(named.items()))
    b, rev_b = next((n, r) for n, r in named.items() if r != rev_a)
    return [f"{b}: converted from Hub revision {rev_b}, {a} from {rev_a}; convert every share from one"]


def _add(records, problems, file: str, rec: dict[str, Any], where: str) -> None:
    entry = {"size": rec.get("size"), "sha256": rec.get("sha256")}
    if file in records and records[file][0] != entry:
        earlier = [w for w in (where, records[file][1]) if w.startswith(DONE_DIR)]
        hint = (
            f" ({earlier[0]} is from an earlier merge or run here: if {file} was gathered again, remove that record)"
            if earlier
            else ""
        )
        problems.append(f"{file}: {where} and {records[file][1]} record different sizes or sha256{hint}")
    records.setdefault(file, (entry, where))
