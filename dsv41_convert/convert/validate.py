"""Checks made before any byte moves: the index against the files, the files against the config.

`gather_sources` reads every shard header and the index and returns the checkpoint's tensors under their
canonical names, each with its rule. `validate_sources` checks them against the layout the config
implies (key sets, dtypes, shapes, scale shapes) and against tp (split dims keep scale blocks whole; what
the model itself needs of tp is tp.py's, checked before this).
Every problem found is reported at once, each naming its file and tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dsv41_convert.config import ModelArgs
from dsv41_convert.convert.catalogue import published_layout, routed_expert_layout
from dsv41_convert.convert.rules import Op, Rule, Split, canonical_name, classify, has_scale, scale_name
from dsv41_convert.engram_tokens import load_token_map, pad_compressed_id
from dsv41_convert.errors import NOT_JSON, PlanError, first_few
from dsv41_convert.file_kinds import DANGLING, SPECIAL, special_kind
from dsv41_convert.numbers import counted
from dsv41_convert.store.index import INDEX_NAME, bad_shard_names, held_twice
from dsv41_convert.store.manifest import SIDECARS
from dsv41_convert.store.rank_names import RANK_FILE
from dsv41_convert.store.safetensors_header import read_header

UNQUANTIZED = ("BF16", "F32")  # the dtypes of an unquantized tensor of this model
OTHER_FLOATS = ("F16", "F64")  # unquantized, but no dtype of this model: refused as such
READ_WHOLE = ("config.json", INDEX_NAME, *SIDECARS)  # besides the shards

MAX_LINES = 25


def require_regular_files(src: Path) -> None:
    """PlanError naming each file of SRC a conversion reads whole (config.json, the index, the shards, the
    tokenizer files) that is a FIFO, a socket or a device: reading one blocked `plan` and `shard` until they
    were killed (an audit); and a tokenizer file that is a folder (it was said to be missing, then failed
    the copy after OUT was made); and a link at the index's or a tokenizer file's name that leads nowhere (to no
    file, or in a loop: such a name is read only where it exists, so the index's check of the files was skipped and
    the tokenizer said to be missing, exit 0: an audit), or at a shard's name (said "No such file or directory" of a
    name `ls` lists). Other folders and a broken config.json link are named where they are read."""
    src = Path(src)
    if not src.is_dir():
        return
    folders = [name for name in SIDECARS if (src / name).is_dir()]
    if folders:
        raise PlanError(f"{src}: {first_few(folders)}: a folder where the tokenizer file belongs")
    shards = sorted(p.name for p in src.iterdir() if p.name.endswith(".safetensors"))
    broken = [
        name for name in (INDEX_NAME, *SIDECARS, *shards) if (src / name).is_symlink() and not (src / name).exists()
    ]
    if broken:
        raise PlanError(f"{src}: {first_few(broken)}: {DANGLING}; put the file itself there, or remove the link")
    special = [
        p.name
        for p in sorted(src.iterdir())
        if (p.name.endswith(".safetensors") or p.name in READ_WHOLE) and special_kind(p)
    ]
    if special:
        raise PlanError(
            f"{src}: {first_few(special)}: not a regular file ({SPECIAL}); a checkpoint's "
            "files are read whole: put the file itself there, or remove it"
        )


def require_json_tokenizer_files(src: Path) -> None:
    """PlanError naming a tokenizer file of SRC that is not the JSON object it must be (tokenizer.json with its
    `model`): shard and export copied a cut or emptied one unchanged, exit 0 and a manifest, into an output
    that verify and inference then cannot load (an audit). The tokenizer itself is not built here."""
    for name in SIDECARS:
        path = Path(src) / name
        if not path.is_file():
            continue  # missing: warned where it is copied; a folder or FIFO: require_regular_files
        try:
            data = json.loads(path.read_bytes())
        except (*NOT_JSON, OSError) as exc:
            raise PlanError(f"{path}: not a readable {name} ({exc}); put the checkpoint's own back") from None
        if not isinstance(data, dict) or (name == "tokenizer.json" and "model" not in data):
            what = "no `model` object" if isinstance(data, dict) else f"a JSON {type(data).__name__}"
            raise PlanError(f"{path}: not a readable {name} ({what}); put the checkpoint's own back")


def require_engram_tokenizer(src: Path, args: ModelArgs) -> None:
    """ConfigError where SRC's tokenizer.json is not the one its Engram layers were trained with: its compressed
    token map (engram_tokens.py) must have engram_compressed_vocab_size ids and hold the pad id. Shard and export
    copied another one (a fine-tune that added a token) beside the weights, exit 0, and only verify or inference
    refused the result (an audit). A source without one is warned of where the files are copied."""
    path = Path(src) / "tokenizer.json"
    if not args.engram_layer_ids or not path.is_file():
        return
    pad_compressed_id(load_token_map(path, args.engram_compressed_vocab_size), args.engram_pad_id, str(path))


@dataclass(slots=True)  # not frozen: 96k of them in the real checkpoint, built twice as fast; never mutated
class Source:
    """One checkpoint tensor: where it is, what it is, and its rule."""

    file: str  # relative to the source folder
    name: str  # name in the file
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    rule: Rule
    expert: tuple[bool, int] | None  # (is_mtp, expert id) for routed experts


def _raise(problems: list[str], what: str) -> None:
    if not problems:
        return
    shown = problems[:MAX_LINES]
    more = f"\n  ... and {len(problems) - MAX_LINES} more" if len(problems) > MAX_LINES else ""
    raise PlanError(f"{what}: {counted(len(problems), 'problem')}\n  " + "\n  ".join(shown) + more)


def gather_sources(src: Path, weight_map: dict[str, str] | None) -> dict[str, Source]:
    """Headers of every *.safetensors in `src` (and every file the index names), checked against the index.

    -> canonical name -> Source, in name order
    """
    present = {p.name for p in src.glob("*.safetensors")}
    bad = bad_shard_names(weight_map) if weight_map is not None else []
    _raise([b.describe() for b in bad], f"{src}")  # before anything opens a file the index names
    named = set(weight_map.values()) if weight_map is not None else set()
    problems: list[str] = []
    for file in sorted(named - present):
        example = next(n for n, f in weight_map.items() if f == file)
        count = sum(1 for f in weight_map.values() if f == file)
        problems.append(
            f"{file}: missing, but the index maps {counted(count, 'tensor')} to it (e.g. {example}); download it"
        )
    if not present:
        problems.append(f"{src}: no *.safetensors files")
    _raise(problems, f"{src}")
    rank_files = sorted(n for n in present if RANK_FILE.fullmatch(n))
    if rank_files and weight_map is None:
        raise PlanError(
            f"{src}: holds rank files ({first_few(rank_files, 2)}), the "
            "output of `shard`, not a Hugging Face checkpoint: plan, shard, export and verify --reference read the "
            "published layout; give it to verify as CONVERTED, or to reference-logits with --stream-layers"
        )
    headers = [(file, read_header(src / file).tensors) for file in sorted(present)]
    # the index and the files agree in one dict comparison (96k names in the real checkpoint); only where they
    # do not, the loop below looks each name up to say which
    located: dict[str, str] = {}
    for file, tensors in headers:
        located.update(dict.fromkeys(tensors, file))
    agree = len(located) == sum(len(t) for _, t in headers) and (weight_map is None or located == weight_map)
    sources: dict[str, Source] = {}
    unknown: list[str] = []  # names the conversion rules do not take, whatever the index says
    twice = {} if agree else held_twice(headers)
    again = {(file, name): other for file, by in twice.items() for other, names in by.items() for name in names}
    for file, tensors in headers:
        for name, info in tensors.items():
            if not agree:
                if (other := again.get((file, name))) is not None:
                    problems.append(f"{file}: tensor {name} is also in {other} (duplicated)")
                    continue
                if weight_map is not None and weight_map.get(name) != file:
                    said = weight_map.get(name)
                    problems.append(
                        f"{file}: tensor {name} is not in the index"
                        if said is None
                        else f"{file}: tensor {name} is there, but the index puts it in {said}"
                    )
            canon = canonical_name(name)
            if canon in sources:
                unknown.append(f"{file}: tensor {name} renames to {canon}, which {sources[canon].file} already has")
                continue
            try:
                rule, expert = classify(canon)
            except PlanError as exc:
                unknown.append(f"{file}: {exc}")
                continue
            sources[canon] = Source(file, name, info.dtype, info.shape, info.begin, info.end - info.begin, rule, expert)
    if weight_map is not None and not agree:
        for name, file in weight_map.items():
            if name not in located and file in present:
                problems.append(f"{file}: tensor {name} is in the index but not in the file (source mid-upload?)")
    kinds = (("checkpoint files and index disagree", problems), ("tensors no conversion rule takes", unknown))
    _raise(problems + unknown, f"{src}: " + "; ".join(what for what, found in kinds if found))
    return {name: sources[name] for name in sorted(sources)}


def validate_sources(
    sources: dict[str, Source],
    args: ModelArgs,
    tp: int,
    config: Path,
    expert_dtype: str = "fp4",
    quantizes: bool | None = None,
) -> tuple[int, int]:
    """Check the config's dims against the output's blocks (require_block_dims; `quantizes`: whether the output
    quantizes the source, by default where it is unquantized), then every tensor against the config's layout
    and tp. -> (backbone experts, mtp experts)"""
    quantized = args.dtype == "fp8"
    quantizes = not quantized if quantizes is None else quantizes
    # a published-format source holds its experts and Engram rows with a scale per 32 inputs, as a quantizing output
    require_block_dims(args, config, expert_dtype, quantized or quantizes)
    _check_vision_blocks(sources, args, config)  # before any layout: _same_layout's holds every vision block too
    _check_layer_count(sources, args, config)  # the same of the backbone layers and MTP stages
    # the real checkpoint's 96k tensors match without a 96k-entry layout; only a mismatch needs the wording loops
    if not (quantized and _same_layout(sources, args)):
        if quantized:
            _require_scales(sources)
        _check_expert_count(sources, args, config)
        layout = published_layout(args)
        if not quantized:  # an unquantized source has no scales and holds experts unpacked
            layout = {
                n: ("float", (s[0], s[1] * 2) if d == "I8" else s)
                for n, (d, s) in layout.items()
                if not n.endswith(".scale")
            }
        problems: list[str] = []
        _compare_layout(sources, layout, quantized, problems)
        _raise(problems, f"{config.parent}: checkpoint does not match {config.name}")
    n_experts = _expert_counts(sources)
    _check_splits(sources, tp, quantized)
    return n_experts


def require_block_dims(args: ModelArgs, config: Path, expert_dtype: str, quantizes: bool) -> None:
    """PlanError naming config.json where the output's 32-wide scale blocks cannot tile the model: fp8 experts
    (expert_dtype "fp8") need both dims of every expert a multiple of 32 (32x32 blocks), MXFP4 experts
    quantized from an unquantized source their input dims (a per-32 scale along the input, two codes a byte),
    and Engram's per-32 rows (`quantizes`) its head dim. An fp8-fp4 export of a bf16 source with
    moe_intermediate_size 48 wrote scales [out, 2] that the published layout calls [out, 1]: a checkpoint
    that plan, shard and export then refused (an audit). A published-format source is held so too: one with
    such dims had scales of a floored width that its bf16 export failed to decode mid-write (an audit)."""
    experts = "fp8 experts' 32x32 blocks" if expert_dtype == "fp8" else "fp4 experts' scale per 32 inputs"
    need = []  # (key, value, what needs it)
    if expert_dtype == "fp8" or quantizes:
        need += [("hidden_size", args.dim, experts), ("moe_intermediate_size", args.moe_inter_dim, experts)]
    if quantizes and args.engram_layer_ids:
        need.append(("engram_head_dim", args.engram_head_dim, "Engram's fp8 rows, a scale per 32"))
    bad = [f"{key} {value} (for {what})" for key, value, what in need if value % 32]
    if bad:
        raise PlanError(
            f"{config}: not a multiple of 32: {', '.join(bad)}; the published layout has no place for such "
            "tensors, so the model cannot be held in that format"
        )


def _require_scales(sources: dict[str, Source]) -> None:
    """PlanError where config.json has a quantization_config but the checkpoint holds no scale and no fp8 or
    fp4 weight: an unquantized fine-tune beside the published config.json (a likely copy), which the layout
    checks called missing experts or every scale missing (an audit)."""
    if not sources or any(n.endswith(".scale") or s.dtype in ("F8_E4M3", "I8") for n, s in sources.items()):
        return  # no tensor at all: the layout check names what is missing
    example = next((s for s in sources.values() if s.expert is not None), next(iter(sources.values())))
    raise PlanError(
        f"config.json has a quantization_config (a published fp8/fp4 checkpoint), but the checkpoint holds no "
        f"scales and no fp8 or fp4 weights ({example.file}: {example.name} is {example.dtype}): an unquantized "
        "fine-tune beside the published config.json? give it a config.json without quantization_config (the "
        "one `export --format bf16` wrote)"
    )


def _check_expert_count(sources: dict[str, Source], args: ModelArgs, config: Path) -> None:
    """PlanError where config.json's routed experts make more tensors than the checkpoint holds in all: the
    layout of 2,000,000 experts per layer was built to list what is missing, for minutes (an audit)."""
    quantized = args.dtype == "fp8"  # an unquantized source holds no scales (counting them refused every one)
    expected = sum(
        n * sum(quantized or not t.endswith(".scale") for t, _, _ in forms)
        for _, n, forms in routed_expert_layout(args)
    )
    if expected > len(sources):
        held = sum(1 for s in sources.values() if s.expert is not None)
        raise PlanError(
            f"{config.parent}: checkpoint does not match {config.name}: its routed experts (n_routed_experts "
            f"{args.n_routed_experts}, dspark_n_routed_experts {args.dspark_n_routed_experts}) make {expected:,} "
            "tensors; the checkpoint "
            f"holds {held:,} routed-expert tensors of {len(sources):,} in all"
        )


def _check_vision_blocks(sources: dict[str, Source], args: ModelArgs, config: Path) -> None:
    """PlanError where config.json's vision tower has more blocks than the checkpoint holds tensors in all (each
    block has eight): vision_config.num_hidden_layers 1,000,000 built a layout of 8,000,000 tensors to list what
    is missing, 114 s and 4.1 GB, and 10,000,000 ran for minutes until killed (an audit)."""
    if args.vision_n_layers <= len(sources):
        return  # its layout is no larger than eight times the checkpoint's: compared and listed as usual
    held = len({n.split(".", 3)[2] for n in sources if n.startswith("vision.blocks.")})
    raise PlanError(
        f"{config.parent}: checkpoint does not match {config.name}: its vision_config.num_hidden_layers "
        f"{args.vision_n_layers:,} makes more vision blocks than the checkpoint holds tensors ({len(sources):,}); "
        f"the checkpoint holds {counted(held, 'vision block')}"
    )


def _check_layer_count(sources: dict[str, Source], args: ModelArgs, config: Path) -> None:
    """PlanError where config.json's backbone layers and MTP stages are more than the checkpoint holds tensors in
    all (each holds dozens): num_hidden_layers 1,000,000 (its compress_ratios as long) built a layout of
    60,000,000 tensors before the expert count refused it, over two minutes, as did 10,000,000 MTP stages (a
    helper's hunt)."""
    stages = args.n_mtp_layers if args.dspark_block_size else 0  # as the catalogue: no DSpark, no mtp stages
    if args.n_layers + stages <= len(sources):
        return  # its layout is no larger than a few dozen times the checkpoint's: compared and listed as usual
    held = {".".join(n.split(".", 2)[:2]) for n in sources if n.startswith(("layers.", "mtp."))}
    n_held = sum(h.startswith("layers.") for h in held)
    raise PlanError(
        f"{config.parent}: checkpoint does not match {config.name}: its text_config.num_hidden_layers "
        f"{args.n_layers:,} and num_nextn_predict_layers {args.n_mtp_layers:,} make more layers than the checkpoint "
        f"holds tensors ({len(sources):,}); the checkpoint holds {counted(n_held, 'backbone layer')} and "
        f"{counted(len(held) - n_held, 'MTP stage')}"
    )


def _same_layout(sources: dict[str, Source], args: ModelArgs) -> bool:
    """Whether the tensors are exactly published_layout(args): names, dtypes and shapes. The routed experts (94k
    of the real 96k) are looked up by the names their layer's template makes (routed_expert_layout), then
    counted, the rest compared in one dict comparison. A tied MTP embed/head (which the published checkpoint
    does not carry) is not in that layout, so it is left to _compare_layout, which checks it against the backbone's
    tensor."""
    rest = {n: (s.dtype, s.shape) for n, s in sources.items() if s.expert is None}
    if rest != published_layout(args, routed_experts=False):
        return False
    expected = 0
    for prefix, n_experts, forms in routed_expert_layout(args):
        for e in range(n_experts):
            head = prefix + str(e)
            for tail, dtype, shape in forms:
                s = sources.get(head + tail)
                if s is None or s.dtype != dtype or s.shape != shape:
                    return False
        expected += n_experts * len(forms)
    # every expected expert tensor is there; as many expert tensors as expected: no other
    return expected == sum(1 for s in sources.values() if s.expert is not None)


def _unheld_dtype(s: Source) -> str:
    return (
        f"{s.file}: tensor {s.name}: {s.dtype}, which this model's checkpoints never hold: save the fine-tune's "
        "weights as BF16 (or F32)"
    )


def _compare_layout(
    sources: dict[str, Source], layout: dict[str, tuple[str, tuple[int, ...]]], quantized: bool, problems: list[str]
) -> None:
    """Append a line to `problems` for every tensor missing, extra, or of another dtype or shape (a tied MTP
    embed/head: BF16 or F32, of a stage `layout` has, of its backbone tensor's shape [vocab, dim])."""
    for name in sorted(set(layout) - set(sources)):
        dtype, shape = layout[name]
        problems.append(f"{name}: missing from the checkpoint; config.json implies {dtype} {list(shape)}")
    for name in sorted(set(sources) - set(layout)):
        s = sources[name]
        if s.rule.op is Op.DROP:  # tied to the backbone's: shard drops it, export carries it
            _, stage, backbone, _ = name.split(".")  # mtp.K.embed.weight: a copy of embed.weight
            if s.dtype in OTHER_FLOATS:
                problems.append(_unheld_dtype(s))
            elif s.dtype not in UNQUANTIZED:
                problems.append(
                    f"{s.file}: tensor {s.name}: found {s.dtype}, expected BF16 or F32 (a tied MTP embed/head)"
                )
            if not any(n.startswith(f"mtp.{stage}.") for n in layout):
                problems.append(f"{s.file}: tensor {s.name}: a DSpark stage config.json does not have (extra)")
            elif s.shape != (shape := layout[f"{backbone}.weight"][1]):
                problems.append(
                    f"{s.file}: tensor {s.name}: found {list(s.shape)}, expected {list(shape)} (a tied MTP "
                    f"embed/head: a copy of {backbone}.weight)"
                )
            continue
        if not quantized and name.endswith(".scale"):
            problems.append(
                f"{s.file}: tensor {s.name} is a scale, but config.json has no quantization_config "
                "(an unquantized source has no scales); wrong config.json?"
            )
        else:
            problems.append(f"{s.file}: tensor {s.name} is not in the model config.json describes (extra)")
    for name in sorted(set(sources) & set(layout)):
        s, (dtype, shape) = sources[name], layout[name]
        if quantized and (s.dtype, s.shape) != (dtype, shape):
            hint = " (packed e2m1; I8 is not int8)" if dtype == "I8" else ""
            problems.append(
                f"{s.file}: tensor {s.name}: found {s.dtype} {list(s.shape)}, "
                f"expected {dtype} {list(shape)}{hint}; another revision or config?"
            )
        elif not quantized and s.dtype in OTHER_FLOATS and s.shape == shape:
            problems.append(_unheld_dtype(s))
        elif not quantized and (s.dtype not in UNQUANTIZED or s.shape != shape):
            problems.append(
                f"{s.file}: tensor {s.name}: found {s.dtype} {list(s.shape)}, expected BF16 or F32 "
                f"{list(shape)} (config.json has no quantization_config, so the source must be unquantized)"
            )


def _expert_counts(sources: dict[str, Source]) -> tuple[int, int]:
    """Routed experts per layer, from the names as upstream infers them, backbone and MTP separately."""
    counts = [0, 0]
    for s in sources.values():
        if s.expert is not None:
            counts[s.expert[0]] = max(counts[s.expert[0]], s.expert[1] + 1)
    if not counts[0]:
        raise PlanError("no routed experts (layers.L.ffn.experts.E.*) in the checkpoint")
    counts[1] = counts[1] or counts[0]
    return counts[0], counts[1]  # that tp divides them: tp.check_tp, from the config these names matched


def _check_splits(sources: dict[str, Source], tp: int, quantized: bool) -> None:
    problems: list[str] = []
    for name, s in sources.items():  # in name order (gather_sources)
        split, op = s.rule.split, s.rule.op
        if split not in (Split.DIM0, Split.DIM1) or op is Op.SCALE:
            continue
        dim = 0 if split is Split.DIM0 else 1
        size = s.shape[dim]
        if size % tp:
            problems.append(f"{s.file}: tensor {s.name}: dim {dim} = {size} is not divisible by --tp {tp}")
            continue
        if op in (Op.FP8, Op.DEQUANT_BF16) and has_scale(op):
            sc = sources.get(scale_name(name))
            if quantized and sc is None:
                problems.append(f"{s.file}: tensor {s.name} ({s.dtype}) has no scale {scale_name(name)}")
                continue
            if op is Op.DEQUANT_BF16 and not quantized:
                continue  # stays bf16, no blocks to keep whole
            grid = sc.shape if quantized else (-(-s.shape[0] // 32), -(-s.shape[1] // 32))
            block = -(-s.shape[dim] // grid[dim])
            if op is Op.DEQUANT_BF16:
                b = (s.shape[0] // grid[0], s.shape[1] // grid[1])
                if b not in ((32, 32), (128, 128)) or (grid[0] * b[0], grid[1] * b[1]) != s.shape:
                    problems.append(
                        f"{s.file}: tensor {s.name}: scale {list(grid)} over weight {list(s.shape)} is no 32x32 or "
                        "128x128 block grid"
                    )
                    continue
            if grid[dim] % tp or grid[dim] // tp != -(-(size // tp) // block):
                problems.append(
                    f"{s.file}: tensor {s.name}: split of dim {dim} ({size}) over --tp {tp} cuts its "
                    f"{block}-wide scale blocks (scale dim {grid[dim]}); choose a tp that keeps blocks whole"
                )
    _raise(problems, f"wrong tp {tp}")
