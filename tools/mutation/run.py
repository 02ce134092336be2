"""Re-run the mutation audit: plant each catalogued fault in a scratch copy and check its tests catch it.

    python tools/mutation/run.py                      # every non-equivalent mutant
    python tools/mutation/run.py --area quant --area hub
    python tools/mutation/run.py --id 'model.A*' --json > result.json
    python tools/mutation/run.py --list

The tracked files of the working tree are copied once into a temporary folder; each mutant's one text
replacement is made there, its test selection run with pytest (PYTHONPATH at the copy), and the file put back.
The working tree it is started from is only read. Before the mutants, the union of their selections is run once
on the unmutated copy (--no-baseline skips it): a selection that fails there would count every mutant killed.

Results: killed (pytest exit 1), survived (exit 0), or error with the reason (collection error, timeout, no
tests collected, ...). A mutant marked import_fails counts a collection error as killed, one marked
interrupt_escapes a session ended by a KeyboardInterrupt out of the code under test (the child runs in a session
of its own, so a Ctrl-C at the terminal does not reach it). Exit status 1 where
a non-equivalent mutant survived or ended in error, 2 where the baseline fails or the catalogue is wrong.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from catalogue import AREAS, Mutant, load, skipped

REPO = Path(__file__).resolve().parents[2]
MARKERS = "not gpu and not dist"
# pytest exit codes: 1 tests failed, 2 interrupted (collection errors too), 3 internal, 4 usage, 5 none collected
_RC = {2: "interrupted", 3: "pytest internal error", 4: "pytest usage error", 5: "no tests collected"}


@dataclass
class Result:
    """What one mutant's run came to."""

    id: str
    status: str  # killed | survived | error
    detail: str  # the first failing test, or why the run is an error
    seconds: float
    equivalent: bool


def copy_tree(src: Path, dst: Path) -> None:
    """Copy the files git tracks in `src` (as they are in the working tree) to `dst`."""
    names = subprocess.run(
        ["git", "-C", str(src), "ls-files", "-z", "--cached"], check=True, capture_output=True
    ).stdout.split(b"\0")
    for raw in names:
        if not raw:
            continue
        name = raw.decode()
        path = src / name
        if not path.exists() and not path.is_symlink():
            continue  # deleted in the working tree
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dst / name, follow_symlinks=False)


def pytest(tree: Path, scratch: Path, tests: list[str], markers: str, timeout: float) -> tuple[int | None, str]:
    """Run pytest on `tests` in `tree`; (exit code or None on timeout, output)."""
    basetemp = scratch / "basetemp"
    shutil.rmtree(basetemp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--basetemp={basetemp}"]
    if markers:
        cmd += ["-m", markers]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(
        [*cmd, *tests], cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the tests' own child processes too
        out, _ = proc.communicate()
        return None, out.decode(errors="replace")


def first_failure(out: str) -> str:
    """The first FAILED/ERROR node id of pytest's summary, else its last line."""
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    if m:
        return m.group(1)
    lines = out.strip().splitlines()
    return lines[-1][:200] if lines else ""


def judge(m: Mutant, rc: int | None, out: str, timeout: float) -> tuple[str, str]:
    """(status, detail) of one mutant's pytest run."""
    if rc is None:
        return "error", f"timeout after {timeout:.0f} s"
    if rc == 0:
        return "survived", ""
    if rc == 1:
        return "killed", first_failure(out)
    collection = rc == 2 and re.search(r"errors? during collection", out) is not None
    if collection and m.import_fails:
        return "killed", f"collection error (import fails): {first_failure(out)}"
    if collection:
        return "error", f"collection error: {first_failure(out)}"
    if rc == 2 and m.interrupt_escapes and "KeyboardInterrupt" in out:
        return "killed", f"KeyboardInterrupt escaped the test: {first_failure(out)}"
    return "error", f"pytest exit {rc} ({_RC.get(rc, 'unknown')}): {first_failure(out)}"


def run_one(m: Mutant, tree: Path, scratch: Path, markers: str, timeout: float) -> Result:
    """Plant `m` in `tree`, run its tests, put the file back."""
    path = tree / m.file
    t0 = time.monotonic()
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if (n := text.count(m.old)) != 1:
        return Result(m.id, "error", f"old text found {n} times in {m.file}", 0.0, bool(m.equivalent))
    path.write_text(text.replace(m.old, m.new), encoding="utf-8")
    try:
        rc, out = pytest(tree, scratch, list(m.tests), markers, timeout)
    finally:
        path.write_text(text, encoding="utf-8")
    status, detail = judge(m, rc, out, timeout)
    return Result(m.id, status, detail, round(time.monotonic() - t0, 1), bool(m.equivalent))


def select(mutants: list[Mutant], areas: list[str], globs: list[str], equivalent: bool) -> list[Mutant]:
    """The mutants the filters keep; equivalent ones only with `equivalent`."""
    return [
        m
        for m in mutants
        if (not areas or m.area in areas)
        and (not globs or any(fnmatch.fnmatchcase(m.id, g) for g in globs))
        and (equivalent or not m.equivalent)
    ]


def table(results: list[Result], mutants: dict[str, Mutant]) -> str:
    """A plain-text table of the results and the counts."""
    rows = [f"{'id':<32} {'result':<22} {'s':>6}  detail"]
    for r in results:
        tag = " (equivalent)" if r.equivalent else ""
        rows.append(f"{r.id:<32} {r.status + tag:<22} {r.seconds:>6.1f}  {r.detail or mutants[r.id].desc}")
    rows.append(summary_line(results))
    return "\n".join(rows)


def counts(results: list[Result]) -> dict[str, int]:
    """Counts of each status; equivalent mutants counted apart."""
    c = {"killed": 0, "survived": 0, "error": 0, "equivalent_run": 0}
    for r in results:
        if r.equivalent:
            c["equivalent_run"] += 1
        else:
            c[r.status] += 1
    return c


def summary_line(results: list[Result]) -> str:
    c = counts(results)
    return f"{len(results)} mutants: {c['killed']} killed, {c['survived']} survived, {c['error']} error" + (
        f", {c['equivalent_run']} equivalent run" if c["equivalent_run"] else ""
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--area", action="append", default=[], choices=AREAS, help="only this area (repeatable)")
    p.add_argument("--id", action="append", default=[], metavar="GLOB", help="only ids matching GLOB (repeatable)")
    p.add_argument("--list", action="store_true", help="list the selected mutants and stop")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout (the table goes to stderr)")
    p.add_argument("--include-equivalent", action="store_true", help="also run mutants the audits found equivalent")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's pytest run (default 600)")
    p.add_argument("--markers", default=MARKERS, help=f"pytest -m expression (default {MARKERS!r}; '' for none)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run of the selections on unmutated code")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (its path is printed)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mutants = select(load(), args.area, args.id, args.include_equivalent)
    if args.list and args.json:  # the listing as one document (it printed the text listing)
        doc = {"mutants": [dataclasses.asdict(m) for m in mutants], "skipped": skipped()}
        print(json.dumps(doc, indent=1))
        return 0
    if args.list:
        for m in mutants:
            eq = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
            print(f"{m.id:<32} {m.file}: {m.desc}{eq}\n{'':<33}{' '.join(m.tests)}")
        for s in skipped():
            print(f"{s['id']:<32} skipped: old text occurs {s['occurrences']} times")
        return 0
    if not mutants:
        print("no mutant selected", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="mutation-"))
    tree = scratch / "tree"
    t_start = time.monotonic()
    try:
        copy_tree(REPO, tree)
        if not args.no_baseline:
            union = list(dict.fromkeys(t for m in mutants for t in m.tests))
            print(f"baseline: {len(union)} selections on unmutated code ...", file=sys.stderr, flush=True)
            rc, out = pytest(tree, scratch, union, args.markers, args.timeout * 2)
            if rc != 0:
                print(f"baseline fails (pytest exit {rc}): {first_failure(out)}\n{out[-3000:]}", file=sys.stderr)
                return 2
            print(f"baseline passes ({time.monotonic() - t_start:.0f} s)", file=sys.stderr, flush=True)
        results: list[Result] = []
        for i, m in enumerate(mutants, 1):
            r = run_one(m, tree, scratch, args.markers, args.timeout)
            results.append(r)
            print(f"[{i}/{len(mutants)}] {m.id} {r.status} {r.seconds:.1f}s {r.detail}", file=sys.stderr, flush=True)
    finally:
        if args.keep:
            print(f"scratch kept: {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    wall = round(time.monotonic() - t_start, 1)
    by_id = {m.id: m for m in mutants}
    print(table(results, by_id) + f"\nwall time {wall:.0f} s", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        doc = {
            "counts": counts(results),
            "wall_seconds": wall,
            "results": [
                {"id": r.id, "status": r.status, "detail": r.detail, "seconds": r.seconds, "equivalent": r.equivalent}
                for r in results
            ],
            "skipped": skipped(),
        }
        print(json.dumps(doc, indent=1))
    bad = [r for r in results if not r.equivalent and r.status != "killed"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
