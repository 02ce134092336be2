"""The mutation catalogue (tools/mutation) stays honest as the code changes, and its runner judges pytest's exits."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "mutation"


def _module(name):
    spec = importlib.util.spec_from_file_location(f"mutation_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


catalogue = _module("catalogue")
run = _module("run")


def test_every_mutant_is_unique_and_its_old_text_occurs_once_in_its_file():
    mutants = catalogue.load()
    assert len(mutants) > 300
    assert catalogue.problems(mutants, ROOT) == []


def test_equivalent_mutants_say_why_and_only_run_when_asked():
    mutants = catalogue.load()
    equivalent = [m for m in mutants if m.equivalent]
    assert equivalent and all(m.equivalent.strip() for m in equivalent)
    assert not any(m.equivalent for m in run.select(mutants, [], [], equivalent=False))
    assert len(run.select(mutants, [], [], equivalent=True)) == len(mutants)
    picked = run.select(mutants, ["model"], ["*.A1*"], equivalent=False)
    assert {m.id for m in picked} == {"model.A1", "model.A10", "model.A11"}


def test_pytest_exits_are_judged_killed_survived_or_error_with_the_reason():
    plain = catalogue.Mutant("quant.X", "f.py", "a", "b", "d", ("t.py",))
    breaks_import = catalogue.Mutant("quant.Y", "f.py", "a", "b", "d", ("t.py",), import_fails=True)
    failed = "FAILED tests/unit/t.py::test_a - assert 1 == 2\n1 failed in 0.1s"
    collect = "ERROR tests/unit/t.py\n!!! Interrupted: 1 error during collection !!!"
    assert run.judge(plain, 1, failed, 9) == ("killed", "tests/unit/t.py::test_a")
    assert run.judge(plain, 0, "1 passed", 9) == ("survived", "")
    assert run.judge(plain, None, "", 9) == ("error", "timeout after 9 s")
    assert run.judge(plain, 2, collect, 9)[0] == "error"
    assert run.judge(breaks_import, 2, collect, 9)[0] == "killed"
    escapes = catalogue.Mutant("cli.Z", "f.py", "a", "b", "d", ("t.py",), interrupt_escapes=True)
    aborted = "!!! KeyboardInterrupt !!!\nno tests ran in 0.2s"
    assert run.judge(plain, 2, aborted, 9)[0] == "error"
    assert run.judge(escapes, 2, aborted, 9)[0] == "killed"
    assert run.judge(plain, 5, "no tests ran", 9) == ("error", "pytest exit 5 (no tests collected): no tests ran")


def test_the_readme_counts_the_catalogue_as_it_is():
    """README states how many faults the runner plants by default and how many are catalogued; both go stale
    with every audit (it said 375 while the catalogue held 819 to run)."""
    import re

    mutants = catalogue.load()
    text = " ".join((ROOT / "README.md").read_text().split())
    said = re.search(r"plants each of the (\d+) catalogued faults it runs by default .*?; (\d+) in all", text)
    assert said, "README: the mutation paragraph's counts are gone"
    runs = len(run.select(mutants, [], [], equivalent=False))
    assert (int(said[1]), int(said[2])) == (runs, len(mutants))


def test_list_json_prints_one_document_of_the_selected_mutants(capsys):
    """`run.py --list --json` printed the text listing, which no pipeline can parse."""
    import json

    assert run.main(["--list", "--json", "--id", "cli.counted-*"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(m["id"] for m in doc["mutants"]) == ["cli.counted-always-plural", "cli.counted-verb-singular"]
    assert all(m["file"] == "dsv41_convert/numbers.py" and m["tests"] for m in doc["mutants"]) and "skipped" in doc
