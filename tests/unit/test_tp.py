"""Which tp the model can run (convert/tp.py), and that plan, shard and verify refuse any other before a byte moves.

Faults planted: the published layout at tp 16 (o_groups 8 cut in half), a tiny model with o_groups 2 at
tp 4, and each requirement broken on its own by one config key (heads, output groups, their 32-blocks,
indexer heads and blocks, vocab, routed experts of the backbone and of the DSpark stages).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import run_cli
from tiny_ckpt import REAL_CONFIG, make_tiny, tiny_config

from dsv41_convert.config import ModelArgs, load_model_args
from dsv41_convert.convert.plan import build_plan
from dsv41_convert.convert.tp import check_tp, runnable_tps, tp_problems
from dsv41_convert.errors import PlanError


def tiny_args(**text) -> ModelArgs:
    cfg = tiny_config()
    cfg["text_config"].update(text)
    return ModelArgs.from_hf_dict(cfg)


def config_only(folder: Path, cfg: dict) -> Path:
    """A source folder holding config.json and nothing else: a plan must fail before it looks for shards."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_published_layout_runs_at_1_2_4_8():
    assert runnable_tps(load_model_args(REAL_CONFIG)) == [1, 2, 4, 8]


def test_published_layout_at_tp_16_names_o_groups(tmp_path):
    src = config_only(tmp_path / "v41", json.loads(REAL_CONFIG.read_text()))
    with pytest.raises(PlanError) as info:
        build_plan(src, 16)
    msg = str(info.value)
    assert "cannot run at tp 16" in msg and "it can at tp 1, 2, 4, 8:" in msg
    assert "o_groups = 8: wo_a output groups per rank; 8 / 16 is not whole; works at tp 1, 2, 4, 8" in msg
    assert len(tp_problems(load_model_args(REAL_CONFIG), 16)) == 1  # heads, vocab, experts all divide by 16


@pytest.mark.parametrize("command", ["plan", "shard"])
def test_cli_refuses_tp_16_of_the_published_layout(tmp_path, monkeypatch, capsys, command):
    src = config_only(tmp_path / "v41", json.loads(REAL_CONFIG.read_text()))
    out = tmp_path / "out"
    args = [command, str(src), *([str(out)] if command == "shard" else []), "--tp", "16"]
    code, stdout, err = run_cli(monkeypatch, capsys, *args)
    assert code == 2 and stdout == ""
    assert "error:" in err and "cannot run at tp 16" in err and "o_groups = 8" in err and "Traceback" not in err
    assert not out.exists()


def test_tiny_o_groups_2_at_tp_4_refused_before_any_write(tmp_path, monkeypatch, capsys):
    src = make_tiny(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["o_groups"] = 2
    (src / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "mp4"
    code, _, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "4")
    assert code == 2
    assert "o_groups = 2: wo_a output groups per rank; 2 / 4 is not whole; works at tp 1, 2" in err
    assert "it can at tp 1, 2:" in err
    assert not out.exists()


# each: config keys changed, tp, the one requirement that breaks (every other holds at that tp)
PLANTED = {
    "n_heads": ({"num_attention_heads": 3, "head_dim": 64}, 2, "n_heads (text_config.num_attention_heads) = 3:"),
    "o_groups": ({"o_groups": 2, "o_lora_rank": 128}, 4, "o_groups = 2:"),
    "o_groups x o_lora_rank": ({"o_lora_rank": 16}, 8, "o_groups x o_lora_rank = 128:"),
    "n_heads x head_dim": ({"head_dim": 16, "qk_rope_head_dim": 8}, 8, "x head_dim = 128:"),
    "index_n_heads": ({"index_n_heads": 3, "index_head_dim": 64}, 2, "index_n_heads = 3:"),
    "index_n_heads x index_head_dim": ({"index_head_dim": 16}, 8, "index_n_heads x index_head_dim = 128:"),
    "vocab_size": ({"vocab_size": 258}, 4, "vocab_size = 258: embed and head rows per rank, DSpark markov_head"),
    "n_routed_experts": ({"n_routed_experts": 12}, 8, "n_routed_experts = 12: routed experts per rank, backbone"),
    "dspark_n_routed_experts": ({"dspark_n_routed_experts": 12}, 8, "dspark_n_routed_experts = 12:"),
}


@pytest.mark.parametrize("key", sorted(PLANTED))
def test_each_requirement_planted_on_its_own(key):
    text, tp, line = PLANTED[key]
    assert tp_problems(tiny_args(), tp) == []  # the unchanged tiny model runs at this tp
    problems = tp_problems(tiny_args(**text), tp)
    assert len(problems) == 1, problems
    assert line in problems[0] and "works at tp 1" in problems[0]


def test_every_failure_reported_at_once():
    with pytest.raises(PlanError) as info:
        check_tp(tiny_args(), 3, "cfg")
    lines = str(info.value).splitlines()[1:]
    keys = ("n_heads", "o_groups", "index_n_heads", "vocab_size", "n_routed_experts", "dspark_n_routed_experts")
    for key in keys:
        assert any(line.strip().startswith(key) for line in lines), key


def test_block_rules_spare_tp_1():
    # a 16-row wq_b cannot be cut into 32-row blocks, but at tp 1 nothing is cut
    args = tiny_args(head_dim=16, qk_rope_head_dim=8)
    assert tp_problems(args, 1) == [] and 1 in runnable_tps(args)


def test_verify_refuses_a_folder_written_for_a_tp_the_model_cannot_run(tmp_path, monkeypatch, capsys):
    """Rank files from elsewhere (another converter, an edited config): exit 2 before a rank starts."""
    conv = tmp_path / "mp4"
    conv.mkdir()
    args = tiny_args(o_groups=2)
    (conv / "config.json").write_text(json.dumps(args.to_inference_dict()))
    for r in range(4):
        (conv / f"model{r}-mp4.safetensors").write_bytes(b"")
    code, _, err = run_cli(monkeypatch, capsys, "verify", str(conv), "--reference-logits", str(tmp_path / "ref"))
    assert code == 2
    assert "cannot run at tp 4" in err and "o_groups = 2" in err and "Traceback" not in err
    shutil.rmtree(conv)


def test_the_tps_a_large_typo_allows_are_listed_at_once():
    """A tp that breaks n_routed_experts 10**8 (a typo of 384) is said with the tp values that would work: they
    were found by trying every int up to the value, 11 s here (10**9: ~2 min, 10**12: hours) before plan said
    anything; the divisors come in pairs up to the square root (the same list, checked against the loop on the
    small values)."""
    from dsv41_convert.convert.tp import TpRequirement

    for value, unit in ((384, 1), (129280, 1), (2048, 32), (1, 1), (97, 1), (8192, 32)):
        req = TpRequirement(("n_routed_experts",), value, unit, "")
        assert req.working_tps() == [d for d in range(1, value + 1) if req.holds(d)]
    args = tiny_args(n_routed_experts=10**12)
    (line,) = [p for p in tp_problems(args, 3) if p.startswith("n_routed_experts")]
    assert "works at tp 1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, ... (169 values)" in line


def _tried_one_by_one_at_most(monkeypatch, most: int) -> None:
    """tp.py's `range` refuses a span of more than `most` ints: a divisor search that tries ints one by one."""
    from dsv41_convert.convert import tp as tp_module

    def bounded(*args):
        span = range(*args)
        assert len(span) <= most, f"{len(span)} ints tried one by one"
        return span

    monkeypatch.setattr(tp_module, "range", bounded, raising=False)


# every value the tps divide, 2**40 each: the largest tp the model runs is 2**40
BIG = ("num_attention_heads", "o_groups", "head_dim", "vocab_size", "n_routed_experts", "index_n_heads")
BIG += ("dspark_n_routed_experts",)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (  # a square root of 10**9 ints tried one by one: 55 s at plan --tp 3
            {"vocab_size": 10**18},
            "vocab_size = 1000000000000000000: embed and head rows per rank, DSpark markov_head embed and head; "
            "1000000000000000000 / 3 is not whole; works at tp 1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, ... "
            "(361 values)",
        ),
        (  # a prime near 2**63: its only divisors are found without trying 3 * 10**9 ints
            {"n_routed_experts": 2**63 - 25},
            "n_routed_experts = 9223372036854775783: routed experts per rank, backbone; 9223372036854775783 / 3 is "
            "not whole; works at tp 1, 9223372036854775783",
        ),
        (  # a product of two values near 2**40 (2**80): hours; every per-rank share a power of two
            dict.fromkeys(BIG, 2**40),
            "x head_dim = 1208925819614629174706176: wq_b rows per rank, in whole 32-row scale blocks; "
            "1208925819614629174706176 / 3 = 4.02975e+23 is not a multiple of 32; works at tp 1, 2, 4, 8, 16, 32, "
            "64, 128, 256, 512, 1024, 2048, ... (76 values)",
        ),
    ],
    ids=["vocab 10**18", "prime experts", "heads x head_dim 2**80"],
)
def test_a_tp_refused_of_config_values_near_2_63_lists_the_working_tps_at_once(monkeypatch, text, line):
    """The tps each value allows came from trying every int up to its square root, and those the model can run
    from every int up to the values' gcd: vocab_size 10**18 at --tp 3 took 55 s before plan said a word, heads
    of 2**40 never ended. Now from the prime factors: no span of more than 10**5 ints is tried."""
    args = tiny_args(**text)
    _tried_one_by_one_at_most(monkeypatch, 10**5)
    with pytest.raises(PlanError) as info:
        check_tp(args, 3, "config.json")
    assert line in str(info.value)
    if "o_groups" in text:
        assert runnable_tps(args)[-3:] == [2**38, 2**39, 2**40]


def test_the_tps_from_prime_factors_are_those_tried_one_by_one(monkeypatch):
    """The factored path (every value, LOOPED 0) gives what trying each int gives, for values with and without
    the 32-block unit, square and prime values, and products of two fields."""
    from dsv41_convert.convert import tp as tp_module
    from dsv41_convert.convert.tp import TpRequirement

    cases = [(v, u, ()) for v in (1, 2, 97, 384, 1024, 2048, 8192, 129280, 3 * 2**7 * 7**2) for u in (1, 32)]
    cases += [(64 * 48, 32, (64, 48)), (12 * 160, 32, (12, 160)), (9 * 35, 1, (9, 35)), (8 * 3, 32, (8, 3))]
    looped = {}
    for value, unit, parts in cases:
        req = TpRequirement(("n_heads", "head_dim"), value, unit, "", parts)
        looped[value, unit] = ([d for d in range(1, value + 1) if req.holds(d)], req.problem(value + 1))
    monkeypatch.setattr(tp_module, "LOOPED", 0)
    for value, unit, parts in cases:
        req = TpRequirement(("n_heads", "head_dim"), value, unit, "", parts)
        assert (req.working_tps(), req.problem(value + 1)) == looped[value, unit], (value, unit)
    for text in ({}, {"o_groups": 2, "o_lora_rank": 128}, {"num_attention_heads": 3, "head_dim": 64}):
        args = tiny_args(**text)
        monkeypatch.setattr(tp_module, "LOOPED", 10**5)
        want = runnable_tps(args)
        monkeypatch.setattr(tp_module, "LOOPED", 0)
        assert runnable_tps(args) == want
