"""Run a ConversionPlan: safety checks, then one job per rank file over K worker processes, then the manifest.

Work is shared three ways: `ranks` picks output ranks, a torchrun launch (RANK / WORLD_SIZE in the
environment) gives each process every WORLD_SIZE-th of the selected files, and `workers` runs that
share over K local processes. Finished files carry a done record; `resume` skips those whose size and
sha256 still match it, and continues an unfinished file from the last verified checkpoint of its
journal (write.py, journal.py). manifest.json is written once every rank file of the plan is done;
until then each run leaves a manifest fragment of the files done so far, which `dsv41-convert manifest`
merges once the rank files of several machines are gathered in one folder (manifest_merge.py). In such
a gathered folder `resume` takes the fragments' files as done too. A shard run that writes manifest.json
removes the fragments it supersedes (an export keeps its shares'). A run that writes anything first
removes manifest.json (and, under `overwrite`, fragments of another plan): no manifest outlives a change
to the files it lists. OUT is locked before the first write (store/lock.py): a run of every rank holds it
alone; a share of the ranks (`ranks`, a torchrun process) holds it shared and its own rank files alone.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import queue
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from fnmatch import fnmatch
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from dsv41_convert import interrupts, torchrun
from dsv41_convert.convert.die_with import SharedFiles, alive, die_with_parent, fork_server_pid, start_fork_server
from dsv41_convert.convert.plan import ConversionPlan, OutTensor, RankFile
from dsv41_convert.convert.stream import numpy_computes
from dsv41_convert.convert.workers import auto_workers
from dsv41_convert.convert.write import (
    CHUNK_BYTES,
    COPIED,
    JOURNAL_BYTES,
    Progress,
    commit,
    write_partial,
    write_rank_file,
)
from dsv41_convert.errors import OutputError, PlanError, RankFailedError, first_few
from dsv41_convert.file_kinds import SPECIAL, nearest_existing, refuse_non_folder, refuse_unmakeable, special_kind
from dsv41_convert.numbers import byte_amounts, counted
from dsv41_convert.progress import add_seconds
from dsv41_convert.store import journal
from dsv41_convert.store.index import INDEX_NAME
from dsv41_convert.store.journal import journal_path
from dsv41_convert.store.lock import hold, is_lock_entry, refuse_held
from dsv41_convert.store.made_folder import made_folder
from dsv41_convert.store.manifest import (
    DONE_DIR,
    FRAGMENT_GLOB,
    HF_CONFIG,
    MANIFEST,
    SIDE_FILES,
    SIDECARS,
    atomic_write,
    done_path,
    finished,
    fsync_path,
    read_done,
    remove_stale_temporaries,
    temporary_target,
    write_done,
    write_manifest,
)
from dsv41_convert.store.manifest_check import our_manifest
from dsv41_convert.store.manifest_merge import (
    drop_superseded_fragments,
    forget_stale,
    import_fragments,
    read_fragments,
    write_fragment,
)
from dsv41_convert.store.plan_claims import claimed, live_claims
from dsv41_convert.store.rank_names import RANK_FILE
from dsv41_convert.store.source_stamps import (
    Stamps,
    changed_since,
    differing,
    record_stamps,
    source_stamps,
    stamps_digest,
)


@dataclass(frozen=True)
class Sidecars:
    """The files a run writes beside the plan's own, and the options its manifest records (the rank
    folder's sidecars when not given: tokenizer, config.json, hf_config.json).

    before(src, out): called before the plan's files are written; after(out): once every file of the
    plan is done, just before manifest.json. Each returns the names of the files it wrote, which the
    manifest hashes. `options` replace the manifest's tp / expert_dtype (device is added).
    """

    before: Callable[[Path, Path], list[str]]
    after: Callable[[Path], list[str]]
    options: dict[str, Any]
    records: tuple[str, ...] = ()  # files that say a run is finished (an export's config.json and index)


class FileDone(NamedTuple):
    """One rank file written by this run: its size and sha256, the bytes kept from a partial file, and
    when and where it was written (`time.monotonic()`, the same clock in every process on one machine;
    the writing process; its stage seconds: write.write_partial's `stats`)."""

    file: str
    size: int
    sha: str
    kept: int
    worker: int
    start: float
    end: float
    stages: dict[str, float]


def disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def _outside_source(src: Path, out: Path, what: str) -> Path:
    """Nothing is written into the source: OUT (`what`: "folder" or "file") must not be SRC or inside it,
    by its path or by what it is on disk (a bind mount or a hard link of SRC under another path).
    -> out resolved"""
    src, out = src.resolve(), out.resolve()
    if out.is_relative_to(src):  # SRC itself included
        raise OutputError(f"{out}: the output {what} is the source folder {src} or inside it; choose another OUT")
    inside = _folders_of(src)
    for folder in (out, *out.parents):
        try:
            st = folder.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in inside:
            raise OutputError(
                f"{out}: the output {what} is the source folder {src} or inside it ({folder} is "
                f"{inside[st.st_dev, st.st_ino]} under another path: a bind mount or link); choose another OUT"
            )
    return out


SOURCE_FOLDERS_LOOKED_AT = 10_000  # a checkpoint has a handful (.cache/...); past this the rest is not walked


def _folders_of(src: Path) -> dict[tuple[int, int], Path]:
    """(device, inode) -> path of SRC and every folder under it (links not followed), for OUT under another
    path: a bind mount of SRC or of a folder inside it (an audit: only SRC itself was compared)."""
    found: dict[tuple[int, int], Path] = {}
    for top, _, _ in os.walk(src):
        try:
            st = os.stat(top, follow_symlinks=False)
        except OSError:
            continue
        found[st.st_dev, st.st_ino] = Path(top)
        if len(found) >= SOURCE_FOLDERS_LOOKED_AT:
            break
    return found


def check_output(src: Path, out: Path) -> None:
    """OUT must not be SRC or inside it, must hold none of SRC's files under another name, and must be a
    folder if it exists."""
    refuse_non_folder(out, OutputError)
    out = _outside_source(src, out, "folder")
    if out.is_dir():
        _no_source_file_among(src, list(out.iterdir()))


def _no_source_file_among(src: Path, outputs: list[Path]) -> None:
    """None of `outputs` is what one of SRC's symbolic links leads to: written or removed (a new file renamed
    over it), it would change the source. (A hard link keeps the old bytes under SRC's name.)"""
    source = {}
    for path in src.iterdir() if src.is_dir() else ():
        try:
            st = path.stat() if path.is_symlink() else None
        except OSError:
            continue
        if st is not None:
            source[(st.st_dev, st.st_ino)] = path
    for path in outputs:
        try:
            st = path.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in source:
            raise OutputError(
                f"{source[(st.st_dev, st.st_ino)]}: is the file {path} (a link), which this run would write "
                "or remove; choose another OUT, or give SRC a copy of its own"
            )


def check_output_file(src: Path, out: Path, overwrite: bool, inputs: Sequence[tuple[Path, str]] = ()) -> None:
    """An output file OUT must lie outside the source folder SRC, must not be a folder, nor a FIFO, a socket or a
    device (links followed), nor one of the run's `inputs` ((path, what it is) pairs: _no_input_at), and is
    replaced only with --overwrite. The file is written beside OUT and renamed over it, so a FIFO there became a
    regular file, and as root `/dev/null` did (a helper's hunt)."""
    if out.is_symlink() and not out.exists():  # resolve() raised RuntimeError on a loop; a rename replaced the link
        raise OutputError(f"{out}: a link to {os.readlink(out)}, which does not exist; give a file path")
    refuse_unmakeable(out, OutputError)  # as given: resolved, a dangling link above it would vanish
    out = _outside_source(src, out, "file")
    if out.is_dir():
        raise OutputError(f"{out}: is a folder; give the path of the file to write")
    if special_kind(out):  # not "exists; pass --overwrite", which replaced it
        raise OutputError(f"{out}: not a regular file ({SPECIAL}); the output, renamed over it, would replace it")
    _no_source_file_among(src, [out])
    _no_input_at(out, inputs)
    if out.exists() and not overwrite:
        raise OutputError(f"{out}: exists; pass --overwrite to replace it")


def _no_input_at(out: Path, inputs: Sequence[tuple[Path, str]]) -> None:
    """OutputError where the entry OUT is one of the run's input files (reference-logits' --prompts file, an image
    a prompt names; `inputs`: (path, what it is), links followed): the output renamed over it replaced the input
    (with --overwrite, exit 0), and an image replaced so left a reference recording a sha256 that no image
    matches any more, which verify refuses for good (a helper's hunt). OUT a link to an input is not refused:
    the rename replaces the link."""
    try:
        here = out.lstat()
    except OSError:
        return
    for path, what in inputs:
        try:
            there = path.stat()
        except OSError:
            continue
        if (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino):
            raise OutputError(f"{out}: is {what} ({path}), which this run reads; choose another OUT")


def check_empty(
    out: Path, resume: bool, overwrite: bool, others: frozenset[str] | None = None, own: frozenset[str] = frozenset()
) -> None:
    """Unless --resume or --overwrite, OUT holds nothing but its lock and, for a share of the ranks
    (`others` given), what the other shares of this conversion write: `others` (their rank files and
    partial files) and the files every share writes (sidecars, done records, fragments). own: the files this share
    writes, named as such where they are all it finds (an earlier run of the share)."""
    if resume or overwrite:
        return
    shared = others is not None
    found = sorted(
        p.name
        for p in out.iterdir()
        if not (is_lock_entry(p.name) or (shared and (p.name in others or _common_output(p.name))))
    )
    if found:
        what = "files other than the other ranks' files" if shared else "not empty"
        if shared and own and all(name.removesuffix(".partial") in own for name in found):  # called the others'
            what = f"holds {counted(len(found), 'file')} of this share from an earlier run"
        raise OutputError(
            f"{out.resolve()}: {what} ({first_few(found)}); "
            "pass --resume to continue a run or --overwrite to replace it"
        )


HF_SHARD = re.compile(r"model(-\d+-of-\d+)?\.safetensors")  # a Hugging Face checkpoint's shard names


def _forget_records(out: Path, digest: str, sidecars: Sidecars | None) -> None:
    """Remove manifest.json (and other plans' fragments) and the sidecars' records of a finished run, durably."""
    forget_stale(out, digest)
    gone = [out / name for name in (sidecars.records if sidecars else ()) if (out / name).is_file()]
    for path in gone:
        path.unlink()
    if gone:
        fsync_path(out)


def _other_conversions_files(plan: ConversionPlan, out: Path) -> tuple[set[str], bool, set[str], list[str]]:
    """-> (the plan's file names, whether they are rank files, the side file of the other kind of conversion
    (the index beside rank files, hf_config.json beside an export), the names in OUT of another conversion's
    files: rank files or Hugging Face shards not of this plan, that side file, and their .partial files)"""
    mine = {f.file for f in plan.files}
    shard_plan = all(RANK_FILE.fullmatch(name) for name in mine)
    foreign = {INDEX_NAME} if shard_plan else {HF_CONFIG}
    others = sorted(
        p.name
        for p in out.iterdir()
        if (n := p.name.removesuffix(".partial")) not in mine
        and (RANK_FILE.fullmatch(n) or HF_SHARD.fullmatch(n) or n in foreign)
    )
    return mine, shard_plan, foreign, others


def _refuse_files_not_ours(plan: ConversionPlan, out: Path) -> None:
    """OutputError naming the files in OUT at our names (this plan's, another conversion's, the side files) that
    no run of ours wrote: they are never removed or written over, by --overwrite or --resume. Checked before
    "not empty", whose advice (--resume or --overwrite) both refuse for them (an audit: rank files upstream
    convert.py wrote)."""
    mine, _, _, others = _other_conversions_files(plan, out)
    if not _a_run_of_ours_was_here(out):  # what has our names is not ours
        ours_by_name = (*mine, *SIDE_FILES, INDEX_NAME, MANIFEST)  # rank files or shards, and the side files
        _refuse_strangers(out, sorted({*others, *(n for n in ours_by_name if (out / n).exists())}))
    else:  # a file at one of this plan's names that no record of ours names is not ours either (an audit: a
        # user's file at a shard's name, after a killed run, was written over by --resume); one of exactly the
        # planned size is (a run of a version before 2026-12-05 killed between its rename and its record)
        listed, size = _listed_by_our_records(out), {f.file: f.nbytes for f in plan.files}
        _refuse_strangers(out, sorted(n for n in mine if (out / n).is_file() and not _written_by_us(out, n)
                                      and n not in listed and (out / n).stat().st_size != size[n]))  # fmt: skip


def _no_other_conversion(
    plan: ConversionPlan,
    out: Path,
    remove: bool,
    dry_run: bool = False,
    before_removing: Callable[[], None] | None = None,
) -> list[str]:
    """A folder holds one conversion. What OUT holds of another (rank files of another tp, or an export's
    shards and index beside rank files, or rank files and hf_config.json beside an export's shards, and
    their .partial files) is removed with its records where `remove` (--overwrite, the folder held alone),
    else an OutputError names it: left there, `check` passed it unlisted and verify loaded the wrong files.
    Files no run of ours wrote (no record, e.g. a downloaded checkpoint) are never removed or written over:
    the caller refuses them first (_refuse_files_not_ours). dry_run: the same refusals, nothing removed.
    before_removing: called once the refusals are passed, before the first file is removed.
    -> the names of the other conversion's files it removed (dry_run: would remove)"""
    _, shard_plan, foreign, others = _other_conversions_files(plan, out)
    if not others:
        return []
    if not remove:
        what = f"tp {plan.tp} rank files" if shard_plan else "an export"
        raise OutputError(
            f"{out.resolve()}: holds files of another conversion ({first_few(others)}), not of this one ({what}); "
            "remove them, or pass "
            "--overwrite (alone) to replace them"
        )
    ours = {n for n in others if _written_by_us(out, n)}
    # e.g. a downloaded checkpoint: --overwrite replaces our conversions, nobody else's files. A foreign side
    # file goes with our rank files or shards, or alone where OUT holds our records and no such file at all:
    # what a run stopped before its first one (an input error) left (an audit: --resume said "pass
    # --overwrite" and --overwrite refused it)
    alone = all(n in foreign for n in others)
    strangers = [n for n in others if n not in ours and (n not in foreign or not (ours or alone))]
    _refuse_strangers(out, sorted(set(strangers), key=lambda n: (not HF_SHARD.fullmatch(n), n)))
    if dry_run:
        return others
    interrupts.check()  # one postponed in the lock's wait or the checks: nothing removed (an audit: it was)
    if before_removing is not None:
        before_removing()
    for name in others:
        file = name.removesuffix(".partial")
        for path in (out / name, done_path(out, file), journal_path(out, file)):
            path.unlink(missing_ok=True)
    return others


def _a_run_of_ours_was_here(out: Path) -> bool:
    """OUT holds our records: the run folder, a share's fragment (a folder gathered from several machines
    holds only the visible files), or a manifest.json in our format."""
    return (out / DONE_DIR).is_dir() or any(out.glob(FRAGMENT_GLOB)) or our_manifest(out) is not None


def _refuse_strangers(out: Path, names: list[str]) -> None:
    """OutputError naming `names`, files in OUT that no run of ours wrote, if there are any."""
    if names:
        raise OutputError(
            f"{out.resolve()}: holds {first_few(names)}, which no dsv41-convert run wrote there (no record in "
            f"{DONE_DIR}/); not replaced or removed, even with --overwrite: choose another OUT, or remove them "
            "yourself"
        )


def _forget_done(out: Path, files: list[str]) -> None:
    """Remove the done records of `files` (durably) before they are written again."""
    gone = [p for p in (done_path(out, f) for f in files) if p.exists()]
    for path in gone:
        path.unlink(missing_ok=True)
    if gone:
        fsync_path(gone[0].parent)


def _remove_replaced(out: Path, files: list[str]) -> None:
    """Remove the files an --overwrite replaces before any is written again: a run that then fails left the
    replaced run's rank files beside its own, a whole set of two conversions that a loader without our
    records (upstream generate.py) took for one (an audit). Their space is free for the new files too."""
    gone = [p for p in (out / f for f in files) if p.is_file()]
    for path in gone:
        path.unlink(missing_ok=True)  # a process of the same torchrun launch may have removed it (its own rank)
    if gone:
        fsync_path(out)
    for f in files:  # the files are gone: nothing left to take for a user's (a stale marker made one ours)
        (out / DONE_DIR / (f + REPLACING)).unlink(missing_ok=True)


REPLACING = ".replacing"  # DONE_DIR/FILE.replacing: FILE is an --overwrite's to remove (one per file: shares at once)


def _mark_replacing(out: Path, files: list[str]) -> None:
    """Say which of OUT's files an --overwrite is about to remove, before their records go: killed in between,
    they are still ours to the next run (`_listed_by_our_records`), not a user's files. Removed with the files
    (`_remove_replaced`), or else with the next manifest.json."""
    if files:
        (out / DONE_DIR).mkdir(exist_ok=True)
        for file in files:
            (out / DONE_DIR / (file + REPLACING)).touch()
        fsync_path(out / DONE_DIR)


def _listed_by_our_records(out: Path) -> set[str]:
    """The files OUT's fragments (shares gathered from other machines), manifest.json and an --overwrite under
    way (REPLACING) name."""
    listed = {f for frag in read_fragments(out).values() for f in frag.get("files") or ()}
    listed |= {p.name.removesuffix(REPLACING) for p in (out / DONE_DIR).glob("*" + REPLACING)}
    return listed | set((our_manifest(out) or {}).get("files") or ())


def _written_by_us(out: Path, name: str) -> bool:
    """A file in OUT that a run of ours wrote or was writing: a .partial, or a file with a done record or a
    journal."""
    file = name.removesuffix(".partial")
    return name != file or done_path(out, file).exists() or journal_path(out, file).exists()


def shard_writes(name: str) -> bool:
    """Whether a shard run writes an entry of this name in OUT (rank files, their partial files, side files,
    records, fragments, the lock)."""
    return bool(RANK_FILE.fullmatch(name.removesuffix(".partial"))) or _common_output(name) or is_lock_entry(name)


def _common_output(name: str) -> bool:
    """Written by every share of a conversion into one folder (atomic_write's temporaries included)."""
    name = temporary_target(name) or name
    return name in (DONE_DIR, MANIFEST, *SIDE_FILES) or fnmatch(name, FRAGMENT_GLOB)


def select_files(plan: ConversionPlan, ranks: list[int] | None, env: dict[str, str] | None = None) -> list[RankFile]:
    """The rank files this process writes: --ranks, then its torchrun share."""
    env = os.environ if env is None else env
    files = list(plan.files)
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < plan.tp]
        if bad:
            raise PlanError(f"--ranks {bad}: out of range for --tp {plan.tp} (0..{plan.tp - 1})")
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        if twice:  # a typo of another rank, as likely as not (1,1 for 1,2): that rank would go unwritten
            raise PlanError(f"--ranks {twice}: given more than once; name each rank file to write once")
        files = [f for f in files if f.rank in set(ranks)]
    world, me = torchrun.world(env) or 1, torchrun.rank(env)
    return files[me::world] if world > 1 else files


def check_device(device: str) -> None:
    """PlanError unless the run can compute on `device` (--device): cpu, or cuda where torch sees a card."""
    if device not in ("cpu", "cuda"):
        raise PlanError(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise PlanError("--device cuda: torch sees no CUDA device here; use --device cpu")


def check_options(
    plan: ConversionPlan, out: Path, resume: bool, overwrite: bool, ranks: list[int] | None, device: str
) -> list[RankFile]:
    """PlanError for what a run and its --dry-run refuse before looking into OUT: --resume with --overwrite,
    --device, --ranks, OUT inside the source (or the source inside OUT). -> the rank files this process writes"""
    if resume and overwrite:
        raise PlanError("--resume and --overwrite: pick one (--resume continues OUT's run, --overwrite replaces it)")
    check_device(device)
    mine = select_files(plan, ranks)
    check_output(Path(plan.src), Path(out))
    return mine


def check_out(
    plan: ConversionPlan,
    out: Path,
    resume: bool,
    overwrite: bool,
    ranks: list[int] | None,
    device: str,
    records: tuple[str, ...] = (),
) -> list[RankFile]:
    """check_options, then what OUT as found now refuses, in the run's words: a folder the run could not make
    or write into, another process holding it, files at our names no run of ours wrote, not empty (without
    --resume or --overwrite), another conversion's files (unless --overwrite replaces them), too little free
    space (but under --resume, whose need is known once its files are hashed), crediting what an --overwrite
    removes first as the dry run does (_replaced; a torchrun process's also the launch's replaced files). Nothing
    is made, locked or written. The CLI calls it before its
    progress display (a refusal after the display's title read as if the run had started), --dry-run through
    check_destination; `execute` checks OUT again once it holds it.
    records: the sidecars' records (Sidecars.records), which an --overwrite of the whole folder removes first.
    -> the rank files this process writes"""
    mine, others, other_conversion = _out_as_found(plan, out, resume, overwrite, ranks, device)
    if mine and not resume:
        replaced = _replaced(Path(out), mine, others, other_conversion, records)
        replaced += _replaced_first_by_the_launch(plan, Path(out), mine, others, overwrite, ranks)
        _require_space_for(plan, Path(out), mine, replaced if overwrite else [])
    return mine


def _out_as_found(
    plan: ConversionPlan, out: Path, resume: bool, overwrite: bool, ranks: list[int] | None, device: str
) -> tuple[list[RankFile], frozenset[str] | None, list[str]]:
    """check_out's checks. -> (the rank files this process writes, the other shares' files in OUT's view (_others;
    None for a run of every file, or where OUT is no folder yet), another conversion's files an --overwrite would
    remove)"""
    mine = check_options(plan, out, resume, overwrite, ranks, device)
    if not mine:  # a share holding no file: the run touches nothing (_nothing_to_write)
        return [], None, []
    out = Path(out)
    _require_writable(out)
    if not out.is_dir():
        return mine, None, []
    others = _others(plan, mine, ranks)
    refuse_held(out, shared=others is not None, files=[f.file for f in mine] if others is not None else ())
    _refuse_files_not_ours(plan, out)
    check_empty(out, resume, overwrite, others, frozenset(f.file for f in mine))
    return mine, others, _no_other_conversion(plan, out, remove=overwrite and others is None, dry_run=True)


def check_destination(
    plan: ConversionPlan,
    out: Path,
    resume: bool,
    overwrite: bool,
    ranks: list[int] | None = None,
    records: tuple[str, ...] = (),
    device: str = "cpu",
) -> list[RankFile]:
    """What `execute` would refuse before writing, for --dry-run: --ranks, --device, OUT (held by a running writer;
    its free space, but under --resume), and under --resume the records of another plan; nothing is kept locked,
    hashed or written.
    records: the sidecars' records (Sidecars.records), which an --overwrite of the whole folder removes first.
    -> the rank files this process would write"""
    mine, others, other_conversion = _out_as_found(plan, out, resume, overwrite, ranks, device)
    if not mine:  # a share holding no file: the run touches nothing (_nothing_to_write)
        return []
    out = Path(out)
    replaced = _replaced(out, mine, others, other_conversion, records)
    if out.is_dir():
        if others is not None:
            live = live_claims(out, plan.digest())  # the shares running now, as the run's claim sees them
            _same_plan_as_the_other_shares(out, plan, mine, overwrite, ranks is not None, live)
        if resume:
            _check_resumable(out, mine, plan.digest())
        if resume or others is not None:
            src = Path(plan.src)
            stamps = source_stamps(src)
            kept = None
            if not resume:
                gone = _replaced_first_by_the_launch(plan, out, mine, others, overwrite, ranks, stamps)
                kept = [f for f in _kept(plan, mine) if f not in gone]
                replaced += gone
            _check_source_unchanged(out, src, stamps, kept)
    if not resume:  # as the run checks before its first byte (a resume's need is known once its files are hashed)
        _require_space_for(plan, out, mine, replaced if overwrite else [])
        return mine
    done = _recorded_finished(out, [f.file for f in mine], plan.digest()) if out.is_dir() else set()
    return [f for f in mine if f.file not in done]  # as the run skips them (it checks their sha256 too)


def _recorded_finished(out: Path, files: list[str], digest: str) -> set[str]:
    """For a --resume dry run: the files a done record of this plan (or a fragment of it, in a gathered folder)
    says are finished, at the size it records. The run also hashes them, and writes again one that differs."""
    sizes = {f: rec["size"] for frag in read_fragments(out).values() if frag.get("plan_digest") == digest
             for f, rec in (frag.get("files") or {}).items()}  # fmt: skip
    for f in files:
        if (rec := read_done(out, f)) is not None and rec["plan_digest"] == digest:
            sizes[f] = rec["size"]
    return {f for f in files if f in sizes and (out / f).is_file() and (out / f).stat().st_size == sizes[f]}


def _others(plan: ConversionPlan, mine: list[RankFile], ranks: list[int] | None) -> frozenset[str] | None:
    """A share's view of OUT (--ranks, a torchrun process): the other shares' files and partial files, which
    it leaves alone; None for a run of every file, which holds OUT alone."""
    if ranks is None and (torchrun.world() or 1) <= 1:
        return None
    return frozenset(n for f in _kept(plan, mine) for n in (f, f + ".partial"))


def _kept(plan: ConversionPlan, mine: list[RankFile]) -> list[str]:
    names = {f.file for f in mine}
    return [f.file for f in plan.files if f.file not in names]


def _check_source_unchanged(out: Path, src: Path, stamps: dict, kept: list[str] | None = None) -> None:
    """--resume continues from the source as it was: OutputError naming the shards changed since, or that
    differ from those of another folder a run here began from. `kept`: a share's check, the other shares'
    files in OUT; refused only when one of them is finished or started (its bytes may be the old source's,
    and this run's manifest would count them)."""
    changed, elsewhere = changed_since(out, src, stamps)
    if not changed:
        return
    if elsewhere is None:
        what = f"{src}: {first_few(changed)} changed (size or modification time) since a run began writing {out}"
    else:
        what = (
            f"{src}: a run here began from {elsewhere}, and {first_few(changed)} differ from its files (size or "
            "modification time; a copy keeps them with cp -a or touch -r)"
        )
    if kept is None:
        raise OutputError(
            f"{what}; what it finished or started may hold the old bytes: use --overwrite to write everything again"
        )
    old = [f for f in kept if read_done(out, f) is not None or (out / (f + ".partial")).exists()]
    if old:
        raise OutputError(
            f"{what}; {first_few(old)} may hold the old bytes and would count towards this conversion: convert "
            "every rank again from this source (shard without --ranks, --overwrite), or restore the source"
        )


def _require_writable(out: Path) -> None:
    """For --dry-run: OutputError where the run could not create OUT or its lock file (a read-only file
    system, no permission): the dry run said 0 where the run then failed (an audit)."""
    here = nearest_existing(out)
    if not os.access(here, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: cannot write into {here} (a read-only file system, or no permission)")


def _side_bytes(src: Path) -> int:
    """At most what a run writes beside the rank files or shards: SRC's tokenizer files, its config.json twice
    (config.json and hf_config.json; an export's config.json) and an index as large as SRC's (an export's)."""

    def size(name: str) -> int:
        return (src / name).stat().st_size if (src / name).is_file() else 0

    return sum(size(n) for n in SIDECARS) + 2 * size("config.json") + size(INDEX_NAME)


def _replaced(
    out: Path,
    mine: list[RankFile],
    others: frozenset[str] | None,
    other_conversion: list[str],
    records: tuple[str, ...],
) -> list[str]:
    """What an --overwrite removes from OUT before it checks the space: this process's files, another conversion's
    (_out_as_found's), and where the folder is held alone the finished run's records (_forget_records)."""
    alone = [MANIFEST, *records] if out.is_dir() and others is None else []
    return [f.file for f in mine] + other_conversion + alone


def _replaced_first_by_the_launch(
    plan: ConversionPlan,
    out: Path,
    mine: list[RankFile],
    others: frozenset[str] | None,
    overwrite: bool,
    ranks: list[int] | None,
    stamps: Stamps | None = None,
) -> list[str]:
    """What a torchrun process with --overwrite (a share of no --ranks) removes of the other processes' ranks
    before it checks the space (_replaced_by_the_launch); [] for any other run. stamps: the source's, where
    the caller has read them."""
    if not (overwrite and others is not None and ranks is None and out.is_dir()):
        return []
    stamps = source_stamps(Path(plan.src)) if stamps is None else stamps
    return _replaced_by_the_launch(out, plan, mine, stamps_digest(stamps))


def _require_space_for(plan: ConversionPlan, out: Path, mine: list[RankFile], replaced: list[str]) -> None:
    """_require_space for `mine` and the side files, crediting the `replaced` files an --overwrite removes first,
    and only those (a user's file beside them stays, and so do the other shares' files: crediting every file OUT
    held passed a dry run whose run then refused)."""
    held = sum(p.stat().st_size for p in {out / n for n in replaced} if p.is_file())
    _require_space(out, sum(f.nbytes for f in mine) + _side_bytes(Path(plan.src)), held)


def _require_space(out: Path, need: int, freed: int = 0) -> None:
    """OutputError unless OUT's device (that of its nearest existing folder: a dry run makes none) has `need`
    bytes free, counting the `freed` bytes of files the run removes first (a dry run's --overwrite)."""
    free = disk_free(nearest_existing(out)) + freed
    if need > free:
        need_said, free_said = byte_amounts(need, free)
        raise OutputError(
            f"{out}: {need_said} to write but only {free_said} free on that device; free space or choose another OUT"
        )


def _same_plan_as_the_other_shares(
    out: Path, plan: ConversionPlan, mine: list[RankFile], overwrite: bool, ranks_given: bool, live: list[str] = ()
) -> None:
    """A share (--ranks, a torchrun process) writes beside the other shares of one plan: a fragment or done
    record of another plan in OUT (a share run with other options) is refused, not removed: the run removed
    that share's fragment and replaced its config.json, exit 0 (an audit). Also with --ranks and --overwrite,
    which replaces this share's rank files only: the other ranks' files of the replaced conversion stayed
    beside them, a whole-looking set of two conversions (an audit). Under torchrun without --ranks each process
    removes the replaced conversion's files of every rank instead (one process of a launch run again alone
    with other options and --overwrite mixed two conversions, exit 0: an audit). With `overwrite`
    this share's own earlier fragment (of its files alone) is what it replaces, not another share's. `live`:
    the plans of shares running now (store/plan_claims.py: they have left no fragment yet)."""
    if live:
        raise OutputError(
            f"{out}: a share of another plan is being written into it now (plan {first_few([d[:12] for d in live])}: "
            "other options or another source layout); run every share of one conversion with the same options"
        )
    if overwrite and not ranks_given:  # a torchrun launch --overwrite: each process removes the replaced
        return  # conversion's files of every rank (_replace_the_launchs_files), so none is left beside new ones
    digest = plan.digest()
    own = {f.file for f in mine}
    other = sorted(
        name
        for name, frag in read_fragments(out).items()
        if frag.get("plan_digest") != digest and not (overwrite and set(frag.get("files") or ()) <= own)
    )
    other += [
        f"{DONE_DIR}/{f}.done.json"
        for f in _kept(plan, mine)
        if (rec := read_done(out, f)) is not None and rec.get("plan_digest") != digest
    ]
    if other:
        again = (
            "--overwrite without --ranks, or every share into an emptied OUT"
            if ranks_given
            else "the launch again with --overwrite: each process removes the other plan's files of every rank"
        )
        raise OutputError(
            f"{out}: holds a share of another plan ({first_few(other)}: other options or another source layout); "
            f"run this share with the options the others had, or convert every rank again ({again})"
        )


def _replace_the_launchs_files(out: Path, plan: ConversionPlan, mine: list[RankFile], source: str) -> None:
    """A process of a torchrun launch with --overwrite: the replaced conversion's files of the other processes'
    ranks too (`_replaced_by_the_launch`), and its manifest.json and fragments, so that the folder never
    holds two conversions' rank files, whether the other processes run (a whole launch) or not (one process run
    again alone: an audit). New files of this plan from this source (their records name both) are left alone."""
    interrupts.check()  # before the first removal, as in _no_other_conversion
    forget_stale(out, plan.digest())
    old = _replaced_by_the_launch(out, plan, mine, source)
    _mark_replacing(out, [f for f in old if (out / f).is_file()])
    _forget_done(out, old)
    _remove_replaced(out, old)


def _replaced_by_the_launch(out: Path, plan: ConversionPlan, mine: list[RankFile], source: str) -> list[str]:
    """The other processes' rank files a process of a torchrun launch with --overwrite removes: done records of
    another plan, or of this plan from another source (`source`, a stamps digest: another folder of one layout,
    a second fine-tune, whose files a process checking before its peers refused as old: an audit)."""
    digest = plan.digest()
    return [
        f
        for f in _kept(plan, mine)
        if (rec := read_done(out, f)) is not None and (rec.get("plan_digest") != digest or rec.get("source") != source)
    ]


def _check_resumable(out: Path, mine: list[RankFile], digest: str) -> None:
    """--resume continues this plan only: a done record or a partial file of another plan is refused before
    anything is written."""
    for f in mine:
        rec = read_done(out, f.file)
        if rec is not None and rec.get("plan_digest") != digest:
            raise OutputError(
                f"{out / f.file}: finished by a run with other options or another source (plan digest "
                f"{str(rec.get('plan_digest', '?'))[:12]}, now {digest[:12]}); use --overwrite to replace it"
            )
        journal.check_plan(journal_path(out, f.file), out / (f.file + ".partial"), digest)


def execute(
    plan: ConversionPlan,
    out: Path,
    *,
    workers: int = 1,
    ranks: list[int] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    device: str = "cpu",
    progress: Progress = lambda label, done, total: None,
    chunk_bytes: int = CHUNK_BYTES,
    journal_bytes: int = JOURNAL_BYTES,
    direct_io: bool = True,
    sidecars: Sidecars | None = None,
) -> dict[str, Any]:
    """Write the plan's rank files into `out`. -> summary (files written / skipped, bytes, seconds, GB/s).

    workers: local processes; 0 picks them from cores, memory and the files to write (workers.py).
    """
    src, out = Path(plan.src), Path(out)
    mine = check_options(plan, out, resume, overwrite, ranks, device)
    if not mine:  # a torchrun share of more processes than files: the others write them all, and may have
        return _nothing_to_write(out)  # finished already (a share starting then was refused: "other files")
    interrupts.check()  # one postponed since an import (planning took seconds) stops the run before OUT is touched
    # a share of the ranks (--ranks, a torchrun process) holds the folder shared and its own rank files
    # exclusively; a run of every rank holds the folder alone (store/lock.py)
    others = _others(plan, mine, ranks)
    share = others is not None
    names = [f.file for f in mine]
    with (
        made_folder(out),  # a run refused before its first byte (no room) leaves no folder it made
        hold(out, shared=share, files=names if share else ()) as lock,
        claimed(out, plan.digest()) if share else nullcontext((None, [])) as (claim_fd, live_plans),
    ):
        _refuse_files_not_ours(plan, out)
        check_empty(out, resume, overwrite, others, frozenset(names))
        if not share:
            remove_stale_temporaries(out, lambda name: _common_output(name) or name == INDEX_NAME)
        # what says the replaced run is finished goes before any of its files: a kill in the removals left a
        # manifest (and an export's index) listing files already gone (an audit)
        forget = partial(_forget_records, out, plan.digest(), sidecars) if overwrite and not share else None
        _no_other_conversion(plan, out, overwrite and not share, before_removing=forget)
        if share:
            _same_plan_as_the_other_shares(out, plan, mine, overwrite, ranks is not None, live_plans)
        stamps = _planned_stamps(plan, src)
        source = stamps_digest(stamps)  # kept in each done record this run writes
        if overwrite and share and ranks is None:
            _replace_the_launchs_files(out, plan, mine, source)
        interrupts.check()  # nothing is removed after a Ctrl-C (a signal during the lock's wait, the checks)
        if overwrite:  # an --overwrite stopped half-way leaves no record of the replaced run: --resume continues it
            _mark_replacing(out, [n for n in names if (out / n).is_file()])
            if forget is not None:
                forget()
            _forget_done(out, names)
            _remove_replaced(out, names)
        if not resume:  # refused before the first record: a plain run again is not refused as "not empty"
            _require_space_for(plan, out, mine, [])  # the side files come first
        if resume or share:  # a share: the other shares' finished files count towards its manifest
            _check_source_unchanged(out, src, stamps, None if resume else _kept(plan, mine))
        record_stamps(out, src, stamps)
        job = {
            "device": device,
            "torch": _needs_torch(mine, device),
            "chunk_bytes": chunk_bytes,
            "digest": plan.digest(),
            "resume": resume,
            "journal": journal_bytes,
            "direct_io": direct_io,
            "stamps": stamps,
            "source": source,
        }
        lock_fds = lock.descriptors() + ([claim_fd] if claim_fd is not None else [])
        summary = _execute_held(plan, src, out, mine, workers, progress, job, sidecars, lock_fds, ranks is not None)
    return summary | {"took_over": [h.describe() for h in lock.stale]}  # locks of runs that died holding them


def _nothing_to_write(out: Path) -> dict[str, Any]:
    """The summary of a share that holds no file of the plan: OUT untouched, nothing written or waited for."""
    return {
        "out": str(Path(out).resolve()), "written": [], "skipped": [], "workers": 0, "resumed": {}, "bytes": 0,
        "seconds": 0.0, "gb_per_s": None, "manifest": None, "fragment": None, "set_aside": [], "timeline": [],
        "took_over": [], "nothing_to_write": True,
    }  # fmt: skip


def _execute_held(
    plan: ConversionPlan,
    src: Path,
    out: Path,
    mine: list[RankFile],
    workers: int,
    progress: Progress,
    job: dict,
    sidecars: Sidecars | None,
    lock_fds: list[int],
    ranks_given: bool = False,
) -> dict[str, Any]:
    """`execute` once OUT is locked and checked; worker processes hold `lock_fds` with the run (die_with.py).
    ranks_given: --ranks, so other runs (other hosts, other sources) may have written the other rank files."""
    digest, resume, device = job["digest"], job["resume"], job["device"]
    gathered = resume and bool(read_fragments(out))  # a folder gathered from several machines
    if gathered:
        import_fragments(out, digest)
    todo, skipped, intact = [], [], set()
    if resume:
        _check_resumable(out, mine, digest)
        intact = finished(out, [f.file for f in mine], digest, progress)
    for f in mine:
        if f.file in intact:
            skipped.append(f.file)
        else:
            todo.append(f)
    need = sum(f.nbytes for f in todo)
    if resume:  # a run from the start checked every file's bytes in `execute`, before its first record
        _require_space(out, need + _side_bytes(src))
    if todo or sidecars:  # an export's `before` removes config.json and the index the manifest lists
        forget_stale(out, digest, frozenset(f.file for f in todo))
    set_aside = _set_aside_tokenizer_files(src, out)
    extra = sidecars.before(src, out) if sidecars else write_sidecars(plan, src, out)
    t0 = time.monotonic()
    if workers == 0:  # --workers auto
        workers = auto_workers(len(todo), device, computed_share=_computed_bytes(todo) / max(1, need))
    workers = processes_for(len(todo), workers)
    results = _run(todo, src, out, workers, progress, job, lock_fds)
    seconds = time.monotonic() - t0
    written = sum(r.size - r.kept for r in results)
    manifest = fragment = None
    options = sidecars.options if sidecars else {"tp": plan.tp, "expert_dtype": plan.expert_dtype}
    options = options | {"device": device}
    # a shard's finished folder holds manifest.json and no fragment (an export keeps its shares' fragments beside
    # its manifest: manifest_merge._already_merged names them)
    drops_fragments = sidecars is None
    done = _done_records(out, plan, digest)
    _own_files_kept(out, [f.file for f in mine], done)
    if done and len(done) < len(plan.files):
        fragment = str(write_fragment(out, plan, options, done).resolve())
        if drops_fragments:  # a share that finished meanwhile wrote manifest.json before this fragment was
            done = _done_records(out, plan, digest)  # there to remove: the set is complete, and this one ends it
    if len(done) == len(plan.files):
        # rank files written by other runs (gathered shares, or --ranks shares finishing in one folder, on
        # another host too, where source stamps do not reach: an audit) complete the set: they must be one
        # model's. Not after one torchrun launch: its processes read one SRC, and each of those finishing
        # last would read the replicas of every rank file (29 GB of the real model at tp 8)
        if (gathered or (ranks_given and len(mine) < len(plan.files))) and plan.tp > 1:
            _shares_agree(out, plan.tp, progress)
        if sidecars:
            extra += sidecars.after(out)
        manifest = str(write_manifest(out, plan, options, extra).resolve())  # absolute, as "out" (an audit)
        if drops_fragments:
            drop_superseded_fragments(out)
            fragment = None
        for marker in (out / DONE_DIR).glob("*" + REPLACING):
            marker.unlink()
    return {
        "out": str(out.resolve()),
        "written": [r.file for r in results],
        "skipped": skipped,
        "workers": workers,
        "resumed": {r.file: r.kept for r in results if r.kept},  # bytes kept from a partial file
        "bytes": written,  # written by this run
        "seconds": round(seconds, 3),
        "gb_per_s": round(written / seconds / 1e9, 3) if seconds > 0 else None,
        "manifest": manifest,
        "fragment": fragment,
        "set_aside": set_aside,  # tokenizer files of an earlier run that SRC lacks, moved out of the way
        "timeline": _timeline(results, t0),
    }


def _done_records(out: Path, plan: ConversionPlan, digest: str) -> list[str]:
    """The plan's files with a done record of this plan in `out` (this run's, other shares', imported ones)."""
    return [f.file for f in plan.files if is_done_record(out, f.file, digest)]


def _own_files_kept(out: Path, own: list[str], done: list[str]) -> None:
    """OutputError where a file of this run's share (written or found finished) is no longer as finished before
    the manifest or fragment is written: removed or cut (a cleanup, a user) since. Taken for another share's
    unfinished file, it gave `manifest: pending` and exit 0 to a run of every file (a black-box hunt).
    own: the share's file names; done: the plan's files with a done record matching their size now."""
    lost = [f for f in own if f not in done]
    if not lost:
        return
    said = []
    for f in lost:
        rec, path = read_done(out, f), out / f
        if not path.exists():
            said.append(f"{path} (removed)")
        elif rec is None or path.stat().st_size == rec["size"]:
            said.append(f"{path} (its done record gone or another plan's)")
        else:
            said.append(f"{path} ({path.stat().st_size:,} bytes, not the {rec['size']:,} written)")
    raise OutputError(
        f"{first_few(said)}: changed after this run finished it; no manifest "
        "was written: run again with --resume to write it again"
    )


def _shares_agree(out: Path, tp: int, progress: Progress) -> None:
    """OutputError unless the rank files gathered from several shares agree where they must (unshard.shares_agree,
    as `manifest` checks them): shares of two sources with one layout have one plan digest."""
    from dsv41_convert.convert.unshard import shares_agree  # torch: not imported by a run that copies bytes

    differ = shares_agree(out, tp, progress)
    if differ:
        raise OutputError(f"{out}: cannot write {MANIFEST}: " + "; ".join(differ))


def _timeline(results: list[FileDone], t0: float) -> list[dict[str, Any]]:
    """Per file, in order of start: the writing process, its start and end in seconds from the run's
    start, and its stage seconds (where a file's time went: read, kernel, hash, write, ...)."""
    return [
        {
            "file": r.file,
            "worker": r.worker,
            "start_s": round(r.start - t0, 3),
            "end_s": round(r.end - t0, 3),
            "stages": {k: round(v, 3) for k, v in sorted(r.stages.items())},
        }
        for r in sorted(results, key=lambda r: r.start)
    ]


def is_done_record(out: Path, file: str, digest: str) -> bool:
    """Cheap check used for the manifest: a record for this plan and a file of the recorded size."""
    rec = read_done(out, file)
    path = out / file
    return rec is not None and rec.get("plan_digest") == digest and path.exists() and path.stat().st_size == rec["size"]


def write_sidecars(plan: ConversionPlan, src: Path, out: Path) -> list[str]:
    """tokenizer files, the inference config.json and the HF config as hf_config.json."""
    names = copy_tokenizer_files(src, out)
    atomic_write(out / "config.json", (json.dumps(plan.inference_config, indent=2) + "\n").encode())
    atomic_write(out / HF_CONFIG, (src / "config.json").read_bytes())
    return [*names, "config.json", HF_CONFIG]


def copy_tokenizer_files(src: Path, out: Path) -> list[str]:
    """SRC's tokenizer files (SIDECARS) into OUT, as they are. -> the names copied"""
    names = [name for name in SIDECARS if (src / name).exists()]
    for name in names:
        atomic_write(out / name, (src / name).read_bytes())
    return names


SET_ASIDE = "set-aside"  # under DONE_DIR: tokenizer files of an earlier run that this run's SRC lacks


def _set_aside_tokenizer_files(src: Path, out: Path) -> list[str]:
    """Tokenizer files in OUT that SRC lacks (an earlier conversion's, or put there by hand) moved to
    OUT/DONE_DIR/SET_ASIDE/: left in place, OUT looked complete with another model's tokenizer, which the
    manifest did not list and `check` passed (an audit); deleted, a hand-placed one would be lost. Another process
    of a torchrun launch into this OUT may move the same file first: then it is that one's to report.
    -> the paths they were moved to"""
    moved = []
    for name in SIDECARS:
        if (out / name).is_file() and not (src / name).exists():
            folder = out / DONE_DIR / SET_ASIDE
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / name
            n = 1
            while target.exists():
                target, n = folder / f"{name}.{n}", n + 1
            try:
                os.replace(out / name, target)
            except FileNotFoundError:
                if (out / name).exists():  # not the race: the set-aside folder went
                    raise
                continue  # another share moved it since this one looked
            moved.append(str(target))
    if moved:
        fsync_path(out)
    return moved


def longest_first(files: list[RankFile]) -> list[RankFile]:
    """The order in which workers take files: the most work first (output bytes, computed ones counted
    twice), so that no large file starts last and runs alone while the other workers idle; ties in plan
    order."""
    return sorted(files, key=lambda f: -(f.nbytes + _computed_bytes([f])))


def _computed_parts(files: list[RankFile]) -> Iterator[OutTensor]:
    """The tensors of `files` that an action computes (dequantize, quantize, cast) rather than copies.
    Taken from the files' parts: an ExpertRun (copied experts) is one part, so the parent process never
    expands the runs into their 94k tensors (nor pickles them to the workers)."""
    return (p for f in files for p in f.parts if p.action not in COPIED)


def _computed_bytes(files: list[RankFile]) -> int:
    """Output bytes of `files` that an action computes."""
    return sum(p.end - p.begin for p in _computed_parts(files))


def _needs_torch(files: list[RankFile], device: str) -> bool:
    """Whether writing `files` computes anything through torch: on CUDA every computed tensor; on the CPU
    those that numpy does not compute on bytes (stream.numpy_computes)."""
    return any(device == "cuda" or not numpy_computes(p) for p in _computed_parts(files))


def _job(rf: RankFile, src: Path, out: Path, job: dict[str, Any], progress) -> FileDone:
    """Write, commit and record one rank file. Its "start" stage: the seconds before writing begins (where
    the worker did not inherit them, importing torch and the quantizers)."""
    start, stats = time.monotonic(), {}
    with _one_torch_thread(job):
        quantizer = _quantizer(job)
        ready = time.monotonic()
        recorded = partial(write_done, out, rf.file, plan_digest=job["digest"], source=job["source"])
        size, sha = write_rank_file(
            rf, src, out, quantizer, progress, on_commit=recorded, before_commit=partial(_source_as_stamped, src, job),
            **_write_kw(job, stats),
        )  # fmt: skip
    add_seconds(stats["stages"], "start", ready - start)
    return _done(rf.file, size, sha, stats, start)


def _done(file: str, size: int, sha: str, stats: dict[str, Any], start: float) -> FileDone:
    return FileDone(file, size, sha, stats["resumed_from"], os.getpid(), start, time.monotonic(), stats["stages"])


def _write_kw(job: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    return {
        "chunk_bytes": job["chunk_bytes"],
        "plan_digest": job["digest"],
        "resume": job["resume"],
        "journal_bytes": job["journal"],
        "stats": stats,
        "direct_io": job["direct_io"],
    }


def _run_here(todo, src, out, job, progress) -> list[FileDone]:
    """One file after another in this process; each file's fsync + rename runs in a thread while the next
    file is written (one commit in flight), as `cp` lets writeback overlap its copying."""
    results: list[FileDone] = []
    pending: Future | None = None
    with _one_torch_thread(job), ThreadPoolExecutor(1, thread_name_prefix="commit") as committer:
        for rf in todo:
            start, stats = time.monotonic(), {}
            size, sha = write_partial(rf, src, out, _quantizer(job), progress, **_write_kw(job, stats))
            _source_as_stamped(src, job, rf.file)
            if pending is not None:
                results.append(pending.result())
            pending = committer.submit(_commit, out, rf.file, size, sha, job, stats, start)
        results.append(pending.result())
    return results


@contextmanager
def _one_torch_thread(job: dict[str, Any]) -> Iterator[None]:
    """torch on one thread while the job runs: parallelism comes from worker processes, and torch's thread
    pool on small chunks spends 1000x the work in barriers when cores are shared (measured: torch.round
    4 ms vs 5 us). A job that computes nothing through torch never imports it (_needs_torch)."""
    if not job["torch"]:
        yield
        return
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _quantizer(job: dict[str, Any]) -> SimpleNamespace:
    """The quantization functions for the job's device (transform.quantizer_for); for a job that computes
    nothing through torch, just the device: its writer calls none of them, and torch stays unimported."""
    if not job["torch"]:
        return SimpleNamespace(device=job["device"])
    from dsv41_convert.convert.transform import quantizer_for

    return quantizer_for(job["device"])


def _planned_stamps(plan: ConversionPlan, src: Path) -> dict[str, list[int]]:
    """SRC's stamps now, where they are those the plan read its headers under (OutputError otherwise: a shard
    replaced while it was planned would be read at the old file's offsets)."""
    stamps = source_stamps(src)
    changed = differing(plan.stamps, stamps) if plan.stamps else []  # a plan from JSON has none
    if changed:
        raise OutputError(
            f"{src}: {first_few(changed)} changed (size or modification time) since this run read its headers; "
            "nothing was written: run again once the source is as it should be"
        )
    return stamps


def _source_as_stamped(src: Path, job: dict[str, Any], file: str) -> None:
    """OutputError where a source shard changed (size or modification time) since the run began, checked once a
    rank file's bytes are all written and before it takes its name: a source replaced mid-run (`make-tiny
    --overwrite`, a download fetching a shard again) gave rank files of two models, each committed, and a
    manifest over them, exit 0 (an audit). The file stays partial; the run's record of the source makes
    --resume refuse too."""
    changed = differing(job["stamps"], source_stamps(src))
    if changed:
        raise OutputError(
            f"{src}: {first_few(changed)} changed (size or modification time) while this run read it; {file} may "
            "hold bytes of both versions and was not given its name: run again with --overwrite once the source "
            "is as it should be"
        )


def _commit(
    out: Path, file: str, size: int, sha: str, job: dict[str, Any], stats: dict[str, Any], start: float
) -> FileDone:
    commit(out, file, partial(write_done, out, file, size, sha, job["digest"], job["source"]))
    return _done(file, size, sha, stats, start)


_QUEUE: Any = None
_LOCKS: SharedFiles | None = None


def _init_worker(q, run: int, parent: int, locks: SharedFiles) -> None:
    global _QUEUE, _LOCKS
    _QUEUE, _LOCKS = q, locks  # the run's locks, held until this process exits
    die_with_parent()  # the run, or its fork server, which dies with the run (die_with.py)
    # `parent` (the server or the run) died before that took hold: this process was reparented and would
    # run on, idle, holding the run's lock (seen after a kill -9 of the run, 2 runs in 4; a killed run
    # is a zombie until reaped, so alive(run) alone passed)
    if os.getppid() != parent or not alive(run):
        os.kill(os.getpid(), signal.SIGKILL)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # the run ignores Ctrl-C (a script's background job)
        # out of the terminal's process group, whose Ctrl-C stopped every worker and so the run (exit 130; a
        # helper's hunt); the run's own stop (_stop_workers, by pid) still reaches this worker
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, _interrupt_worker)


def _interrupt_worker(signum, frame) -> None:
    """Ctrl-C in a worker, from the terminal or forwarded by the run (_stop_workers): recorded, never raised
    here. The file being written stops at its next chunk and keeps its partial for --resume (write.py), and
    a job the pool hands this worker afterwards begins nothing (_worker_file); a worker waiting for its next
    job waits for the pool's shutdown. Raised where the signal lands, it once left the pool's result queue
    locked: the worker took it inside `with lock` of its result's send-back, between the acquire and the
    block, and the send-back's retry waited for that lock forever, as did the other worker and the run's
    shutdown (CI: `export --workers 2` hung after SIGTERM, 1 round in 4; reproduced 2 runs in ~115 with
    the CPUs loaded)."""
    interrupts.interrupt_later()


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Forward Ctrl-C to the pool's workers (a `kill -INT` of the run reaches the run alone)."""
    for pid in list(getattr(pool, "_processes", None) or {}):  # pid -> process, CPython's, 3.8 to 3.14
        try:
            os.kill(pid, signal.SIGINT)
        except ProcessLookupError:
            pass


def _worker_context(job: dict[str, Any]) -> Any:
    """Where worker processes come from. Linux: forked by a fork server that has imported the CLI, the
    writer and, for a job that computes through torch, torch and the quantizers, once, so N workers do not
    each import them: spawned, each of 8 workers spent 5 s importing torch on the 16-core H200 host with a
    cold page cache (the timeline's `start` stage), a third of an fp8 export's wall time and half its CPU.
    The server is a single-threaded process that never ran torch code, so forking it is safe, unlike
    forking the run itself; it imports die_with.py first, which makes it die with the run. Elsewhere: spawn."""
    if sys.platform != "linux":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    modules = ["__main__", "dsv41_convert.convert.die_with", "dsv41_convert.convert.write"]
    if job["torch"]:
        modules.append("dsv41_convert.convert.transform")
    ctx.set_forkserver_preload(modules)  # takes effect when the server starts (once per run: _fork_server)
    return ctx


def _worker_file(rf, src, out, job) -> FileDone:
    interrupts.check()  # this worker took Ctrl-C: it begins no file after it
    last = [0.0]

    def report(label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] > 0.2 or done == total:
            last[0] = now
            _QUEUE.put((label, done, total))

    return _job(rf, src, out, job, report)


def processes_for(files: int, workers: int) -> int:
    """How many processes write `files` files with --workers `workers`: 0 with nothing to write, 1 (this
    process) for one file or one worker, else one worker per file at most."""
    return min(files, max(1, workers))


def _run(todo, src, out, workers, progress, job, lock_fds: list[int]) -> list[FileDone]:
    """`todo` written by `workers` processes (processes_for's count): here for 1, else a pool."""
    if not todo:
        return []
    if workers <= 1:
        return _run_here(todo, src, out, job, progress)
    ctx = _worker_context(job)
    q = ctx.Queue()
    results = []
    with (
        _fork_server(ctx),
        ProcessPoolExecutor(
            workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(q, os.getpid(), _workers_parent(ctx), SharedFiles(lock_fds)),
        ) as pool,
    ):
        try:
            # a KeyboardInterrupt inside submit, between a worker's start and the pool's record of it, left a
            # worker the shutdown never ended, and the fork server's stop waited for it forever (an audit)
            # and one job at a time, checked between: an interrupt postponed since an import (or one during the
            # submits, which take seconds on a loaded machine) stops the run before the rest are handed out
            # (an audit: 6 of 14 shards written after a SIGTERM at 0.4 s)
            pending = set()
            for rf in longest_first(todo):
                interrupts.check()
                with interrupts.deferred():
                    pending.add(pool.submit(_worker_file, rf, src, out, job))
            while pending:
                interrupts.check()  # a Ctrl-C whose KeyboardInterrupt was dropped (interrupts.py)
                # not inside wait(): it takes each future's lock in turn, and a KeyboardInterrupt between left
                # one held, so the shutdown below waited forever (an audit: once in ~800 SIGTERMs)
                # and neither inside the progress display's update nor a queue's read (their locks)
                with interrupts.deferred():
                    done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    _drain(q, progress)
                    results.extend(fut.result() for fut in done)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                _stop_workers(pool)
            pool.shutdown(wait=True, cancel_futures=True)  # running jobs remove (on Ctrl-C: keep) their partials
            if isinstance(exc, BrokenProcessPool) and not interrupts.interrupted():
                finished = {r.file for r in results}
                unfinished = [rf.file for rf in todo if rf.file not in finished]
                raise RankFailedError(
                    f"a worker process of the run died (killed? out of memory?) while writing into {out} "
                    f"(not finished then: {first_few(unfinished)}); what is on disk is kept: --resume continues it"
                ) from None
            if interrupts.interrupted() and not isinstance(exc, KeyboardInterrupt):
                # the stop, not an error of its own: a signal sent to the whole group killed a worker or the fork
                # server, and a submit then pickled the broken pool's closed queue ("OSError: handle is closed",
                # exit 2 where 143 was due: an audit)
                raise KeyboardInterrupt from exc
            raise
        with interrupts.deferred():
            _drain(q, progress)
    return results


def _workers_parent(ctx) -> int:
    """The process the pool's workers are children of: the fork server (started by _fork_server), or this
    one (spawn)."""
    pid = fork_server_pid() if ctx.get_start_method() == "forkserver" else os.getpid()
    assert pid is not None, "the fork server is started before the pool (_fork_server)"
    return pid


@contextmanager
def _fork_server(ctx) -> Iterator[None]:
    """With a fork server context: start the server now, telling it (die_with.RUN_ENV, for its start only)
    that it serves this run, and end it once its workers have exited: it holds torch's memory, and a
    process that waits for it counts its CPU and its workers' as its own (as it did for spawned workers;
    `time`, the benchmarks). The next run with workers starts a fresh one."""
    if ctx.get_start_method() != "forkserver":
        yield
        return
    start_fork_server()
    try:
        yield
    finally:
        stop = getattr(getattr(mp.forkserver, "_forkserver", None), "_stop", None)  # CPython's, 3.8 to 3.14
        if stop is not None:
            stop()


def _drain(q, progress: Progress) -> None:
    while True:
        try:
            progress(*q.get_nowait())
        except queue.Empty:
            return


__all__ = ["DONE_DIR", "MANIFEST", "check_empty", "check_output", "execute", "select_files"]
