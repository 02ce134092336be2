"""verify: run the converted weights and the reference over the same prompts, compare, judge, localize.

    result = verify(VerifyOptions(converted, reference=src), progress=print_to_stderr)
    result.ok, result.to_json()

The reference is either the source checkpoint (computed here, tp 1, weights transformed in memory)
or a reference-logits file. The converted folder is run with one process per rank (verify.launch);
against a tp-1 file at tp > 1 the rank files are also merged back and replayed at tp 1 (verify.replay).
Where no exact check applies and the file holds the hidden states, each module is also run on the
reference's input to it (verify.teacher).
The verdict (verify.verdict) is PASS only when a check held bit for bit, INCONCLUSIVE when only
statistical bounds applied (unless --statistical), FAIL on any mismatch.
Under torchrun every rank calls `verify`; each computes (or reads) the same reference, only rank 0
compares, and the other ranks get None.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv41_convert import torchrun
from dsv41_convert.config import ModelArgs, load_json, load_model_args
from dsv41_convert.convert.memory import model_bytes
from dsv41_convert.convert.plan import ConversionPlan
from dsv41_convert.convert.rules import Split
from dsv41_convert.convert.tp import check_tp
from dsv41_convert.convert.unshard import Merge, RankFiles, merge_of, rank_tp, replica_mismatches
from dsv41_convert.errors import ConfigError, PlanError, ShardConsistencyError, VerifyInputError, first_few
from dsv41_convert.file_kinds import SPECIAL, special_kind
from dsv41_convert.numbers import counted
from dsv41_convert.progress import Progress as ByteProgress
from dsv41_convert.store.lock import refuse_held
from dsv41_convert.store.machine import memory_backed
from dsv41_convert.store.manifest import HF_CONFIG, MANIFEST, SIDECARS
from dsv41_convert.store.manifest_check import check_folder, our_manifest, recorded_tp
from dsv41_convert.store.rank_names import rank_file_name
from dsv41_convert.store.safetensors_header import Header
from dsv41_convert.store.source_stamps import Stamps, require_unchanged, source_stamps
from dsv41_convert.verify import launch as launcher
from dsv41_convert.verify import localize, provenance, reffile, teacher, weight_digests
from dsv41_convert.verify.fits import require_prompts_fit, require_weights_fit
from dsv41_convert.verify.metrics import Stats, compare, merge
from dsv41_convert.verify.prompts import Prompt, prompt_id_bound, refuse_recorded_ids_past
from dsv41_convert.verify.ranks import LoadFailure, RankJob, RankResult, run_converted
from dsv41_convert.verify.reference import DEFAULT_DECODE_STEPS, SourceReference, compute_reference, read_prompts
from dsv41_convert.verify.replay import replay_check, replay_threads
from dsv41_convert.verify.runner import ModelInput, PromptRun
from dsv41_convert.verify.source import reference_plan
from dsv41_convert.verify.thresholds import EXACT, SECTIONS, Thresholds, choose_mode, default_thresholds, judge
from dsv41_convert.verify.verdict import (
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    PASS,
    Check,
    advice,
    decide,
    drafts_uncovered,
    exact_blockers,
)

Progress = Callable[[str], None]
Shown = AbstractContextManager["ByteProgress | None"]  # a byte progress display while it is entered


@dataclass
class VerifyOptions:
    converted: Path
    reference: Path | None = None  # SRC
    reference_logits: Path | None = None  # FILE
    prompts: Path | None = None
    device: str = "cpu"
    tp: int | None = None
    n_decode: int | None = None  # None: DEFAULT_DECODE_STEPS (a reference file fixes its own)
    max_seq_len: int | None = None
    overrides: dict[str, float | None] = field(default_factory=dict)
    localize: bool = True
    threads: int | None = None  # torch threads per process (default: cores / tp, or the reference's)
    statistical: bool = False  # accept statistical bounds as a PASS when no decisive check applies
    replay: bool = True  # False: no tp-1 replay (it holds the merged model in RAM); the teacher check may run
    # the tp-1 replay one unit at a time in place of the tp-N run (a model larger than the machine)
    stream_layers: bool = False
    rank_timeout: int | None = None  # seconds a rank waits for a peer in a collective (default: launch's TIMEOUT)


@dataclass
class PromptResult:
    label: str
    tokens: int
    sections: dict[str, Stats]  # against the tp-1 reference
    failures: list[str]
    twin: dict[str, Stats] = field(default_factory=dict)  # against the twin (verify.twin), must be exact


@dataclass
class VerifyResult:
    converted: str
    reference: str
    tp: int
    device: str
    thresholds: Thresholds
    prompts: list[PromptResult]
    overall: dict[str, Stats]
    failures: list[str]  # "<section>: <limit broken>", or the load errors
    load_error: str | None = None
    localization: localize.Localization | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    twin: dict[str, Stats] = field(default_factory=dict)  # overall, against the twin
    checks: list[Check] = field(default_factory=list)  # verify.verdict
    verdict: str = FAIL  # PASS | FAIL | INCONCLUSIVE
    advice: str = ""  # INCONCLUSIVE: what would make the run decisive
    statistical: bool = False  # --statistical: statistical bounds accepted
    drafts_statistical: bool = False  # a PASS whose DSpark drafts only statistical bounds judged (--statistical)
    # a PASS whose DSpark drafts nothing compared (a reference without decode steps), accepted by --statistical,
    # beside a decisive check of the rest or beside statistical bounds only
    drafts_unchecked: bool = False
    unreached: list[str] = field(default_factory=list)  # parts of the model no prompt ran (not_run_by)
    # CONVERTED's files against its manifest.json: "held", "differs", "absent", or "another set" (of another tp)
    manifest: str = "absent"
    # its tensors against FILE's digests: held, partial (held, the routed experts skipped: another expert dtype),
    # differs, not recorded, not compared
    weights: str = "not recorded"
    weights_note: str = ""  # what was compared, or why not
    # CONVERTED/config.json against the model the reference ran: "held" (a difference is an input error, exit 2),
    # or "not checked" (a FILE recording neither its model nor the hf_config.json CONVERTED holds; config_note)
    config: str = "held"
    config_note: str = ""  # why not checked

    @property
    def ok(self) -> bool:
        return self.verdict == PASS

    @property
    def decisive(self) -> list[str]:
        """The checks the verdict rests on that held (empty for a FAIL, and where a PASS rests on statistical
        bounds only): a check may hold beside a failure of another kind (tokenizer, replicas)."""
        return [] if self.verdict == FAIL else self.held

    @property
    def held(self) -> list[str]:
        """The decisive checks that held, whatever the verdict."""
        return [c.name for c in self.checks if c.decisive]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "exit_code": EXIT_CODES[self.verdict],
            "verdict": self.verdict,
            "decisive": self.decisive,
            "held": self.held,
            "statistical": self.verdict == PASS
            and self.statistical
            and (not self.decisive or self.drafts_statistical or self.drafts_unchecked),
            "drafts_statistical": self.drafts_statistical,
            "drafts_unchecked": self.drafts_unchecked,
            "checks": [c.to_json() for c in self.checks],
            "advice": self.advice,
            "unreached": self.unreached,
            "manifest": self.manifest,
            "weights": self.weights,
            "weights_note": self.weights_note,
            "config": self.config,
            "config_note": self.config_note,
            "converted": self.converted,
            "reference": self.reference,
            "tp": self.tp,
            "device": self.device,
            "mode": self.thresholds.mode,
            "thresholds": self.thresholds.to_json(),
            "overall": {k: v.to_json() for k, v in self.overall.items()},
            "twin": {k: v.to_json() for k, v in self.twin.items()} or None,
            "prompts": [
                {
                    "label": p.label,
                    "tokens": p.tokens,
                    "sections": {k: v.to_json() for k, v in p.sections.items()},
                    "twin": {k: v.to_json() for k, v in p.twin.items()} or None,
                    "failures": p.failures,
                }
                for p in self.prompts
            ],
            "failures": self.failures,
            "load_error": self.load_error,
            "localization": self.localization.to_json() if self.localization else None,
            "seconds": self.seconds,
        }


def _check_same_model(src_args: ModelArgs, conv_args: ModelArgs, src: Path, conv: Path) -> None:
    differ = provenance.config_differences(src_args.to_inference_dict(), conv_args.to_inference_dict())
    if differ:
        raise VerifyInputError(f"{conv} was not converted from {src}: config differs in {', '.join(differ[:8])}")


def _config_fits_rank_files(ranks: RankFiles, args: ModelArgs) -> None:
    """VerifyInputError when CONVERTED/config.json's vocab_size or dim is not what its rank files hold (an
    edited or swapped config, which was reported as a problem of the reference file)."""
    conv, tp = ranks.folder, ranks.tp
    embed = ranks.headers[0].tensors.get("embed.weight")
    if embed is None or len(embed.shape) != 2:
        return  # the model's load reports it, naming the file
    rows, dim = embed.shape
    if (rows * tp, dim) != (args.vocab_size, args.dim):
        raise VerifyInputError(
            f"{conv / 'config.json'}: vocab_size {args.vocab_size}, dim {args.dim}, but its rank files hold "
            f"embed.weight [{rows}, {dim}] per rank (vocab {rows * tp} at tp {tp}): not the config these rank "
            "files were written with"
        )


def verify(
    opts: VerifyOptions,
    progress: Progress | None = None,
    shown: Callable[[str], Shown] | None = None,
    warn: Progress | None = None,
) -> VerifyResult | None:
    """Run the check; None on a torchrun rank other than 0. Raises VerifyInputError / ConfigError / HeaderError
    for unusable inputs (exit 2; a rank file whose header does not parse or tile its bytes among them); a
    mismatch, including a rank file a rank fails to load, is a failed result.
    shown(title): a context giving a progress (progress.Progress) for the manifest and weights checks, which
    read every rank file, and for the prompts rank 0 runs (app/report.byte_progress).
    warn(message): an option given that this run does not use, and why, said before the run (also with --json)."""
    say = progress or (lambda _msg: None)
    warn = warn or (lambda _msg: None)
    shown = shown or (lambda _title: contextlib.nullcontext(None))
    conv = Path(opts.converted)
    if (opts.reference is None) == (opts.reference_logits is None):
        raise VerifyInputError("give exactly one of --reference SRC and --reference-logits FILE")
    if opts.stream_layers and opts.reference is not None:  # the twin holds the converter's whole output
        raise VerifyInputError("--stream-layers goes with --reference-logits FILE (a tp-1 file), not --reference SRC")
    if not conv.is_dir():
        raise VerifyInputError(f"{conv}: {'not a folder' if conv.exists() else 'no such folder'}")
    refuse_held(conv)  # a run writing there: a rank file not yet renamed was "missing", one replaced a FAIL
    special = [p.name for p in sorted(conv.iterdir()) if special_kind(p)]  # reading one waits forever
    if special:
        raise VerifyInputError(f"{conv}: {first_few(special)}: not a regular file ({SPECIAL}); remove it")
    if not (conv / "config.json").is_file():
        raise ConfigError(f"{conv}/config.json: not found; is {conv} a folder written by `dsv41-convert shard`?")
    tp = rank_tp(conv, opts.tp)  # a folder without rank files (a source given as CONVERTED) is said so first
    if "text_config" in load_json(conv / "config.json"):  # read as well, it passed (an audit)
        raise VerifyInputError(
            f"{conv}/config.json: a Hugging Face config (text_config), not the inference config `shard` writes "
            "beside rank files, which upstream's inference reads; put the conversion's own config.json back "
            "(`shard` keeps the source's as hf_config.json)"
        )
    conv_args = load_model_args(conv / "config.json")
    check_tp(conv_args, tp, str(conv / "config.json"))  # before a header is read
    if not opts.stream_layers:  # torchrun's other count: refused before the reference (minutes from SRC)
        launcher.check_world(tp, None if opts.tp is not None else conv)
    if opts.rank_timeout is not None:  # no ranks to time out: refused, as it was ignored
        said = "--tp 1" if opts.tp is not None else f"{conv} holds the rank files of tp 1"
        launcher.check_rank_timeout(tp, opts.stream_layers, said)
    # the ranks, the manifest check and the teacher open the rank files by name, the other checks read those
    # opened here: a rewrite meanwhile (`shard --overwrite`, which the lock refuses only while held now) gave a
    # PASS of files the weights check and the replay never read; compared once the last read is done
    stamps = source_stamps(conv, names := {rank_file_name(r, tp) for r in range(tp)})  # another tp's are not read
    with RankFiles(conv, opts.tp) as ranks:  # the set, its headers read once
        _config_fits_rank_files(ranks, conv_args)
        result = _verify_ranks(opts, ranks, conv_args, say, shown, warn)
    require_unchanged(conv, stamps, f"no verdict; run again once the run writing into {conv} has ended", names)
    return result


def _ranks_fit(
    opts: VerifyOptions,
    ranks: RankFiles,
    conv_args: ModelArgs,
    replays: bool = False,
    reference: ConversionPlan | None = None,
) -> None:
    """VerifyInputError (fits.require_weights_fit) where the rank files' weights cannot be held by the ranks on this
    host (or a card), before the reference's model and the ranks' are built; --stream-layers holds one unit.
    replays: the tp-1 replay runs after the ranks (`_replays`), in one process: the whole model and the rank files
    merged back to tp 1 (its state dict), both whole at once (verify.replay.replay_runs), asked for separately.
    reference: `verify --reference SRC`'s tp-1 plan (source.reference_plan): the ranks run beside what the verify
    process keeps of the reference (_reference_and_twin_bytes), and each copies the pieces of the twin it cuts by
    columns (_cut_copies); asked together (they were asked apart, and a 23 GiB host that passed both checks
    met the allocator: make-tiny --preset medium at tp 2, SIGKILL). Those stay in the host's memory: a card holds
    its rank's model alone (they were counted on it, and a card that held the model was refused). The ranks map the
    twin from a file in the temporary folder (launch's payload): counted too where that folder is held in memory
    (tmpfs; elsewhere its pages are the page cache's, dropped and read again under pressure)."""
    if opts.stream_layers:
        return
    weights = [model_bytes(((n, t.dtype, t.nbytes) for n, t in h.tensors.items()), conv_args) for h in ranks.headers]
    card = weights  # each rank's model, moved onto its card (run_converted)
    stream = "`verify --reference-logits FILE --stream-layers` (a tp-1 file: it holds one unit at a time)"
    what, beside = f"{ranks.folder} at tp {ranks.tp}", 0
    if reference is not None:
        merges = _merges(ranks)
        weights = [w + _cut_copies(h, r, merges) for r, (w, h) in enumerate(zip(weights, ranks.headers, strict=True))]
        state, twin = _reference_and_twin_bytes(reference, conv_args, merges)
        beside = state if twin is None else state + twin  # what the verify process keeps
        if torchrun.world() is None and ranks.tp > 1 and memory_backed(Path(tempfile.gettempdir())):
            beside += state if twin is None else twin  # the ranks' payload (launch), a file held in memory
        what += f" beside the tp-1 reference of {reference.src} and the twin"
        stream = f"`reference-logits {reference.src} FILE` once, then `verify --reference-logits FILE`, or {stream}"
        if torchrun.world() is not None:  # every process keeps its own
            weights, beside = [w + beside for w in weights], 0
    require_weights_fit(weights, opts.device, what, stream, card, beside)
    if not replays or torchrun.rank() != 0:  # under torchrun rank 0 alone replays
        return
    merged = [(name, m.dtype, m.nbytes) for name, m in _merges(ranks).items()]
    model = model_bytes(merged, conv_args)
    require_weights_fit(
        [sum(size for _, _, size in merged) + model],
        opts.device,
        f"{ranks.folder} merged back to tp 1 (the replay, after the tp-{ranks.tp} run, in one process)",
        f"--no-replay (the tp-{ranks.tp} run alone, held to statistical bounds), or {stream}",
        [model],
    )


def _merges(ranks: RankFiles) -> dict[str, Merge]:
    """name -> how each tp-1 tensor merges from the rank files; one that does not merge (or has no rule) is left
    out: the replay's FAIL or the twin's, not held."""
    out = {}
    for name in ranks.names():
        with contextlib.suppress(ShardConsistencyError, PlanError):
            out[name] = merge_of(ranks, name)
    return out


def _cut_copies(header: Header, rank: int, merges: dict[str, Merge]) -> int:
    """Bytes of the twin's pieces rank `rank` copies as it cuts them (verify.twin.cut: a column split, rows padded
    past the table's end); the other pieces are views of the twin, or the twin's tensor itself where the rank's
    shape is the whole one (every tensor at tp 1)."""
    out = 0
    for name, info in header.tensors.items():
        m = merges.get(name)
        if m is None or tuple(info.shape) == m.shape:
            continue
        rows = info.shape[0] if info.shape else 0
        if m.split == Split.DIM1 or (m.split == Split.ROWS_PADDED and (rank + 1) * rows > m.rows):
            out += info.nbytes
    return out


def _reference_and_twin_bytes(
    plan: ConversionPlan, conv_args: ModelArgs, merges: dict[str, Merge]
) -> tuple[int, int | None]:
    """(bytes of `verify --reference SRC`'s tp-1 state, convert.memory.reference_weights' (unquantized for a bf16
    source; the model is gone once it has run), bytes of the twin: CONVERTED's rank files as the converter's tp-1
    output (run._expected); None where the twin is that state itself (an fp8 source, fp4 experts))."""
    from dsv41_convert.convert.memory import reference_weights

    src_args = load_model_args(Path(plan.src) / "config.json")
    ((state, _model),) = reference_weights(plan, src_args, plan.source_format == "bf16")
    if plan.source_format == "fp8" and conv_args.expert_dtype == "fp4":
        return state, None
    return state, sum(m.nbytes for m in merges.values())


def _replays(opts: VerifyOptions, ref: reffile.Reference, tp: int) -> bool:
    """Whether the rank files are replayed at tp 1 in this process after the tp-N run (verify.replay): against a
    tp-1 file computed on this device, unless --no-replay, or --stream-layers (which replays them in its place)."""
    return ref.tp == 1 and tp > 1 and ref.device == opts.device and opts.replay and not opts.stream_layers


def _verify_ranks(
    opts: VerifyOptions,
    ranks: RankFiles,
    conv_args: ModelArgs,
    say: Progress,
    shown: Callable[[str], Shown],
    warn: Progress,
) -> VerifyResult | None:
    conv, tp = ranks.folder, ranks.tp
    launcher.backend_for(opts.device)
    threads = opts.threads or launcher.default_threads(1 if opts.stream_layers else tp)
    if opts.device == "cpu":
        torch.set_num_threads(threads)  # the reference runs here; at tp 1 the converted model too
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    src_ref: SourceReference | None = None
    stamps: Stamps = {}  # SRC's shards as `--reference SRC` found them (source_stamps)
    side_files_differ: list[str] = []  # tokenizer files of CONVERTED unlike those the reference ran with
    config_note = ""  # why CONVERTED/config.json was not compared with the reference's model
    if opts.reference is not None:
        if not opts.replay:  # it did nothing there, silently (a helper's hunt)
            raise VerifyInputError(
                "--no-replay goes with --reference-logits FILE: against --reference SRC no tp-1 replay runs (the twin, "
                "the converter's output cut into the same ranks, is run beside the rank files instead)"
            )
        src = Path(opts.reference)
        src_args = load_model_args(src / "config.json")
        _check_same_model(src_args, conv_args, src, conv)
        if src_args.expert_dtype == "fp8" and conv_args.expert_dtype == "fp4":  # before minutes of reference
            raise VerifyInputError(
                f"{src}: its routed experts are fp8 (an `export --format fp8` checkpoint) and {conv}'s are fp4: "
                "no conversion of it holds these rank files; verify against the source they were made from (an "
                "`export --format fp8-fp4` of this one holds its values, not the fp4 source's bytes: the fp4 -> "
                "fp8 cast wrote e2m1 -0 as +0, and verify compares bytes)"
            )  # it advised that export, and verify then FAILED a correct conversion against it (an audit)
        tokenizer = conv / "tokenizer.json"
        prompts = read_prompts(opts.prompts, tokenizer if tokenizer.exists() else None, conv_args)
        n_decode = DEFAULT_DECODE_STEPS if opts.n_decode is None else opts.n_decode
        stamps = source_stamps(src)  # before the plan reads a header: a shard rewritten from here on is refused
        plan = reference_plan(src)  # once (1-2 s on the published layout)
        _ranks_fit(opts, ranks, conv_args, reference=plan)
        src_ref = compute_reference(src, prompts, n_decode, opts.max_seq_len, opts.device, True, say, plan)
        ref = src_ref.reference
        ref_name = str(src)
    else:
        given = [o for o, v in (("--prompts", opts.prompts), ("--decode-steps", opts.n_decode),
                                ("--max-seq-len", opts.max_seq_len)) if v is not None]  # fmt: skip
        if given:
            raise VerifyInputError(
                f"{' and '.join(given)} go(es) with --reference SRC; a reference-logits file fixes its prompts, "
                "decode steps and max_seq_len (reference-logits sets them)"
            )
        ref = reffile.load(Path(opts.reference_logits), 128, conv_args)  # every problem of the file, or none
        ref_name = str(opts.reference_logits)
        tokenizer = conv / "tokenizer.json"
        bound, bound_by = prompt_id_bound(
            conv_args.vocab_size, bool(conv_args.engram_layer_ids), tokenizer if tokenizer.exists() else None
        )
        recorded = [(label, [*i.input_ids.tolist(), *r.decode_ids.tolist()]) for label, i, r in
                    zip(ref.labels, ref.inputs, ref.runs, strict=True)]  # fmt: skip
        refuse_recorded_ids_past(recorded, bound, bound_by, ref_name)
        lengths = [(f"{ref_name}: prompt {label}", len(i.input_ids))
                   for label, i in zip(ref.labels, ref.inputs, strict=True)]  # fmt: skip
        require_prompts_fit(conv_args, opts.device, lengths, 1 if opts.stream_layers else tp)
        _ranks_fit(opts, ranks, conv_args, _replays(opts, ref, tp))
        if opts.stream_layers:
            _streamable(opts, ref, ref_name)
        if ref.provenance is not None:  # before any rank starts: another model, or its own replay, is refused
            side_files_differ = provenance.check_converted(ref.provenance, conv, conv_args, tp, Path(ref_name))
        config_note = provenance.config_unchecked(ref.provenance, conv, Path(ref_name))
        if opts.stream_layers:  # the replay runs here, as the whole one does: with the reference's threads
            threads = replay_threads(ref, opts.threads)
            if opts.device == "cpu" and opts.threads not in (None, threads):  # the replay is the only run
                warn(
                    f"--threads {opts.threads}: not used: --stream-layers replays the rank files at the "
                    f"{counted(threads, 'CPU thread')} {ref_name} records (bit for bit only with its sums in its "
                    "order), and runs nothing else"
                )
        elif opts.threads is None and opts.device == "cpu" and ref.tp == tp and ref.threads:
            threads = ref.threads  # the reference's sums, in the reference's order
        if (opts.stream_layers or tp == 1) and opts.device == "cpu":
            torch.set_num_threads(threads)
    seconds["reference"] = time.perf_counter() - t0
    blockers = exact_blockers(
        ref.tp, ref.device, ref.threads, ref.torch_version, ref.weights, 1 if opts.stream_layers else tp, opts.device,
        threads, ref.arithmetic,
    )  # fmt: skip
    mode = choose_mode(ref.weights, not blockers)
    thresholds = default_thresholds(mode)
    if mode != "exact":
        thresholds = thresholds.override(**opts.overrides)
    elif given := _bounds_given(opts.overrides):
        warn(
            f"{given}: not applied: this run is exact (a correct conversion gives the logits of {ref_name} bit for "
            "bit), so any difference fails it; the statistical bounds judge only a run that cannot be exact"
        )

    expected = None
    if src_ref is not None:
        say("twin: the converter's tp-1 output, in memory")
        expected = _expected(src_ref, Path(opts.reference), conv_args)
        # the twin may have read SRC again (expected_shards): no verdict on two versions
        require_unchanged(Path(opts.reference), stamps, "no verdict; run again once SRC is as it should be")
    t1 = time.perf_counter()
    if opts.stream_layers:
        say(f"replay: {conv} merged back to tp 1 one unit at a time, run here (in place of a tp-{tp} run)")
        with shown(f"replay: {conv}") as bars:
            out = _replayed_streamed(ranks, ref, opts.device, bars, ref_name)
        seconds["replay"] = time.perf_counter() - t1
    else:
        say(f"converted: {conv} on {counted(tp, 'rank')} ({opts.device})" + (", beside its twin" if expected else ""))
        teachers = [r.decode_ids for r in ref.runs]
        job = RankJob(str(conv), ref.max_seq_len, ref.inputs, teachers, ref.n_decode, opts.device, twin=expected)
        with shown(f"converted: {conv}") as bars:
            out = launcher.launch(run_converted, job, tp, opts.device, threads, bars, opts.rank_timeout)
        seconds["converted"] = time.perf_counter() - t1
    if out is None:
        return None
    ran: list[Check] = []  # the checks of runs that ran, against the reference's outputs
    result = VerifyResult(str(conv), ref_name, tp, opts.device, thresholds, [], {}, [], seconds=seconds)
    result.statistical = opts.statistical
    if config_note:
        result.config, result.config_note = "not checked", config_note
    if isinstance(out, LoadFailure):
        named = (m if opts.stream_layers else f"rank {r}: {m}" for r, m in out.messages)  # no rank ran the replay
        result.load_error = "\n".join(named)
        result.failures = [f"load: {result.load_error}"]
        if opts.stream_layers:
            result.checks.append(Check("replay", False, True, list(result.failures), _STREAMED))
    else:
        if not opts.stream_layers:
            seconds["compile"] = out.compile_seconds  # part of "converted"
        _compare_all(result, ref, out, thresholds)
        check = _reference_check(result, blockers, ref)
        if opts.stream_layers:  # the replay is the only run: bit for bit against the tp-1 file
            check = Check("replay", check.exact, check.expected_exact, check.failures, f"{_STREAMED}; {check.note}")
        result.checks.append(check)
        ran.append(check)
        if out.twin_runs is not None:
            result.failures += [f"twin weights: {line}" for line in out.twin_weights or ()]
            result.checks.append(_twin_check(result))
    if src_ref is not None:  # the twin runs with CONVERTED's tokenizer: it cannot see a changed one
        side_files_differ = _copied_files_differ(Path(opts.reference), conv)
    result.failures += side_files_differ
    if tp > 1 and (not isinstance(out, LoadFailure) or opts.stream_layers):
        t2 = time.perf_counter()
        say("replicas: the tensors every rank holds, byte for byte across the rank files; Engram padding rows")
        with shown(f"replicas: {conv}") as bytes_done:
            result.failures += [f"replicas: {m}" for m in replica_mismatches(ranks, bytes_done)]
        seconds["replicas"] = time.perf_counter() - t2
    manifest_tp = recorded_tp(our_manifest(conv) or {})
    if (conv / MANIFEST).is_file() and manifest_tp not in (None, tp):
        say(f"manifest: {conv / MANIFEST} records the tp-{manifest_tp} rank files, not these: not checked")
        result.manifest = "another set"
    elif (conv / MANIFEST).is_file():
        t2 = time.perf_counter()
        say(f"manifest: every file's size and sha256 against {conv / MANIFEST}")
        with shown(f"manifest: {conv}") as bytes_done:  # rank files of another tp beside them are not checked
            problems = check_folder(conv, progress=bytes_done, tp=tp, besides=_reference_in(conv, opts)).problems
        result.manifest = "differs" if problems else "held"
        result.failures += [f"manifest: {m}" for m in problems]
        seconds["manifest"] = time.perf_counter() - t2
    recorded = (ref.provenance or {}).get("weights") if src_ref is None else None
    if src_ref is None and recorded is None:
        why = (
            "computed from rank files (reference-logits --stream-layers of a converted folder records none)"
            if isinstance((ref.provenance or {}).get("made_from"), dict)
            else "written with --no-weight-digests, before 2026-12-04, of a bf16 source without --as-converted, "
            "or by another tool"
        )
        result.weights_note = (
            f"{ref_name} records no weight digests ({why}): weights no prompt reaches are not compared"
        )
    elif recorded is not None and isinstance(out, LoadFailure):
        result.weights, result.weights_note = "not compared", "the rank files do not load"
    if recorded is not None and not isinstance(out, LoadFailure):
        t2 = time.perf_counter()
        say(f"weights: every tensor of {conv} against the sha256 {ref_name} records of the weights it ran")
        with shown(f"weights: {conv}") as bytes_done:
            _weights_check(result, recorded, ranks, ref_name, bytes_done)
        seconds["weights"] = time.perf_counter() - t2
    replay_runs = None
    if src_ref is None and _replays(opts, ref, tp):
        t2 = time.perf_counter()
        say(f"replay: {conv} merged back to tp 1 in memory, run in this process")
        check, replay_runs = replay_check(ranks, ref, opts.device, opts.threads, thresholds.bounds)
        result.checks.append(check)
        if replay_runs is not None:
            ran.append(check)
        seconds["replay"] = time.perf_counter() - t2
    if result.weights == "held":  # a FAIL still, with what it can mean (a weights record is no proof)
        for c in ran:
            if c.expected_exact and not c.exact:
                c.note = f"{c.note}; {_WEIGHTS_HELD}"
    replayed = any(c.name == "replay" for c in result.checks)
    teaches = (
        src_ref is None
        and blockers
        and not replayed
        and not isinstance(out, LoadFailure)
        and teacher.applies(ref, conv_args, opts.device)
    )
    if teaches and torchrun.shared_rank() is not None:  # the other ranks ended with the first launch
        teaches = False
        say("teacher: not run under torchrun (it launches the ranks a second time); verify without torchrun runs it")
    if teaches:
        t2 = time.perf_counter()
        say(f"teacher: every module of {conv} on the reference's input to it ({counted(tp, 'rank')})")
        with shown(f"teacher: {conv}") as bars:
            taught = teacher.teacher_threads(ref, opts.device, threads)
            result.checks.append(teacher.teacher_check(conv, ref, tp, opts.device, taught, bars, opts.rank_timeout))
        seconds["teacher"] = time.perf_counter() - t2
    said = set(result.failures)  # the streamed replay's failures are the comparison's, said already
    result.failures += [
        f for c in result.checks if c.name in ("replay", "teacher") for f in c.failures if f not in said
    ]
    ran_drafts = any(r.draft_logits is not None for r in ref.runs)
    if not ran_drafts:  # no decode step ran the DSpark stages
        for c in result.checks:
            c.covers_drafts = c.name in ("weights", "twin")  # they compared the stages' bytes, run or not
    drafts = conv_args.n_mtp_layers > 0
    result.verdict = decide(result.checks, result.failures, opts.statistical, drafts)
    uncovered = drafts and not any(c.decisive and c.covers_drafts for c in result.checks)
    # "on statistical bounds only" where bounds judged drafts; a reference without decode steps has none, and
    # the stages are then what no prompt ran (the report said they were judged: an audit)
    result.drafts_statistical = result.verdict == PASS and drafts and ran_drafts and drafts_uncovered(result.checks)
    result.unreached = not_run_by(ref.inputs, conv_args) + ([DRAFTS_UNREACHED] if uncovered and not ran_drafts else [])
    # what only --statistical let pass: `statistical` said false there, as for a PASS that checks decided (an audit)
    result.drafts_unchecked = result.verdict == PASS and uncovered and not ran_drafts
    if result.verdict == INCONCLUSIVE:
        skipped = weight_digests.experts_stored_as(ranks) if result.weights == "partial" else ""
        result.advice = (
            _STREAMED_ADVICE
            if opts.stream_layers
            else advice(tp, src_ref is not None, drafts_uncovered(result.checks), skipped or "", ref.weights == "bf16")
        )
    if result.verdict == FAIL and opts.localize:
        say("localizing the mismatch")
        t3 = time.perf_counter()
        result.localization = _localize(result, ref, out, expected, ranks, conv_args, thresholds, replay_runs)
        seconds["localize"] = time.perf_counter() - t3
    return result


DRAFTS_UNREACHED = (
    "the DSpark MTP stages (mtp.*: the reference ran no decode step, so no draft was computed; "
    "`reference-logits --decode-steps N` runs them)"
)


def not_run_by(inputs: Sequence[ModelInput | Prompt], args: ModelArgs) -> list[str]:
    """Parts of the model that none of the prompts (or their model inputs) runs, so no check can have seen
    their weights: without an image prompt (the default prompts have none), the vision tower and aligner and
    what only image tokens use: the image_start / image_end / image_newline embeddings and every MoE gate's
    bias_vl."""
    if args.vision_enabled and not any(i.image for i in inputs):
        return [
            "vision tower and aligner, the image_start/image_end/image_newline embeddings and every MoE gate's "
            'bias_vl (image tokens only; no prompt has an image; add one: --prompts with "image")'
        ]
    return []


def _copied_files_differ(src: Path, conv: Path) -> list[str]:
    """The files `shard` copies from SRC unchanged that CONVERTED lacks or holds with other bytes, each as a
    failure: the tokenizer's (Engram hashes its ids), and SRC's config.json as hf_config.json where CONVERTED
    has one (the bundled model reads neither; upstream convert.py writes no hf_config.json)."""
    found = []
    for name in SIDECARS:
        theirs, ours = src / name, conv / name
        if theirs.is_file() and not (ours.is_file() and ours.read_bytes() == theirs.read_bytes()):
            found.append(f"tokenizer: {ours} {'differs from' if ours.is_file() else 'is missing, unlike'} {theirs}")
    theirs, ours = src / "config.json", conv / HF_CONFIG
    if ours.is_file() and ours.read_bytes() != theirs.read_bytes():
        found.append(f"hf config: {ours} differs from {theirs}, which shard copies there unchanged")
    return found


_STREAMED = "rank files merged back to tp 1 one unit at a time (--stream-layers), run here"
_STREAMED_ADVICE = (
    "the streamed replay is exact against a tp-1 file of the converted weights computed on this device with "
    "the same torch: `reference-logits SRC FILE --stream-layers` of the published (fp8) source; of a bf16 source "
    "only `reference-logits SRC FILE --as-converted` (the whole model) computes one"
)


def _bounds_given(overrides: dict[str, float | None]) -> str:
    """The statistical bounds given on the command line, as given ("--atol 0.5, --max-kl 2"); "" for none."""
    return ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in overrides.items() if v is not None)


def _streamable(opts: VerifyOptions, ref: reffile.Reference, ref_name: str) -> None:
    """VerifyInputError unless the streamed replay can decide against `ref`: a tp-1 file (the replay is a
    tp-1 run), and --stream-layers not beside --no-replay (it is the replay)."""
    if not opts.replay:
        raise VerifyInputError("--stream-layers is the tp-1 replay, one unit at a time: drop --no-replay")
    if torchrun.world() not in (None, 1):  # world() also refuses a RANK or WORLD_SIZE set alone
        raise VerifyInputError("--stream-layers runs in one process: run it without torchrun")
    if ref.tp != 1:
        raise VerifyInputError(
            f"{ref_name}: a tp-{ref.tp} reference; --stream-layers replays the rank files at tp 1 and compares them "
            "with a tp-1 file (`reference-logits SRC FILE --stream-layers`, or --tp 1)"
        )


def _replayed_streamed(
    ranks: RankFiles, ref: reffile.Reference, device: str, bars, ref_name: str
) -> RankResult | LoadFailure:
    """The streamed replay's runs (verify.streamed.replay_streamed), or the reason the rank files do not run
    as one tp-1 model (they do not merge, or a merged tensor does not fit the model); a prompt of the reference
    it cannot run is an input error naming `ref_name`, the file."""
    from dsv41_convert.verify.streamed import replay_streamed

    try:
        return RankResult(replay_streamed(ranks, ref, device, bars, ref_name), None)
    except (ShardConsistencyError, PlanError) as exc:
        return LoadFailure([(0, f"the rank files do not merge back to tp 1 and load: {exc}")])


def _reference_check(result: VerifyResult, blockers: list[str], ref: reffile.Reference) -> Check:
    """The converted ranks against the reference: bit for bit where that is expected, else within the statistical
    bounds. Its failures are the comparison's (_compare_all's, the twin's left to its check): a bound broken
    where bit equality was not expected is one too (the report said `held` beside the FAIL it made)."""
    exact = all(s.max_abs == 0 for s in result.overall.values())
    what = f"tp {ref.tp} {ref.device} reference, converted at tp {result.tp}"
    fails = [] if exact else [f for f in result.failures if not f.startswith(("twin ", "load:"))]
    if not blockers:
        return Check("reference", exact, True, fails, what + ": bit equality expected")
    return Check("reference", exact, False, fails, what + "; not bit-exact: " + "; ".join(blockers))


def _weights_check(
    result: VerifyResult, recorded: dict, ranks: RankFiles, file: str, bytes_done: ByteProgress | None = None
) -> None:
    """CONVERTED's tensors against the reference file's digests (weight_digests.py): every weight, whether a
    prompt reaches it or not. Runs after the rank files loaded into the model (strictly: its tensors, no
    others), so a name the record lacks or adds is the `file`'s error (VerifyInputError), not CONVERTED's."""
    try:
        found, note = weight_digests.compare(recorded, ranks, bytes_done)
    except ShardConsistencyError as exc:  # rank files that disagree are a faulty conversion, replay or not
        found, note = [str(exc)], "the rank files do not merge into one model"
    except PlanError as exc:
        found, note = None, f"not compared: {exc}"
    result.weights_note = note
    if found is None:
        result.weights = "not compared"
        return
    listed = [f for f in found if f.endswith((weight_digests.NOT_HELD, weight_digests.NOT_RECORDED))]
    if listed:  # the rank files loaded into the model strictly: they hold its tensors, so the record is wrong
        raise VerifyInputError(
            f"{file}: its weights record (metadata provenance.weights) does not list the tensors of the model it "
            f"ran, whose rank files here load into it: {'; '.join(listed[:4])}"
            + (f"; and {len(listed) - 4} more" if len(listed) > 4 else "")
            + "; recompute the reference (an edited or damaged file)"
        )
    every = weight_digests.compares_every_weight(recorded, ranks)
    result.weights = "differs" if found else "held" if every else "partial"
    failures = [f"weights: {f}" for f in found]
    result.failures += failures
    result.checks.append(Check("weights", every and not found, every, failures, note))


def _twin_check(result: VerifyResult) -> Check:
    fails = [f for f in result.failures if f.startswith("twin ")]
    exact = all(s.max_abs == 0 for s in result.twin.values()) and not any(f.startswith("twin weights") for f in fails)
    what = "the converter's expected tp-1 output cut into the same ranks: its logits, and every weight's bytes"
    return Check("twin", exact, True, fails, what)


def _sections(ref: PromptRun, got: PromptRun, has_all: bool) -> dict[str, Stats]:
    out = {"last": compare(ref.logits, got.logits)}
    if has_all:
        out["all"] = compare(ref.logits_all, got.logits_all)
    if ref.decode_logits.shape[0]:
        out["decode"] = compare(ref.decode_logits, got.decode_logits)
    if ref.draft_logits is not None and got.draft_logits is not None:
        out["draft"] = compare(ref.draft_logits, got.draft_logits)
    if ref.draft_confidence is not None and got.draft_confidence is not None:
        out["confidence"] = compare(ref.draft_confidence, got.draft_confidence)
    return out


def _expected(src_ref: SourceReference, src: Path, conv_args: ModelArgs):
    """The converter's tp-1 output for CONVERTED's options, computed in memory."""
    from dsv41_convert.verify.source import expected_shards

    expert_dtype = "fp4" if conv_args.expert_dtype == "fp4" else "fp8"
    if src_ref.reference.source_format == "fp8" and expert_dtype == "fp4":
        return src_ref.state  # a pass-through: the reference weights are the tp-1 output
    return expected_shards(src, expert_dtype)


def _compare_all(result: VerifyResult, ref: reffile.Reference, out: RankResult, th: Thresholds) -> None:
    twins = out.twin_runs or [None] * len(out.runs)
    for label, inp, r, g, w in zip(ref.labels, ref.inputs, ref.runs, out.runs, twins, strict=True):
        sections = _sections(r, g, ref.has_logits_all)
        fails = [f"{k}: {msg}" for k, s in sections.items() for msg in judge(s, th.bounds[k])]
        twin = _sections(w, g, True) if w is not None else {}
        fails += [f"twin {k}: {msg}" for k, s in twin.items() for msg in judge(s, EXACT)]
        result.prompts.append(PromptResult(label, len(inp.input_ids), sections, fails, twin))
    for key in SECTIONS:
        parts = [p.sections[key] for p in result.prompts if key in p.sections]
        if parts:
            result.overall[key] = merge(parts)
            result.failures += [f"{key}: {msg}" for msg in judge(result.overall[key], th.bounds[key])]
    for key in SECTIONS:
        parts = [p.twin[key] for p in result.prompts if key in p.twin]
        if parts:
            result.twin[key] = merge(parts)
            result.failures += [f"twin {key}: {msg}" for msg in judge(result.twin[key], EXACT)]


_WEIGHTS_HELD = (
    "every tensor is the bytes the reference's weights record names, so either this run computes otherwise "
    "than the reference in something its file does not record (another CPU's kernels, a library build, "
    "edited metadata such as threads) or the record is not the weights the reference ran; recompute the "
    "reference on this machine (`reference-logits`) to tell them apart"
)


def _localize(result, ref, out, expected, ranks: RankFiles, conv_args: ModelArgs, th: Thresholds, replay_runs):
    tp = ranks.tp
    loc = localize.Localization()
    replicas = [f.removeprefix("replicas: ") for f in result.failures if f.startswith("replicas: ")]
    if isinstance(out, LoadFailure) and replicas:  # the streamed merge refuses differing copies: they say where
        loc.module = localize.module_of(replicas[0].split(":")[0], conv_args.n_layers)
        loc.note = f"{replicas[0]} (the replicas check: bytes the rank files must agree on)"
    elif isinstance(out, LoadFailure):
        loc.note = "the shards do not load into the model; see the load error"
    else:
        # against the twin or in the tp-1 replay the first differing bit counts; else the mode's tolerance
        ref_hidden, rtol = [r.hidden for r in ref.runs], th.hidden_rtol
        conv_hidden = [r.hidden for r in out.runs]
        if out.twin_runs is not None:
            ref_hidden, rtol = [r.hidden for r in out.twin_runs], 0.0
        elif replay_runs is not None and any(
            c.name == "replay" and c.expected_exact and c.failures for c in result.checks
        ):
            conv_hidden, rtol = [r.hidden for r in replay_runs], 0.0  # not a replay held to bounds: noise everywhere
        exact_pair = out.twin_runs is not None or rtol == 0.0
        if any(ref_hidden):
            loc.module, loc.module_errors = localize.first_divergence(ref_hidden, conv_hidden, rtol)
        backbone_failed = any(not {"draft", "confidence"} & set(f.split(":")[0].split()) for f in result.failures)
        failed_sections = {f.split(":")[0].split()[-1] for f in result.failures} & set(SECTIONS)  # any run's
        taught = [f.split(":")[0].removeprefix("teacher ") for f in result.failures if f.startswith("teacher ")]
        unmerged = [f.removeprefix("replay: ") for f in result.failures if f.startswith("replay: ")]
        weights = [f.split("weights: ", 1)[1] for f in result.failures if f.startswith(("twin weights: ", "weights: "))]
        tokenizer = [f.removeprefix("tokenizer: ") for f in result.failures if f.startswith("tokenizer: ")]
        hf_config = [f.removeprefix("hf config: ") for f in result.failures if f.startswith("hf config: ")]
        manifest = [f.removeprefix("manifest: ") for f in result.failures if f.startswith("manifest: ")]
        if tokenizer:  # not a weight: the token ids Engram hashes
            loc.module = None
            loc.note = f"{tokenizer[0]}: the tokenizer, not a weight (Engram hashes its token ids)"
        elif hf_config and loc.module is None:
            loc.note = f"{hf_config[0]}: a side file, not a weight (the bundled model reads config.json)"
        elif manifest and len(manifest) == len(result.failures) and loc.module is None:  # nothing else failed
            loc.note = f"{manifest[0]} (the manifest check: the files against their record)"
        elif replicas:  # the bytes themselves say where: a copy that differs, or padding that is not the fill
            loc.module = localize.module_of(replicas[0].split(":")[0], conv_args.n_layers)
            loc.note = f"{replicas[0]} (the replicas check: bytes the rank files must agree on)"
        elif weights and (loc.module is None or not exact_pair):  # the bytes say where; no output (or noise) did
            loc.module = localize.module_of(weights[0].split()[0], conv_args.n_layers)
            outputs = (
                "no prompt's output differs"
                if not failed_sections
                else "the DSpark drafts differ, no hidden state does"
                if failed_sections <= {"draft", "confidence"}
                else "the logits differ, no hidden state does"
            )
            loc.note = f"{weights[0]}" + (f"; {outputs}" if exact_pair else "")
        elif unmerged:  # the rank files disagree: the merge names the tensor
            loc.module = localize.module_of(unmerged[0].split(":")[0], conv_args.n_layers)
            loc.note = f"the rank files do not merge back to tp 1: {unmerged[0]}"
        elif taught:
            loc.module = min(map(localize.module_of_output, taught), key=localize.module_order)
            loc.note = "the first module the teacher check failed"
        elif not exact_pair and ref.tp != tp:
            loc.module = None
            loc.note = (
                f"not localized: the reference ran at tp {ref.tp} and the rank files at tp {tp}, so every "
                "module's output differs by reduction noise; a reference at this tp, or --reference SRC, localizes"
            )
        elif loc.module is None and not backbone_failed:
            loc.module = "mtp"
            loc.note = "the backbone agrees; the DSpark stages (mtp.*) differ"
        elif loc.module is None and any(ref_hidden):
            loc.module = "head"
            loc.note = "every prefill module output agrees within tolerance; the head or a decode-only path differs"
        elif not any(ref_hidden):
            loc.note = "the reference file holds no hidden states: module not localized"
    if expected is None:
        loc.note = (loc.note + "; " if loc.note else "") + "tensor diff needs --reference SRC"
        return loc
    scope = localize.scope(loc.module, conv_args.n_layers) if loc.module else ()
    loc.tensors = localize.diff_tensors(localize.read_rank_files(ranks), expected, scope)
    return loc


def _reference_in(conv: Path, opts: VerifyOptions) -> frozenset[str]:
    """The reference file's name where it lies in CONVERTED itself: no file of the conversion, and not one to
    call a different conversion's (a correct set kept with its reference FAILed on it: an audit)."""
    ref = opts.reference_logits
    if ref is not None and Path(ref).absolute().parent.resolve() == conv.resolve():  # where it lies, a link too
        return frozenset({Path(ref).name})
    return frozenset()
