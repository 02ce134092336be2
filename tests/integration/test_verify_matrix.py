"""The fault matrix of decisive verify (issue 16): planted faults x references x tp, on the CPU.

References: our own tp-1 file (hidden states), our own tp-N file (same tp: the reference check is
exact), and an "external" tp-1 file as another implementation would write it (logits, decode, drafts,
no hidden states, no threads/torch metadata). Every faulty set must FAIL (never exit 0), every correct
set must PASS on a decisive check. One 24-token prompt and one decode step keep each run to seconds;
the source, the conversions and the references are built once per module and faults are planted in
copies.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_verify_reference_file import _off_by_an_ulp, damaged

from dsv41_convert.config import load_model_args
from dsv41_convert.convert.execute import execute
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.unshard import unshard_tensors
from dsv41_convert.errors import VerifyInputError
from dsv41_convert.synth.presets import TINY
from dsv41_convert.synth.write import write_checkpoint
from dsv41_convert.verify import reffile
from dsv41_convert.verify.prompts import default_prompts, load_prompts
from dsv41_convert.verify.reference import compute_reference_ranks
from dsv41_convert.verify.run import VerifyOptions, verify
from dsv41_convert.verify.runner import build_model, load_state
from dsv41_convert.verify.weight_digests import tensor_sha256

pytestmark = [pytest.mark.slow, pytest.mark.dist]
PROMPT_LEN = 24
REFS = ("tp1", "tpN", "external")


class Matrix:
    def __init__(self, root: Path):
        self.root = root
        ids = default_prompts(TINY.vocab_size, count=1, length=PROMPT_LEN)[0].input_ids
        self.prompts_file = root / "prompts.jsonl"
        self.prompts_file.write_text(json.dumps({"input_ids": list(ids)}) + "\n")
        self.src = root / "src-fp8"
        write_checkpoint(self.src, TINY, seed=0, quantized=True, vision=False)
        self._probe: dict | None = None

    def shard(self, tp: int, src: Path | None = None, expert_dtype: str = "fp4", tag: str = "fp8") -> Path:
        out = self.root / f"{tag}-{expert_dtype}-mp{tp}"
        if not out.exists():
            execute(build_plan(src or self.src, tp, expert_dtype), out)
        return out

    def reference(self, kind: str, tp: int, src: Path | None = None, as_converted: bool = False, tag="fp8") -> Path:
        """own tp-1 / tp-N reference file (kind "tp1" / "tpN"), or the external tp-1 file."""
        rtp = tp if kind == "tpN" else 1
        path = self.root / f"ref-{tag}-{'conv' if as_converted else 'src'}-tp{rtp}.safetensors"
        if not path.exists():
            prompts = load_prompts(self.prompts_file, None, TINY.vocab_size)
            threads = 1  # as verify's ranks at tp >= 2 on 2 cores; 2 threads spin on a loaded machine
            torch.set_num_threads(threads)
            ref = compute_reference_ranks(src or self.src, prompts, rtp, 1, None, "cpu", as_converted, threads)
            reffile.save(ref, path)
        if kind != "external":
            return path
        ext = self.root / f"ref-{tag}-external.safetensors"
        if not ext.exists():
            keep = ("input_ids", "logits", "logits_all", "decode_ids", "decode_logits", "draft_logits")
            t = {k: v for k, v in load_file(str(path)).items() if k in keep}
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
            meta = {k: meta[k] for k in ("format", "max_seq_len", "source_format", "device")}
            save_file(t, str(ext), meta | {"tp": "1"})
        return ext

    def probe(self) -> dict:
        """What the prompt touches at tp 1: the expert of layer 2 most tokens route to, an Engram row of layer 0."""
        if self._probe is None:
            folder = self.shard(2)
            args = load_model_args(folder / "config.json").with_runtime(max_batch_size=1, max_seq_len=128)
            model = build_model(args, folder, "cpu")
            load_state(model, unshard_tensors(folder))
            seen = {}
            model.layers[2].ffn.gate.register_forward_hook(lambda m, i, o: seen.update(idx=o[1]) or None)
            model.layers[0].engram.embed.register_forward_hook(lambda m, i, o: seen.update(rows=i[0]) or None)
            ids = load_prompts(self.prompts_file, None, TINY.vocab_size)[0].input_ids
            model(torch.tensor([ids]), 0)
            rows = seen["rows"].flatten()
            self._probe = {
                "expert": int(torch.bincount(seen["idx"].flatten()).argmax()),
                "engram_row": int(rows[len(rows) // 2]),
                "engram_rows": args.engram_num_embeddings[0],
                "unhashed_row": min(set(range(args.engram_num_embeddings[0])) - set(rows.tolist())),
                "unrouted_expert": min(set(range(args.n_routed_experts)) - set(seen["idx"].flatten().tolist())),
            }
        return self._probe

    def faulty(self, name: str, tp: int) -> Path:
        dst = self.root / f"fault-{name}-mp{tp}"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(self.shard(tp), dst)
        return dst


@pytest.fixture(scope="module")
def m(tmp_path_factory) -> Matrix:
    return Matrix(tmp_path_factory.mktemp("matrix"))


def _verify(conv: Path, ref: Path, **kw):
    # one thread per process: the references' (the external file does not record it: --threads says it)
    return verify(VerifyOptions(conv, reference_logits=ref, threads=1, **kw))


def _edit(folder: Path, rank: int, tp: int, fn) -> None:
    path = folder / f"model{rank}-mp{tp}.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _swap_between(folder: Path, tp: int, names: list[tuple[str, str]], ranks: tuple[int, int]) -> None:
    """Exchange the data of name_a in rank a's file with name_b in rank b's file (names kept)."""
    a, b = (load_file(str(folder / f"model{r}-mp{tp}.safetensors")) for r in ranks)
    for na, nb in names:
        a[na], b[nb] = b[nb].clone(), a[na].clone()
    save_file(a, str(folder / f"model{ranks[0]}-mp{tp}.safetensors"))
    save_file(b, str(folder / f"model{ranks[1]}-mp{tp}.safetensors"))


def _bump_byte(name: str, at: tuple[int, ...], by: int = 1):
    def fn(t):
        raw = t[name].view(torch.uint8).clone()
        raw[at] += by
        t[name] = raw.view(t[name].dtype)

    return fn


# --- the faults: (folder, tp) -> None, planted in a copy of a correct conversion ---


def experts_swapped_within_rank(m: Matrix, d: Path, tp: int) -> None:
    def fn(t):
        a, b = "layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.1.w1.weight"
        t[a], t[b] = t[b].clone(), t[a].clone()

    _edit(d, 0, tp, fn)


def experts_swapped_across_ranks(m: Matrix, d: Path, tp: int) -> None:
    per_rank = TINY.n_routed_experts // tp
    a, b = 1, 1 + per_rank  # rank 0's expert 1, rank 1's first expert + 1
    names = [(f"layers.0.ffn.experts.{a}.{p}.{k}", f"layers.0.ffn.experts.{b}.{p}.{k}")
             for p in ("w1", "w2", "w3") for k in ("weight", "scale")]  # fmt: skip
    _swap_between(d, tp, names, (0, 1))


def fp8_block_scale_changed(m: Matrix, d: Path, tp: int) -> None:
    _edit(d, 1, tp, _bump_byte("layers.1.attn.wq_b.scale", (0, 0)))  # one 32x32 block doubled


def dim0_split_exchanged(m: Matrix, d: Path, tp: int) -> None:
    names = [(n, n) for n in ("layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale")]
    _swap_between(d, tp, names, (0, 1))


def dim1_split_exchanged(m: Matrix, d: Path, tp: int) -> None:
    names = [(n, n) for n in ("layers.2.attn.wo_b.weight", "layers.2.attn.wo_b.scale")]
    _swap_between(d, tp, names, (0, 1))


def routed_expert_nibble(m: Matrix, d: Path, tp: int) -> None:
    expert = m.probe()["expert"]
    name = f"layers.2.ffn.experts.{expert}.w1.weight"

    def flip(t):
        flat = t[name].view(torch.uint8).clone().flatten()
        at = int((flat & 0x07).argmax())  # a low nibble of the largest magnitude (6.0)
        flat[at] ^= 0x08  # its sign bit
        t[name] = flat.reshape(t[name].shape[0], -1).view(torch.float4_e2m1fn_x2)

    _edit(d, expert // (TINY.n_routed_experts // tp), tp, flip)


def engram_row(m: Matrix, d: Path, tp: int) -> None:
    p = m.probe()
    k = -(-p["engram_rows"] // tp)
    row = p["engram_row"]
    _edit(d, row // k, tp, _bump_byte("layers.0.engram.embed.weight", (row % k, 0), by=8))


def engram_padding_row_missing(m: Matrix, d: Path, tp: int) -> None:
    def drop(t):
        for k in ("layers.0.engram.embed.weight", "layers.0.engram.embed.scale"):
            t[k] = t[k][:-1].contiguous()

    _edit(d, tp - 1, tp, drop)


def wo_a_left_fp8(m: Matrix, d: Path, tp: int) -> None:
    index = json.loads((m.src / "model.safetensors.index.json").read_text())["weight_map"]
    name = "layers.2.attn.wo_a"
    w = load_file(str(m.src / index[f"{name}.weight"]))[f"{name}.weight"]
    s = load_file(str(m.src / index[f"{name}.scale"]))[f"{name}.scale"]
    for rank in range(tp):
        rows, srows = w.shape[0] // tp, s.shape[0] // tp

        def fp8(t, rank=rank, rows=rows, srows=srows):
            t[f"{name}.weight"] = w[rank * rows : (rank + 1) * rows].contiguous()
            t[f"{name}.scale"] = s[rank * srows : (rank + 1) * srows].contiguous()

        _edit(d, rank, tp, fp8)


def tensor_of_another_layer(m: Matrix, d: Path, tp: int) -> None:
    for rank in range(tp):  # consistent on every rank: only the values are wrong
        _edit(d, rank, tp, lambda t: t.__setitem__("layers.1.attn.wkv.weight", t["layers.2.attn.wkv.weight"].clone()))


def tensor_not_in_the_model(m: Matrix, d: Path, tp: int) -> None:
    for rank in range(tp):  # the same on every rank: the rank files merge, the model has no such tensor
        _edit(d, rank, tp, lambda t: t.__setitem__("layers.0.attn.bogus", torch.zeros(4)))


FAULTS = {f.__name__: f for f in (
    tensor_not_in_the_model, experts_swapped_within_rank, experts_swapped_across_ranks, fp8_block_scale_changed,
    dim0_split_exchanged, dim1_split_exchanged, routed_expert_nibble, engram_row, engram_padding_row_missing,
    wo_a_left_fp8, tensor_of_another_layer,
)}  # fmt: skip
# tp 2: every fault against our tp-1 file (the replay, which also localizes); the same-tp file and the external
# file get the faults of issue 16 and the subtle ones; tp 4 and 8 the cross-rank faults (8 ranks on 2 cores are slow)
ISSUE_FAULTS = ("experts_swapped_within_rank", "fp8_block_scale_changed", "dim1_split_exchanged")
CASES = [(f, 2, "tp1") for f in FAULTS if f != "engram_padding_row_missing"]
CASES += [(f, 2, "tpN") for f in (*ISSUE_FAULTS, "routed_expert_nibble", "engram_row", "tensor_of_another_layer")]
CASES += [(f, 2, "external") for f in (*ISSUE_FAULTS, "experts_swapped_across_ranks")]
CASES += [("engram_padding_row_missing", 4, "tp1"), ("experts_swapped_across_ranks", 4, "tpN")]
CASES += [("dim0_split_exchanged", 8, "tp1"), ("fp8_block_scale_changed", 8, "tpN")]


@pytest.mark.parametrize(("fault", "tp", "ref"), CASES, ids=[f"{f}-tp{t}-{r}" for f, t, r in CASES])
def test_faulty_set_fails(m, fault, tp, ref):
    d = m.faulty(fault, tp)
    FAULTS[fault](m, d, tp)
    result = _verify(d, m.reference(ref, tp))
    assert result.verdict == "FAIL", (result.verdict, result.checks)
    if ref == "tp1" and result.load_error is None:  # the replay found it, bit for bit, and names the module
        assert any(f.startswith("replay") for f in result.failures), result.failures
        assert result.localization.module is not None


@pytest.mark.parametrize("stream_layers", [False, True])
def test_a_tensor_the_model_lacks_fails_in_every_replay(m, stream_layers):
    """The streamed replay called it an input error (exit 2, "layers.0.attn.bogus: no rule in rules.py matches
    this tensor", no file named: the replicas' check looked up its rule; an audit) where the whole replay's
    load FAILs it: now both FAIL, naming the tensor as the rank files hold it."""
    d = m.faulty("tensor_not_in_the_model", 2)
    tensor_not_in_the_model(m, d, 2)
    result = _verify(d, m.reference("tp1", 2), stream_layers=stream_layers)
    assert result.verdict == "FAIL", (result.verdict, result.checks)
    assert "layers.0.attn.bogus: in the shard (F32 [4]) but not in the model" in str(result.load_error), (
        result.load_error
    )


@pytest.mark.parametrize(("tp", "ref"), [(2, "tp1"), (2, "tpN"), (2, "external"), (4, "tp1"), (4, "tpN"),
                                         (8, "tp1"), (8, "tpN")])  # fmt: skip
def test_correct_fp8_conversion_passes_decisively(m, tp, ref):
    result = _verify(m.shard(tp), m.reference(ref, tp))
    assert result.verdict == "PASS", (result.failures, result.checks)
    want = {"tpN": ["reference", "weights"], "tp1": ["weights", "replay"], "external": ["replay"]}[ref]
    assert result.decisive == want  # the external file records no weight digests


def test_fp8_experts_pass_by_replay(m):
    result = _verify(m.shard(2, expert_dtype="fp8"), m.reference("tp1", 2))
    assert result.verdict == "PASS" and "replay" in result.decisive, result.checks


def test_bf16_source_quantized(m):
    src = m.root / "src-bf16"
    if not src.exists():
        write_checkpoint(src, TINY, seed=0, quantized=False, vision=False)
    conv = m.shard(2, src=src, tag="bf16")
    # against the bf16 model only statistical bounds apply: INCONCLUSIVE, PASS only when accepted
    plain = m.reference("tp1", 2, src=src, tag="bf16")
    result = _verify(conv, plain)
    assert result.verdict == "INCONCLUSIVE" and not result.decisive, result.checks
    assert "reference-logits SRC OUT --tp 2 --as-converted" in result.advice  # without it: the same file (an audit)
    assert "`reference-logits SRC OUT --as-converted`" in result.advice
    assert _verify(conv, plain, statistical=True).verdict == "PASS"
    # against the converter's quantized output (--as-converted) the replay is exact
    result = _verify(conv, m.reference("tp1", 2, src=src, as_converted=True, tag="bf16"))
    assert result.verdict == "PASS" and result.decisive == ["weights", "replay"], result.checks


def test_a_replay_not_expected_bit_for_bit_fails_on_nan_logits(m):
    """Against the unquantized bf16 model no replay is bit-exact: the replay was judged by nothing and said
    `held, not bit for bit` beside NaN logits (a NaN norm weight on every rank). verify hands it the run's
    bounds, so the replay fails too, and is not localized bit for bit (that blamed the first module)."""
    src = m.root / "src-bf16"
    if not src.exists():
        write_checkpoint(src, TINY, seed=0, quantized=False, vision=False)
    conv = m.root / "bf16-nan-norm"
    if conv.exists():
        shutil.rmtree(conv)
    shutil.copytree(m.shard(2, src=src, tag="bf16"), conv)

    def nan_norm(t):
        t["layers.1.ffn_norm.weight"] = t["layers.1.ffn_norm.weight"].clone().fill_(float("nan"))

    for rank in range(2):
        _edit(conv, rank, 2, nan_norm)
    result = _verify(conv, m.reference("tp1", 2, src=src, tag="bf16"), statistical=True)
    replay = next(c for c in result.checks if c.name == "replay")
    assert result.verdict == "FAIL" and not replay.expected_exact, result.checks
    assert any(f.startswith("replay ") for f in replay.failures), replay


def _without_hidden(path: Path) -> Path:
    """A copy of a reference file without its hidden states (as another implementation might write it)."""
    out = path.with_name(path.stem + "-bare.safetensors")
    if not out.exists():
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        save_file({k: v for k, v in load_file(str(path)).items() if not k.startswith("hidden.")}, str(out), meta)
    return out


def _without_weight_digests(path: Path) -> Path:
    """A copy of a reference file whose provenance records no weight digests (as one written before them)."""
    out = path.with_name(path.stem + "-undigested.safetensors")
    if not out.exists():
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        prov = json.loads(meta["provenance"])
        del prov["weights"]
        save_file(load_file(str(path)), str(out), meta | {"provenance": json.dumps(prov, sort_keys=True)})
    return out


def test_reference_at_another_tp(m):
    """The file records the digests of the weights it ran: every tensor of the tp-4 files, cut to tp 2,
    compared byte for byte decides (the teacher runs beside it, evidence only). Without the digests the
    teacher's held bound is not decisive (it was, and an audit found a reached fault inside it):
    INCONCLUSIVE; without hidden states too, only statistical bounds apply."""
    result = _verify(m.shard(4), m.reference("tpN", 2))
    assert result.verdict == "PASS" and result.decisive == ["weights"], (result.failures, result.checks)
    assert [c.name for c in result.checks] == ["reference", "weights", "teacher"] and not result.failures
    result = _verify(m.shard(4), _without_weight_digests(m.reference("tpN", 2)))
    assert result.verdict == "INCONCLUSIVE" and not result.decisive, (result.failures, result.checks)
    assert "records their digests" in result.advice and "--reference SRC" in result.advice
    assert any(c.name == "teacher" and not c.failures for c in result.checks)
    result = _verify(m.shard(4), _without_weight_digests(_without_hidden(m.reference("tpN", 2))))
    assert result.verdict == "INCONCLUSIVE" and "--tp 4" in result.advice
    assert result.checks[0].name == "reference" and not result.checks[0].expected_exact


def test_cli_exit_codes(m, monkeypatch, capsys):
    from cli_run import run_cli

    conv, ref = str(m.shard(4)), str(_without_weight_digests(_without_hidden(m.reference("tpN", 2))))
    args = ("verify", conv, "--reference-logits", ref, "--threads", "1")
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--json")
    assert code == 3 and json.loads(out)["verdict"] == "INCONCLUSIVE"
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--statistical")
    assert code == 0 and "PASS" in out and "statistical bounds only" in out
    # --no-replay against the tp-1 file without weight digests: the teacher check holds, which is evidence,
    # not proof (exit 3; it was counted decisive, and --statistical said "decisive: teacher within measured
    # noise" of a run whose reached fault it held: an audit); the text says what went unchecked
    undigested = str(_without_weight_digests(m.reference("tp1", 2)))
    args = ("verify", str(m.shard(2)), "--reference-logits", undigested, "--threads", "1")
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--no-replay")
    assert code == 3 and "INCONCLUSIVE" in out and "teacher check held within its measured noise bound" in out
    assert "weights: not recorded" in out and "weights no prompt reaches are not compared" in out
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--no-replay", "--statistical")
    assert code == 0 and "statistical bounds only (--statistical); the teacher check held" in out, out
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--no-replay", "--statistical", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["decisive"] == [] and doc["statistical"] and not doc["drafts_statistical"]
    # with the digests, the weights check decides without the replay; with the replay too
    args = ("verify", str(m.shard(2)), "--reference-logits", str(m.reference("tp1", 2)), "--threads", "1")
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--no-replay", "--json")
    assert code == 0 and json.loads(out)["decisive"] == ["weights"], out
    code, out, _ = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "PASS" in out and "decisive: weights bit for bit, replay bit for bit" in out, out


# --- the teacher-forced per-module check (verify.teacher), the tp-1 replay turned off as for a model too
# large to merge in one process: every correct set passes, each fault fails in the module it was planted in
TEACHER_FAULTS = [
    ("experts_swapped_within_rank", 2, "layers.0.ffn"),
    ("fp8_block_scale_changed", 2, "layers.1.attn"),
    ("routed_expert_nibble", 2, "layers.2.ffn"),  # the smallest effect measured: 9 ulps, bound 2
    ("engram_row", 2, "layers.0.engram"),
    ("dim1_split_exchanged", 4, "layers.2.attn"),
]


@pytest.mark.parametrize("tp", [2, 4])
def test_teacher_passes_correct_sets(m, tp):
    """The teacher holds on every correct set (without the replay; the weights check decides)."""
    result = _verify(m.shard(tp), m.reference("tp1", tp), replay=False)
    assert result.verdict == "PASS" and result.decisive == ["weights"], (result.failures, result.checks)
    assert not result.failures and any(c.name == "teacher" and not c.failures for c in result.checks)


def test_a_dspark_fault_is_never_a_pass(m):
    """Every e8m0 block scale of a DSpark stage's wo_b doubled on all ranks: the teacher check (backbone
    modules on the prompt) and the statistical draft bounds both held, and verify said PASS (decisive);
    now the teacher alone is inconclusive, and the replay fails it."""
    d = m.faulty("dspark_scale", 2)
    for r in range(2):

        def double(t):
            name = "mtp.0.attn.wo_b.scale"  # wo_b: no norm after it to cancel the factor 2
            raw = t[name].view(torch.uint8).clone()
            raw += 1
            t[name] = raw.view(t[name].dtype)

        _edit(d, r, 2, double)
    result = _verify(d, m.reference("tp1", 2), replay=False)
    assert result.verdict != "PASS", (result.failures, result.checks)
    result = _verify(d, m.reference("tp1", 2))
    assert result.verdict == "FAIL" and any(f.startswith("replay draft") for f in result.failures), result.failures


def test_a_rank_set_that_does_not_merge_is_localized_to_the_tensor(m):
    """Engram padding rows that are not the fill byte at tp 4: the replay's merge names the tensor, but the
    localization said "not localized: ... reduction noise" (an audit)."""
    d = m.faulty("engram_padding_dirty", 4)
    name = "layers.0.engram.embed.weight"

    def dirty(t):
        raw = t[name].view(torch.uint8).clone()
        raw[-1, 0] = 0x38  # 1.0 in the last rank's padding row
        t[name] = raw.view(t[name].dtype)

    _edit(d, 3, 4, dirty)
    result = _verify(d, m.reference("tp1", 4))
    assert result.verdict == "FAIL" and any(f.startswith(f"replay: {name}: padding rows") for f in result.failures)
    assert result.localization.module is not None and name in result.localization.note, result.localization


def test_the_dspark_confidence_head_is_compared(m):
    """The confidence head's weight negated on every rank: its output was recorded nowhere, so the replay, the
    same-tp reference and the twin all passed it (an audit); now the reference file holds draft_confidence
    and every exact check compares it bit for bit."""
    d = m.faulty("confidence", 2)
    name = "mtp.2.confidence_head.proj.weight"
    for r in range(2):
        _edit(d, r, 2, lambda t: t.__setitem__(name, -t[name]))
    result = _verify(d, m.reference("tp1", 2))
    assert result.verdict == "FAIL" and any(f.startswith("replay confidence") for f in result.failures), result.failures
    result = _verify(d, m.reference("tpN", 2))
    assert result.verdict == "FAIL" and any(f.startswith("confidence:") for f in result.failures), result.failures
    assert "confidence" in result.overall and result.overall["confidence"].max_abs > 0


@pytest.mark.parametrize(("fault", "tp", "module"), TEACHER_FAULTS, ids=[f"{f}-tp{t}" for f, t, _ in TEACHER_FAULTS])
def test_teacher_fails_each_fault_in_its_module(m, fault, tp, module):
    d = m.faulty(fault, tp)
    FAULTS[fault](m, d, tp)
    result = _verify(d, m.reference("tp1", tp), replay=False)
    assert result.verdict == "FAIL" and [c.name for c in result.checks] == ["reference", "weights", "teacher"]
    teacher = [f for f in result.failures if f.startswith("teacher ")]
    assert any(f.startswith(f"teacher {module}:") for f in teacher), teacher


def _image_reference(m, name: str, text: str, pixel) -> tuple[Path, Path, Path]:
    """The vision source (made once) and a tp-1 reference file of one prompt: `text` and a 64 x 48 image, whose
    pixel (x, y) is pixel(x, y), saved as m.root/NAME.png. -> (source, reference file, image)"""
    image_mod = pytest.importorskip("PIL.Image")
    src = m.root / "src-vision"
    if not src.exists():
        write_checkpoint(src, TINY, seed=0, quantized=True, vision=True)
    img = image_mod.new("RGB", (64, 48))
    img.putdata([pixel(x, y) for y in range(48) for x in range(64)])
    image = m.root / f"{name}.png"
    img.save(image)
    prompts_file = m.root / f"{name}.jsonl"
    prompts_file.write_text(json.dumps({"text": text, "image": str(image)}) + "\n")
    ref = m.root / f"ref-{name}-tp1.safetensors"
    torch.set_num_threads(1)
    prompts = load_prompts(prompts_file, src / "tokenizer.json", TINY.vocab_size)
    reffile.save(compute_reference_ranks(src, prompts, 1, 1, None, "cpu", False, 1), ref)
    return src, ref, image


def test_vision_prompt_passes_by_replay_and_a_vision_fault_fails(m):
    pixel = lambda x, y: ((x * 7) % 256, (y * 5) % 256, (x * y) % 256)
    src, ref, image = _image_reference(m, "img", "what is in the picture", pixel)
    conv = m.shard(2, src=src, tag="vision")
    result = _verify(conv, ref)
    assert result.verdict == "PASS" and result.decisive == ["weights", "replay"], (result.failures, result.checks)
    assert result.unreached == []
    # the file records the image's sha256: another image at its path (rewritten, another machine) made this
    # correct conversion FAIL ("top1 0.000 < 1", an audit); now the file is refused, naming the image
    kept = image.read_bytes()
    image_mod = pytest.importorskip("PIL.Image")
    image_mod.open(image).rotate(180).save(image)
    with pytest.raises(VerifyInputError, match=r"img\.png': not the image this file was computed with"):
        _verify(conv, ref)
    image.write_bytes(kept)
    bad = m.root / "vision-bad-mp2"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(conv, bad)
    name = "vision.blocks.0.mlp.w1.weight"  # replicated: the same wrong value on every rank
    for rank in range(2):
        _edit(bad, rank, 2, lambda t: t.__setitem__(name, t[name] * 1.5))
    failed = _verify(bad, ref)
    # the image rows are recorded apart from the token embeddings: the tower is named, not "embed" (an audit)
    assert failed.verdict == "FAIL" and failed.localization.module == "vision", failed.localization
    assert dict(failed.localization.module_errors)["vision"] > 0, failed.localization.module_errors
    assert dict(failed.localization.module_errors)["embed"] > 0  # "embed" holds the image rows too
    # the limit, said: without an image prompt the tower never runs, so the same fault passes where no
    # manifest records the files (edited after their manifest, they fail its check), and the result names
    # what no prompt ran
    text_only = m.root / "ref-vision-text-tp1.safetensors"
    prompts = default_prompts(TINY.vocab_size, count=1)
    reffile.save(compute_reference_ranks(src, prompts, 1, 1, None, "cpu", False, 1), text_only)
    recorded = _verify(bad, text_only)
    assert recorded.verdict == "FAIL" and recorded.manifest == "differs", recorded.failures
    (bad / "manifest.json").unlink()
    digested = _verify(bad, text_only)  # the file records the sha256 of every weight its run had
    assert digested.verdict == "FAIL" and digested.weights == "differs", digested.failures
    assert any(f.startswith(f"weights: {name}: sha256 ") for f in digested.failures), digested.failures
    blind = _verify(bad, _without_weight_digests(text_only))
    assert blind.verdict == "PASS" and len(blind.unreached) == 1 and "vision tower" in blind.unreached[0]
    assert blind.to_json()["unreached"] == blind.unreached and blind.manifest == "absent"
    assert blind.weights == "not recorded"


def test_the_teacher_names_a_vision_fault_the_vision_module(m):
    """A vision MLP weight x1.5 on both ranks of tp 2, the replay off, against a tp-1 file of one image prompt
    without weight digests: the teacher check decides the FAIL. It compared the embedding's output with the
    image spans merged in and named the module `embed` (the CLI said "first diverging module: embed"); the
    README names such a fault `vision` (the image spans' rows, recorded apart), as the replay does. The
    teacher now compares those rows apart, and a correct set keeps them within the bound."""
    pixel = lambda x, y: ((x * 3) % 256, (y * 11) % 256, (x + y) % 256)
    src, ref, _ = _image_reference(m, "img-teacher", "what is this", pixel)
    undigested = _without_weight_digests(ref)
    conv = m.shard(2, src=src, tag="vision")
    clean = _verify(conv, undigested, replay=False)
    assert clean.verdict == "INCONCLUSIVE" and not clean.failures, clean.failures
    bad = m.root / "vision-teacher-bad-mp2"
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(conv, bad)
    (bad / "manifest.json").unlink()
    name = "vision.blocks.0.mlp.w1.weight"  # replicated: the same wrong value on every rank
    for rank in range(2):
        _edit(bad, rank, 2, lambda t: t.__setitem__(name, t[name] * 1.5))
    failed = _verify(bad, undigested, replay=False)
    assert failed.verdict == "FAIL" and any(f.startswith("teacher vision:") for f in failed.failures), failed.failures
    assert failed.localization.module == "vision", failed.localization


def test_the_twin_compares_every_weight_also_where_no_prompt_reaches(m):
    """A check of logits sees only the weights its prompts run: an Engram row no n-gram of the prompt hashes
    to, bumped on its rank after the conversion, fails the manifest check (its rank file's sha256); without
    a manifest (upstream convert.py writes none) it fails the weights check against the sha256 that
    reference-logits records of the weights it ran (tp-1 file: the merged rank files; tp-N file: each rank
    file), and against a file without them (older, or another implementation's) it passes the replay (the
    documented limit). With --reference SRC the twin also compares every weight's bytes with the converter's
    expected output on every rank, so the same fault fails, named with its rank; before, it passed all four."""
    p = m.probe()
    k = -(-p["engram_rows"] // 2)
    row = p["unhashed_row"]
    d = m.faulty("engram_unhashed_row", 2)
    _edit(d, row // k, 2, _bump_byte("layers.0.engram.embed.weight", (row % k, 0), by=8))
    recorded = _verify(d, m.reference("tp1", 2))
    assert recorded.verdict == "FAIL" and recorded.manifest == "differs", recorded.failures
    said = f"manifest: model{row // k}-mp2.safetensors: sha256 "
    assert any(f.startswith(said) for f in recorded.failures), recorded.failures
    (d / "manifest.json").unlink()
    for kind, tp in (("tp1", 2), ("tpN", 2)):  # the weights' sha256 that reference-logits records
        digested = _verify(d, m.reference(kind, tp))
        assert digested.verdict == "FAIL" and digested.weights == "differs", digested.failures
        where = "" if kind == "tp1" else f" on rank {row // k}"
        said = f"weights: layers.0.engram.embed.weight{where}: sha256 "
        assert (
            [f for f in digested.failures if f.startswith("weights: ")]
            == [f for f in digested.failures if f.startswith(said)]
            != []
        ), digested.failures
        assert digested.localization.note.startswith(said.removeprefix("weights: "))
    replayed = _verify(d, _without_weight_digests(m.reference("tp1", 2)))
    assert replayed.verdict == "PASS" and replayed.decisive == ["replay"], replayed.failures
    assert replayed.manifest == "absent" and replayed.weights == "not recorded"
    twin = verify(VerifyOptions(d, reference=m.src, prompts=m.prompts_file, n_decode=1, threads=1))
    assert twin.verdict == "FAIL", twin.checks
    said = f"twin weights: layers.0.engram.embed.weight on rank {row // k}: 1 of "
    assert any(f.startswith(said) for f in twin.failures), twin.failures
    assert [t.name for t in twin.localization.tensors] == ["layers.0.engram.embed.weight"]
    assert twin.localization.note.startswith("layers.0.engram.embed.weight on rank")
    clean = verify(VerifyOptions(m.shard(2), reference=m.src, prompts=m.prompts_file, n_decode=1, threads=1))
    assert clean.verdict == "PASS" and "twin" in clean.decisive and clean.manifest == "held", clean.failures


def test_a_streamed_reference_records_every_weight_so_an_unreached_fault_fails(m):
    """reference-logits --stream-layers, the only reference the real model has, recorded no weight digests: the
    Engram row no prompt hashes to (the test above), bumped after the conversion and the manifest removed,
    passed it (the tp-1 replay never reads that row). It now records the sha256 of every tp-1 weight (one
    more read of the source), the same digests the whole-model tp-1 reference records, and the fault fails
    by weights, named; the clean conversion passes; --no-weight-digests (record_weights=False) records none."""
    from dsv41_convert.verify.streamed import compute_streamed_reference

    prompts = load_prompts(m.prompts_file, None, TINY.vocab_size)
    torch.set_num_threads(1)
    ref, _ = compute_streamed_reference(m.src, prompts, 1)
    streamed = m.root / "ref-streamed.safetensors"
    reffile.save(ref, streamed)
    whole = reffile.load(m.reference("tp1", 2), TINY.vocab_size)
    assert ref.provenance["weights"] == whole.provenance["weights"]
    p = m.probe()
    k = -(-p["engram_rows"] // 2)
    row = p["unhashed_row"]
    d = m.faulty("engram_unhashed_row_streamed", 2)
    _edit(d, row // k, 2, _bump_byte("layers.0.engram.embed.weight", (row % k, 0), by=8))
    (d / "manifest.json").unlink()
    result = _verify(d, streamed)
    assert result.verdict == "FAIL" and result.weights == "differs", result.failures
    assert (
        [f for f in result.failures if f.startswith("weights: ")]
        == [f for f in result.failures if f.startswith("weights: layers.0.engram.embed.weight: sha256 ")]
        != []
    )
    assert _verify(d, _without_weight_digests(streamed)).verdict == "PASS"  # what it was before
    clean = _verify(m.shard(2), streamed)
    assert clean.verdict == "PASS" and clean.weights == "held", clean.failures
    bare, _ = compute_streamed_reference(m.src, prompts, 1, record_weights=False)
    assert "weights" not in bare.provenance


def test_the_weights_check_compares_rank_files_of_another_tp_than_the_records(m):
    """tp-4 rank files against a tp-2 reference file: the weights check said "not compared" (only a tp-1 record
    was compared across tp), so an Engram row no prompt hashes to, bumped with no manifest in the folder, was
    judged by the teacher alone, which never reads it. Now the tp-4 files are cut into the record's two ranks
    from their merge: the fault fails, named with the record's rank that holds the row ("in tp-2 rank R")."""
    p = m.probe()
    row, rows = p["unhashed_row"], p["engram_rows"]
    k4, k2 = -(-rows // 4), -(-rows // 2)
    d = m.faulty("engram_unhashed_row", 4)
    _edit(d, row // k4, 4, _bump_byte("layers.0.engram.embed.weight", (row % k4, 0), by=8))
    (d / "manifest.json").unlink()
    result = _verify(d, m.reference("tpN", 2))
    assert result.verdict == "FAIL" and result.weights == "differs", result.failures
    said = f"weights: layers.0.engram.embed.weight in tp-2 rank {row // k2}: sha256 "  # the record's rank, not ours
    weights = [f for f in result.failures if f.startswith("weights: ")]
    assert weights and all(f.startswith(said) for f in weights), weights
    assert "cut to tp 2" in result.weights_note
    clean = _verify(m.shard(4), m.reference("tpN", 2))
    assert clean.weights == "held" and not clean.failures, clean.failures


def test_cli_shows_progress_while_it_hashes_the_rank_files(m, monkeypatch, capsys):
    """The manifest and weights checks read every rank file (minutes at real scale) and showed no progress."""
    from cli_run import run_cli

    args = ("verify", str(m.shard(2)), "--reference-logits", str(m.reference("tp1", 2)), "--threads", "1")
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "weights sha256" in err and "model0-mp2.safetensors" in err, err
    code, out, err = run_cli(monkeypatch, capsys, *args, "--json")
    assert code == 0 and "weights sha256" not in err and json.loads(out)["weights"] == "held"


def test_rank_files_that_do_not_merge_fail_the_weights_check(m):
    """A padding byte of the last tp-4 rank's Engram table not the converter's fill, against a tp-2 file: the
    weights check turned the merge's refusal into "not compared" and left it to a replay that does not run
    across tp, so the teacher (which never reads padding) made it INCONCLUSIVE, and --statistical PASS (an
    audit). Rank files that do not merge are a faulty conversion: FAIL, naming the tensor."""
    rows = m.probe()["engram_rows"]
    k = -(-rows // 4)
    assert 4 * k > rows  # the last rank holds padding rows
    d = m.faulty("engram_padding_not_fill", 4)
    _edit(d, 3, 4, _bump_byte("layers.0.engram.embed.weight", (rows - 3 * k, 0)))
    (d / "manifest.json").unlink()
    for extra in ({}, {"statistical": True}):
        result = _verify(d, m.reference("tpN", 2), **extra)
        assert result.verdict == "FAIL" and result.weights == "differs", (extra, result.failures)
        said = "weights: layers.0.engram.embed.weight: padding rows"
        assert any(f.startswith(said) for f in result.failures), result.failures


def replica_low_bit_on_one_rank(m: Matrix, d: Path, tp: int) -> None:
    _edit(d, tp - 1, tp, _bump_byte("layers.1.ffn_norm.weight", (2,)))  # the low byte of a bf16: its last mantissa bits


def test_a_replica_damaged_on_one_rank_fails_where_the_teacher_sees_only_noise(m):
    """tp-4 rank files against a tp-2 reference without weight digests (the teacher check runs): one bit of
    a norm weight on the last rank only moves that rank's partial sums within the teacher's noise bound; the
    replicas check compares the copies' bytes and fails, naming the tensor and the odd rank, and localizes
    to it."""
    d = m.faulty("replica_low_bit_on_one_rank", 4)
    replica_low_bit_on_one_rank(m, d, 4)
    undigested = _without_weight_digests(m.reference("tpN", 2))
    result = _verify(d, undigested)
    assert result.verdict == "FAIL", result.checks
    odd = "replicas: layers.1.ffn_norm.weight: replicated, but rank 3's copy differs from the other 3 ranks'"
    assert odd in result.failures
    assert result.localization.module == "layers.1.ffn"  # ffn_norm feeds it
    clean = _verify(m.shard(4), undigested)  # the teacher alone is evidence: INCONCLUSIVE
    assert clean.verdict == "INCONCLUSIVE" and not clean.failures


def test_across_tp_the_teacher_localizes_not_the_noise(m):
    """A doubled block scale in layer 1's attention, tp-4 files against a tp-2 reference: the module named
    is the one the teacher check failed (the hidden states alone differ from layer 0 on, by reduction noise,
    and were reported as layers.0.ffn)."""
    d = m.faulty("fp8_block_scale_changed", 4)
    fp8_block_scale_changed(m, d, 4)
    result = _verify(d, m.reference("tpN", 2))
    assert result.verdict == "FAIL" and any(f.startswith("teacher layers.1.attn") for f in result.failures)
    assert result.localization.module == "layers.1.attn", result.localization


def test_a_fault_inside_the_teacher_bound_is_never_called_decisive(m):
    """One e8m0 scale of layer 0's expert 0 doubled on its rank, a 12-token prompt that routes to it: its
    effect on the module outputs stays inside the teacher's 2-ulp bound (an audit: 1.5 ulps), and that held
    teacher check counted as decisive (INCONCLUSIVE only because of the DSpark stages; with --statistical
    "decisive: teacher within measured noise", exit 0). Now the teacher never decides: INCONCLUSIVE, and
    with --statistical a PASS on statistical bounds, said so; the replay and the weights check fail it."""
    prompts_file = m.root / "short.jsonl"
    prompts_file.write_text(json.dumps({"input_ids": [10, 200, 300, 40, 50, 60, 70, 80, 90, 100, 110, 120]}) + "\n")
    ref = m.root / "ref-short-tp1.safetensors"
    if not ref.exists():
        prompts = load_prompts(prompts_file, m.src / "tokenizer.json", TINY.vocab_size)
        torch.set_num_threads(1)
        reffile.save(compute_reference_ranks(m.src, prompts, 1, 1, None, "cpu", False, 1), ref)
    d = m.faulty("expert_scale_doubled", 2)
    _edit(d, 0, 2, _bump_byte("layers.0.ffn.experts.0.w1.scale", (0, 0)))
    (d / "manifest.json").unlink()
    undigested = _without_weight_digests(ref)
    result = _verify(d, undigested, replay=False)
    teacher = next(c for c in result.checks if c.name == "teacher")
    assert not teacher.failures, teacher  # the limit, measured: the bound holds on this reached fault
    assert result.verdict == "INCONCLUSIVE" and result.decisive == [], result.checks
    result = _verify(d, undigested, replay=False, statistical=True)
    assert result.verdict == "PASS" and result.decisive == [] and result.to_json()["statistical"], result.checks
    assert _verify(d, undigested).verdict == "FAIL"  # the replay: the prompt reaches the fault
    digested = _verify(d, ref, replay=False)
    assert digested.verdict == "FAIL" and digested.weights == "differs", digested.failures


def test_a_weight_fault_the_logits_show_is_not_said_to_change_no_output(m):
    """head.weight's pieces exchanged between two ranks at tp 4, against the same-tp file: the logits differ
    (no hidden state does: the head follows the last one), and the note said "no prompt's output differs"."""
    d = m.faulty("head_exchanged", 4)
    _swap_between(d, 4, [("head.weight", "head.weight")], (1, 2))
    result = _verify(d, m.reference("tpN", 4))
    assert result.verdict == "FAIL" and any(f.startswith(("last:", "all:")) for f in result.failures)
    assert "no prompt's output differs" not in result.localization.note, result.localization
    assert "the logits differ, no hidden state does" in result.localization.note, result.localization


def test_an_engram_fault_is_localized_to_the_engram_module(m):
    """An Engram row the prompt hashes to, bumped on its rank: the replay's first differing output is the
    stream after Engram, and the module named is layers.0.engram (it was layers.0.attn)."""
    d = m.faulty("engram_row", 2)
    engram_row(m, d, 2)
    result = _verify(d, m.reference("tp1", 2))
    assert result.verdict == "FAIL" and result.localization.module == "layers.0.engram", result.localization


def test_a_head_fault_the_replay_shows_is_named_with_the_logits(m):
    """The low byte of head.weight bumped on rank 0, against the tp-1 file: the replay's logits differ (no
    hidden state does), and the note said "no prompt's output differs" on the replay path too (a review).
    With --statistical the FAIL is not reported as statistical."""
    d = m.faulty("head_low_byte", 2)
    _edit(d, 0, 2, _bump_byte("head.weight", (0, 0)))
    (d / "manifest.json").unlink()
    result = _verify(d, m.reference("tp1", 2), statistical=True)
    assert result.verdict == "FAIL" and any(f.startswith("replay last") for f in result.failures), result.failures
    assert "the logits differ, no hidden state does" in result.localization.note, result.localization
    assert result.to_json()["statistical"] is False


def _without_experts_as(ref: Path) -> Path:
    """A copy of reference file `ref` whose weights record has no `experts_as` (a file of before it)."""
    with safe_open(str(ref), "pt") as f:
        meta = f.metadata()
    prov = json.loads(meta["provenance"])
    del prov["weights"]["experts_as"]
    older = ref.with_name(ref.stem + "-older.safetensors")
    save_file(load_file(str(ref)), str(older), meta | {"provenance": json.dumps(prov, sort_keys=True)})
    return older


def test_experts_of_another_dtype_are_compared_with_their_conversion(m):
    """fp8 experts (the set for Hopper serving) against a file of fp4 experts: the weights check compared
    every tensor but the routed experts, so an expert no prompt reaches was compared by nothing, and against a
    file of another tp the run was INCONCLUSIVE at best. The file records the experts as fp8 too now
    (`experts_as`): held, decisive; a byte of an unreached expert's weight or scale changed FAILs, naming it."""
    result = _verify(m.shard(2, expert_dtype="fp8"), m.reference("tp1", 2))
    assert result.verdict == "PASS" and result.weights == "held" and "weights" in result.decisive
    assert "routed experts as fp8" in result.weights_note
    other = _verify(m.shard(4, expert_dtype="fp8"), m.reference("tpN", 2), replay=False)
    assert other.verdict == "PASS" and other.decisive == ["weights"], other.checks
    unreached = m.probe()["unrouted_expert"]
    for name in (f"layers.2.ffn.experts.{unreached}.w1.weight", f"layers.2.ffn.experts.{unreached}.w1.scale"):
        bad = m.root / "fault-fp8-expert"
        if bad.exists():
            shutil.rmtree(bad)
        shutil.copytree(m.shard(2, expert_dtype="fp8"), bad)
        rank = 0 if name in load_file(str(bad / "model0-mp2.safetensors")) else 1
        _edit(bad, rank, 2, _bump_byte(name, (0, 0)))
        (bad / "manifest.json").unlink()  # a fault of the conversion itself: its manifest would match it
        for ref in (m.reference("tp1", 2), m.reference("tpN", 2)):
            failed = _verify(bad, ref)
            assert failed.verdict == "FAIL" and failed.weights == "differs", (name, ref, failed.checks)
            assert any(f.startswith(f"weights: {name} (in model{rank}-mp2.safetensors)") for f in failed.failures), (
                failed.failures
            )


def test_experts_of_another_dtype_are_said_to_be_skipped_by_an_older_file(m):
    """A file without `experts_as` (written before it): the routed experts are not compared; the check says
    "partial" and is not decisive; against a file of another tp the run is INCONCLUSIVE and the advice names a
    reference of fp8 experts, not the digests the file already has."""
    result = _verify(m.shard(2, expert_dtype="fp8"), _without_experts_as(m.reference("tp1", 2)))
    assert result.verdict == "PASS" and result.weights == "partial" and "weights" not in result.decisive
    assert "routed experts not compared" in result.weights_note
    other = _verify(m.shard(4, expert_dtype="fp8"), _without_experts_as(m.reference("tpN", 2)))
    assert other.verdict == "INCONCLUSIVE" and other.weights == "partial", other.checks
    assert "a conversion with fp8 experts" in other.advice and "records their digests" not in other.advice


# --- the streamed replay (`verify --stream-layers`): the tp-1 replay one unit at a time, in place of the tp-N
# run, for a model larger than the machine: every fault the whole replay fails, the replay itself fails
STREAM_CASES = [(f, 2, "tp1") for f in FAULTS if f != "engram_padding_row_missing"]
STREAM_CASES += [("engram_padding_row_missing", 4, "tp1"), ("dim0_split_exchanged", 4, "tp1")]
STREAM_CASES += [(f, 2, "external") for f in (*ISSUE_FAULTS, "experts_swapped_across_ranks", "routed_expert_nibble")]


@pytest.mark.parametrize(("fault", "tp", "ref"), STREAM_CASES, ids=[f"{f}-tp{t}-{r}" for f, t, r in STREAM_CASES])
def test_streamed_replay_fails_every_fault(m, fault, tp, ref):
    d = m.faulty(fault, tp)
    FAULTS[fault](m, d, tp)
    result = _verify(d, m.reference(ref, tp), stream_layers=True)
    assert result.verdict == "FAIL", (result.verdict, result.checks)
    replay = next(c for c in result.checks if c.name == "replay")
    assert (replay.failures and not replay.exact) or result.load_error, replay  # the replay failed it itself
    assert "converted" not in result.seconds  # no tp-N run
    assert len(result.failures) == len(set(result.failures)), result.failures  # each said twice (a review)
    assert not (result.load_error or "").startswith("rank ")  # no rank ran it


@pytest.mark.parametrize(("tp", "ref", "want"), [(2, "tp1", ["replay", "weights"]), (4, "tp1", ["replay", "weights"]),
                                                 (2, "external", ["replay"])])  # fmt: skip
def test_streamed_replay_passes_correct_sets(m, tp, ref, want):
    result = _verify(m.shard(tp), m.reference(ref, tp), stream_layers=True)
    assert result.verdict == "PASS" and result.decisive == want, (result.failures, result.checks)
    assert "replay" in result.seconds and "converted" not in result.seconds
    result = _verify(m.shard(2, expert_dtype="fp8"), m.reference("tp1", 2), stream_layers=True)
    assert result.verdict == "PASS" and "replay" in result.decisive, result.checks
    if ref == "external":  # it records no threads: --threads says them
        return
    # --threads other than the reference's: the replay runs with the reference's, as the whole one does (it
    # ran with --threads and was not decisive: a review)
    result = verify(VerifyOptions(m.shard(tp), reference_logits=m.reference(ref, tp), threads=2, stream_layers=True))
    assert result.verdict == "PASS" and result.decisive == want, (result.failures, result.checks)


def test_streamed_replay_equals_the_whole_replay_and_holds_one_unit(m, monkeypatch):
    """The streamed replay's every output equals the whole merged model's (verify.replay) bit for bit, and
    no request to the rank files asks for more than one unit's tensors."""
    from stream_testing import assert_bit_identical

    from dsv41_convert.convert.unshard import RankFiles
    from dsv41_convert.verify import rank_weights
    from dsv41_convert.verify.replay import replay_runs
    from dsv41_convert.verify.streamed import replay_streamed

    ref = reffile.load(m.reference("tp1", 4), 128)
    torch.set_num_threads(1)
    asked: list[int] = []
    real = rank_weights.unshard_tensors
    monkeypatch.setattr(
        rank_weights, "unshard_tensors", lambda ranks, names: asked.append(len(names)) or real(ranks, names)
    )
    with RankFiles(m.shard(4), 4) as ranks:
        streamed = replay_streamed(ranks, ref, "cpu")
        whole = replay_runs(ranks, ref, "cpu")
        every = len(ranks.names())
    assert_bit_identical(streamed, whole)
    assert asked and max(asked) < every / TINY.n_layers, (max(asked), every)


def test_streamed_replay_refuses_what_it_cannot_decide(m, monkeypatch, capsys):
    from cli_run import run_cli

    with pytest.raises(VerifyInputError, match=r"a tp-2 reference; --stream-layers replays the rank files at tp 1"):
        _verify(m.shard(2), m.reference("tpN", 2), stream_layers=True)
    with pytest.raises(VerifyInputError, match="drop --no-replay"):
        _verify(m.shard(2), m.reference("tp1", 2), stream_layers=True, replay=False)
    with pytest.raises(VerifyInputError, match="--stream-layers goes with --reference-logits FILE"):
        verify(VerifyOptions(m.shard(2), reference=m.src, stream_layers=True))
    from dsv41_convert.errors import ConfigError

    with monkeypatch.context() as env:  # a WORLD_SIZE left alone in the environment: no torchrun launch
        env.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match="WORLD_SIZE=2 is set, RANK is not"):
            _verify(m.shard(2), m.reference("tp1", 2), stream_layers=True)
    args = ("verify", str(m.shard(2)), "--reference-logits", str(m.reference("tp1", 2)), "--stream-layers")
    code, out, err = run_cli(monkeypatch, capsys, *args, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["decisive"] == ["replay", "weights"] and "replay" in doc["seconds"], err


def test_streamed_replay_says_it_does_not_use_threads_the_reference_did_not_run(m, monkeypatch, capsys):
    """--threads beside --stream-layers: the replay, the only run, runs at the threads the file records (bit for
    bit only so), and said nothing of the count given (a helper's hunt: `--threads 2` against a 1-thread file
    ran 1 thread without a word). Now a warning says so before the run, with --json too; the count the file
    records, or a file that records none (the external one: --threads says them), is used and not warned of."""
    from cli_run import run_cli

    args = ("verify", str(m.shard(2)), "--reference-logits", str(m.reference("tp1", 2)), "--stream-layers", "--json")
    code, out, err = run_cli(monkeypatch, capsys, *args, "--threads", "2")
    assert code == 0 and json.loads(out)["decisive"] == ["replay", "weights"], err
    assert "warning: --threads 2: not used: --stream-layers replays the rank files at the 1 CPU thread" in err, err
    code, out, err = run_cli(monkeypatch, capsys, *args, "--threads", "1")
    assert code == 0 and "warning" not in err, err
    said: list[str] = []
    result = verify(
        VerifyOptions(m.shard(2), reference_logits=m.reference("external", 2), threads=1, stream_layers=True),
        warn=said.append,
    )
    assert result.verdict == "PASS" and not said, (said, result.checks)


def test_bounds_given_to_an_exact_run_are_said_not_to_apply(m, monkeypatch, capsys):
    """--atol, --max-kl and the other statistical bounds judge a run that cannot be exact; against a file of this
    tp, device and threads the run is bit for bit, and they were dropped without a word (a helper's hunt:
    `--atol 0.5 --max-kl 2`, mode exact, nothing said). Now a warning names them before the run, with --json too;
    where they apply (a tp-1 file against tp-2 ranks) they set the bounds and nothing is said."""
    from cli_run import run_cli

    args = ("verify", str(m.shard(2)), "--reference-logits", str(m.reference("tpN", 2)), "--threads", "1", "--json")
    code, out, err = run_cli(monkeypatch, capsys, *args, "--atol", "0.5", "--max-kl", "2")
    doc = json.loads(out)
    assert code == 0 and doc["mode"] == "exact" and doc["thresholds"]["bounds"]["last"]["atol"] == 0, err
    assert "warning: --atol 0.5, --max-kl 2: not applied: this run is exact" in err, err
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "warning" not in err, err
    said: list[str] = []
    ref = m.reference("tp1", 2)
    result = verify(
        VerifyOptions(m.shard(2), reference_logits=ref, threads=1, overrides={"max_kl": 2.5}), warn=said.append
    )
    assert result.thresholds.mode.endswith("+overrides") and result.thresholds.bounds["last"].max_kl == 2.5
    assert not said, said


def test_streamed_replay_judges_what_no_prompt_reads_as_the_whole_load_does(m):
    """The streamed run reads only what the prompts reach: a tensor the model lacks, or an expert no prompt
    routes to stored with another shape, was never bound, and the weights check then blamed the FILE's
    record (exit 2). Every merged tensor is now checked against the model built on the meta device first:
    the set fails, naming the tensor."""
    d = m.faulty("extra_tensor", 2)
    _edit(d, 0, 2, lambda t: t.__setitem__("layers.2.attn.wo_a.scale", torch.ones(2, 2)))
    _edit(d, 1, 2, lambda t: t.__setitem__("layers.2.attn.wo_a.scale", torch.ones(2, 2)))
    result = _verify(d, m.reference("tp1", 2), stream_layers=True)
    assert result.verdict == "FAIL" and "layers.2.attn.wo_a.scale" in result.load_error, result.load_error
    assert "not in the model" in result.load_error and result.weights == "not compared"
    expert = m.probe()["unrouted_expert"]
    d = m.faulty("unrouted_expert_shape", 2)
    name = f"layers.2.ffn.experts.{expert}.w1.scale"
    _edit(d, expert // (TINY.n_routed_experts // 2), 2, lambda t: t.__setitem__(name, t[name][:-1].contiguous()))
    result = _verify(d, m.reference("tp1", 2), stream_layers=True)
    assert result.verdict == "FAIL" and name in result.load_error, result.load_error


def test_verify_under_torchrun_against_another_tp_ends(m):
    """torchrun verify against a file of another tp hung (an audit): rank 1 ended with the first launch and
    rank 0 waited alone in the teacher check's second one. Under torchrun the teacher does not run; the
    weights check decides, as every process's document says, and the stream-layers replay is refused; each process
    says why it ended (CI: one stopped by torchrun while it said the same refusal ended with neither)."""
    import subprocess
    import sys

    conv, ref = m.shard(2), m.reference("tpN", 4)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29519",
              "-m", "dsv41_convert.cli", "verify", str(conv), "--reference-logits", str(ref), "--threads", "1",
              "--json"]  # fmt: skip
    res = subprocess.run(launch, capture_output=True, text=True, timeout=600)
    documents = [json.loads(line) for line in res.stdout.splitlines()]
    assert res.returncode == 0 and [d["rank"] for d in documents] == [0], res.stderr[-2000:]
    assert documents[0]["verdict"] == "PASS" and documents[0]["decisive"] == ["weights"], documents
    assert documents[0]["exit_code"] == 0 and "teacher: not run under torchrun" not in res.stderr  # --json: quiet
    res = subprocess.run([*launch, "--stream-layers"], capture_output=True, text=True, timeout=600)
    documents = [json.loads(line) for line in res.stdout.splitlines()]
    assert res.returncode != 0 and sorted(d["rank"] for d in documents) == [0, 1], res.stderr[-2000:]
    refused = [d["rank"] for d in documents if d["exit_code"] == 2 and "runs in one process" in d["error"]]
    # the first to refuse ends the launch: torchrun stops the other (SIGTERM) unless it has refused too (CI)
    stopped = [d["rank"] for d in documents if d["exit_code"] == 143 and "terminated (SIGTERM)" in d["error"]]
    assert refused and sorted(refused + stopped) == [0, 1], documents
    launch[launch.index("verify") :] = [
        "reference-logits",
        str(m.src),
        str(m.root / "no.safetensors"),
        "--stream-layers",
    ]
    res = subprocess.run(launch, capture_output=True, text=True, timeout=600)
    assert res.returncode != 0 and "--stream-layers runs in one process: run it without torchrun" in res.stderr
    assert not (m.root / "no.safetensors").exists()


def test_another_tps_rank_files_beside_the_picked_set_are_not_its_fault(m, tmp_path):
    """verify --tp 2 of a folder holding tp-4 rank files too (without --tp it asks for one) FAILed the correct
    tp-2 set on the manifest check, "model0-mp4.safetensors: in the folder but not in manifest.json" (an
    audit): the picked set is checked against its manifest, the other set's files are not its fault, and a
    manifest of the other set is not checked against this one."""
    mixed = tmp_path / "mixed"
    shutil.copytree(m.shard(2), mixed)
    for path in m.shard(4).glob("model*-mp4.safetensors"):
        shutil.copy(path, mixed / path.name)
    ref = m.reference("tp1", 2)
    with pytest.raises(VerifyInputError, match=r"rank files for tp \[2, 4\]; pass --tp to pick one"):
        _verify(mixed, ref)
    result = _verify(mixed, ref, tp=2)
    assert result.verdict == "PASS" and result.manifest == "held", result.failures
    other = tmp_path / "other"
    shutil.copytree(m.shard(4), other)
    for path in m.shard(2).glob("model*-mp2.safetensors"):
        shutil.copy(path, other / path.name)
    result = _verify(other, ref, tp=2)
    assert result.verdict == "PASS" and result.manifest == "another set", result.failures


def _recorded_as(ref: Path, conv: Path, tp: int, name: str, out: Path) -> Path:
    """A copy of our tp-`tp` reference file whose weights record gives `name` the sha256 it has in `conv`'s
    rank files: a record edited to a faulty set's bytes."""
    with safe_open(str(ref), "pt") as f:
        meta = f.metadata()
    prov = json.loads(meta["provenance"])
    for r, digests in enumerate(prov["weights"]["ranks"]):
        digests[name] = tensor_sha256(load_file(str(conv / f"model{r}-mp{tp}.safetensors"))[name])
    meta["provenance"] = json.dumps(prov, sort_keys=True)
    save_file(load_file(str(ref)), str(out), meta)
    return out


def test_a_replay_off_where_every_weight_held_fails_saying_so_and_a_forged_record_fails(m, tmp_path):
    """The replay of tp-2 files against a tp-1 file whose logits are an ulp off (as other kernels give them):
    FAIL, the replay saying that every tensor held against the record (so: other arithmetic, or a record that
    is not the weights run). A record edited to a faulty set's digests (a norm weight one ulp up on both
    ranks) FAILs by the exact check (a first version passed it on the loose bounds: a review)."""

    ulp = damaged(m.reference("tp1", 2), tmp_path / "tp1-ulp.safetensors", _off_by_an_ulp)
    result = _verify(m.shard(2), ulp)
    assert result.verdict == "FAIL" and result.weights == "held", result.failures
    replay = next(c for c in result.checks if c.name == "replay")
    assert replay.failures and "every tensor is the bytes the reference's weights record names" in replay.note

    name = "layers.0.attn_norm.weight"
    forged = m.faulty("norm-bit", 2)
    (forged / "manifest.json").unlink()  # a manifest would say the files changed since

    def ulp_up(t):  # every element one bf16 ulp up
        t[name] = (t[name].view(torch.int16) + 1).view(torch.bfloat16)

    for r in range(2):
        _edit(forged, r, 2, ulp_up)
    ref = _recorded_as(m.reference("tpN", 2), forged, 2, name, tmp_path / "forged.safetensors")
    for stream in (False, True):
        ref_file = (
            ref if not stream else _recorded_as(m.reference("tp1", 2), forged, 2, name, tmp_path / "f1.safetensors")
        )
        result = _verify(forged, ref_file, stream_layers=stream)
        assert result.weights == "held" and result.verdict == "FAIL", result.checks


@pytest.mark.parametrize("given", [None, 2])
def test_a_torchrun_count_other_than_the_rank_files_tp_names_where_the_tp_comes_from(m, monkeypatch, given):
    """torchrun of 4 processes over a folder of tp-2 rank files, no --tp given: the refusal said "torchrun started
    4 ranks but --tp is 2", an option the user never passed (a helper's hunt), and came inside the launch, after
    the reference (with --reference SRC: the whole source transformed and run first). Now it names the rank files
    the 2 comes from, before the reference; with --tp given, the option as before."""
    import re

    from dsv41_convert.verify import run as run_module

    conv = m.shard(2)  # before the launch's environment: a share of a torchrun launch writes its own ranks only
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(run_module, "compute_reference", lambda *a, **k: pytest.fail("the reference ran first"))
    said = (
        rf"^torchrun started 4 ranks but {re.escape(str(conv))} holds the rank files of tp 2 "
        r"\(model\*-mp2\.safetensors; no --tp given\): launch torchrun with 2 processes$"
        if given is None
        else r"^torchrun started 4 ranks but --tp is 2; they must be equal$"
    )
    with pytest.raises(VerifyInputError, match=said):
        verify(VerifyOptions(conv, reference=m.src, threads=1, tp=given))


def test_rank_timeout_reaches_every_launch_and_is_bounded(m, monkeypatch, capsys):
    """A hung rank held verify (and reference-logits) the group's full 10 minutes, with nothing a user could
    set to shorten it (a helper's hunt): --rank-timeout SECONDS is the group's timeout of every launch of the
    run, 1 to 86400 (a day); without it, launch's default (None: TIMEOUT)."""
    from cli_run import run_cli

    from dsv41_convert.verify import launch as launch_module

    given: list[int | None] = []

    def launch(target, payload, tp, device, threads=None, progress=None, timeout_s=None):
        given.append(timeout_s)
        raise VerifyInputError("stopped here")

    conv, ref = m.shard(2), m.reference("tp1", 2)
    monkeypatch.setattr(launch_module, "launch", launch)
    monkeypatch.setattr("dsv41_convert.verify.reference.launch", launch)
    for extra, want in (([], None), (["--rank-timeout", "3"], 3)):
        given.clear()
        code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref), *extra)
        assert (code, given) == (2, [want]) and "stopped here" in err, err
        out = m.root / "never.safetensors"
        code, _, err = run_cli(monkeypatch, capsys, "reference-logits", str(m.src), str(out), "--tp", "2", *extra)
        assert (code, given) == (2, [want, want]) and "stopped here" in err, err
    for bad in ("0", "86401", "1.5"):
        code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(ref),
                               "--rank-timeout", bad)  # fmt: skip
        assert code == 2 and "--rank-timeout" in err and "expected a number >= 1 and <= 86400" in err, err


def test_rank_timeout_where_no_ranks_are_launched_is_refused(m, monkeypatch, capsys):
    """--rank-timeout was ignored, silently, where no ranks are launched (a helper's hunt): verify and
    reference-logits at tp 1 (the model runs in this process) and with --stream-layers (every unit runs here).
    Each is a usage error now, like --tp with --stream-layers, said before anything runs; without the option
    the same commands reach their run."""
    from cli_run import run_cli

    from dsv41_convert.verify import launch as launch_module

    def runs(*args, **kwargs):
        raise VerifyInputError("stopped here")

    conv1, conv2, ref = m.shard(1), m.shard(2), m.reference("tp1", 1)
    out = str(m.root / "never.safetensors")
    monkeypatch.setattr(launch_module, "launch", runs)
    monkeypatch.setattr("dsv41_convert.verify.reference.launch", runs)
    monkeypatch.setattr("dsv41_convert.verify.run._replayed_streamed", runs)
    monkeypatch.setattr("dsv41_convert.verify.streamed.compute_streamed_reference", runs)
    at_tp1 = r"--rank-timeout: at tp 1 \({}\) this process runs the model alone and launches no ranks"
    streamed = r"--rank-timeout: --stream-layers runs every unit in this one process and launches no ranks"
    for args, said in (
        (
            ["verify", str(conv1), "--reference-logits", str(ref)],
            at_tp1.format(re.escape(f"{conv1} holds the rank files of tp 1")),
        ),
        (["verify", str(conv1), "--reference-logits", str(ref), "--tp", "1"], at_tp1.format("--tp 1")),
        (["verify", str(conv2), "--reference-logits", str(ref), "--stream-layers"], streamed),
        (["reference-logits", str(m.src), out], at_tp1.format("--tp 1, the default")),
        (["reference-logits", str(m.src), out, "--tp", "1"], at_tp1.format("--tp 1")),
        (["reference-logits", str(m.src), out, "--stream-layers"], streamed),
    ):
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 2 and "stopped here" in err, err  # the run is reached without the option
        code, _, err = run_cli(monkeypatch, capsys, *args, "--rank-timeout", "30")
        assert code == 2 and "stopped here" not in err and re.search(said, err), err
