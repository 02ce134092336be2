"""Usage errors through the installed `dsv41-convert` entry point, in a subprocess, as a shell user meets them.

An in-process runner (Typer's CliRunner) skips `cli.main`, which is where a usage error becomes exit 2;
so these run the console script pip installed. Faults planted: an unknown command, a missing argument,
a bad option value, an unknown option, no arguments at all, and (not a usage error) a ConvertError; each
usage error also with --json (one document on stdout).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_run import default_sigint


def entry_point() -> str:
    """The console script of the environment running the tests (the venv's bin/), else the one on PATH."""
    beside = Path(sys.executable).parent / "dsv41-convert"
    found = str(beside) if beside.exists() else shutil.which("dsv41-convert")
    if found is None:
        pytest.fail("the dsv41-convert entry point is not installed (pip install -e .)")
    return found


def run_entry_point(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([entry_point(), *args], capture_output=True, text=True, timeout=60)


USAGE_ERRORS = {
    "unknown command": (["nosuch"], "No such command 'nosuch'"),
    "missing argument": (["shard"], "Missing argument"),
    "missing argument of verify": (["verify"], "Missing argument"),
    "bad option value": (["shard", "a", "b", "--tp", "x"], "Invalid value for '--tp'"),
    "option below its minimum": (["plan", "a", "--tp", "0"], "Invalid value for '--tp'"),
    "unknown option": (["plan", "a", "--bogus"], "No such option: --bogus"),
    "unknown root option": (["--bogus", "plan"], "No such option: --bogus"),
    # 100000 torch threads ended in a Rust thread pool's panic, exit 139 (an audit)
    "more threads than any host": (["reference-logits", "a", "b", "--threads", "100000"], "<= 1024"),
    # it writes nothing: --overwrite was ignored, silently (an audit)
    # nan was refused as "should be >= 0"; inf let --statistical pass anything (an audit)
    "a bound that is not a number": (["verify", "a", "--max-kl", "nan"], "'nan': expected a finite number >= 0"),
    "a bound that passes anything": (["verify", "a", "--max-kl-mean", "inf"], "'inf': expected a finite number"),
    "a bound past its range": (["verify", "a", "--min-cos", "1.5"], "'1.5': expected a finite number >= -1 and <= 1"),
    "an option the mode ignores": (["download", "a/b", "--verify-only", "--overwrite"], "drop --overwrite"),
    # "$OUT" of an unset variable: an empty path was the current folder, written into without a word (an audit)
    "an empty output folder": (["shard", "a", ""], "'': an empty path"),
    "an empty folder to make": (["make-tiny", ""], "'': an empty path"),
    "an empty demo folder": (["demo", ""], "'': an empty path"),
    "an empty source": (["plan", ""], "'': an empty path"),
    "an empty --local-dir": (["download", "a/b", "--local-dir", "", "--verify-only"], "'': an empty path"),
    "an empty reference file": (["verify", "a", "--reference-logits", ""], "'': an empty path"),
    # "$REV" of an unset variable reached the Hub as a revision of no name: "revision 'main' not found (404)"
    "an empty revision": (["download", "a/b", "--revision", "", "--verify-only"], "'': an empty revision"),
}


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_error_prints_usage_and_exits_2(case):
    args, message = USAGE_ERRORS[case]
    proc = run_entry_point(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Usage: dsv41-convert" in proc.stderr
    assert "--help" in proc.stderr  # the hint at help
    assert message in proc.stderr
    assert proc.stdout == ""


def test_an_option_without_its_value_prints_usage_and_the_hint():
    """README, Commands: a usage error (an unknown option, a missing argument, a value the type refuses) prints
    the usage line, the error and a hint at --help. `plan SRC --tp` (the value left out, as a shell variable
    that expanded to nothing leaves it) printed only `Error: Option '--tp' requires an argument.`"""
    proc = run_entry_point("plan", "a", "--tp")
    assert proc.returncode == 2 and "requires an argument" in proc.stderr
    assert "Usage: dsv41-convert plan" in proc.stderr and "--help" in proc.stderr, proc.stderr


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_error_under_json_is_one_document_on_stdout(case):
    """A pipeline reading stdout of `... --json` gets {"ok": false, "exit_code": 2, "error": ...} for a usage
    error too (it used to get nothing: the usage text went to stderr only)."""
    args, message = USAGE_ERRORS[case]
    proc = run_entry_point(*args, "--json")
    assert proc.returncode == 2, proc.stderr
    assert "Usage: dsv41-convert" in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2
    assert message in doc["error"]


def test_no_arguments_shows_help_and_exits_2():
    proc = run_entry_point()
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "Usage: dsv41-convert" in proc.stdout + proc.stderr


def test_help_exits_0():
    proc = run_entry_point("shard", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage: dsv41-convert shard" in proc.stdout


def test_src_help_says_what_each_command_takes():
    """rich reads `[@rev]` as markup unless escaped (it vanished from the help); reference-logits takes no
    repo id."""
    for command in ("plan", "shard", "export"):
        proc = subprocess.run([entry_point(), command, "--help"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "COLUMNS": "300"})  # fmt: skip
        assert "Hub repo id owner/name[@rev]" in proc.stdout, (command, proc.stdout)
    proc = subprocess.run([entry_point(), "reference-logits", "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "300"})  # fmt: skip
    assert "repo id" not in proc.stdout and "or rank files" in proc.stdout


def test_command_list_gives_each_command_one_line_when_wide():
    """typer's rich command list kept the docstrings' single line breaks: reference-logits, check and demo ran
    over ragged lines at any width (an audit). At 300 columns each command's summary is its one line."""
    proc = subprocess.run([entry_point(), "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "300", "NO_COLOR": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    panel = proc.stdout.split("Commands")[1].split("\u2570")[0].splitlines()[1:]
    rows = [line.strip("\u2502 ").split()[0] for line in panel if line.strip("\u2502 ")]
    assert rows == ["make-tiny", "plan", "shard", "verify", "reference-logits", "check", "demo", "download",
                    "manifest", "export"], proc.stdout  # fmt: skip


def test_input_error_still_exits_2_with_error_line(tmp_path):
    proc = run_entry_point("make-tiny", str(tmp_path / "t"), "--preset", "nosuch")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "error: --preset 'nosuch'" in proc.stderr
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("command", ["plan", "shard"])
def test_source_neither_folder_nor_repo_id_is_refused_before_any_download(tmp_path, command):
    missing = tmp_path / "no" / "such" / "checkpoint"
    args = [command, str(missing)] + ([str(tmp_path / "out")] if command == "shard" else [])
    proc = run_entry_point(*args, "--tp", "2")
    assert proc.returncode == 2
    assert f"error: {missing}: no such folder, and not a Hub repo id" in proc.stderr
    assert "download" not in proc.stdout + proc.stderr.replace("not a Hub repo id", "")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["plan", "shard", "export"])
def test_a_repo_id_as_source_under_torchrun_is_refused_before_any_download(tmp_path, monkeypatch, capsys, command):
    """Every process of the launch resolved the repo id itself: eight downloads (and hashes of the whole
    checkpoint) of one repo into one HF cache at once. Refused, naming the one download to run first; no Hub
    was asked (none is reachable here: a download would have failed with a network error instead)."""
    from cli_run import run_cli

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    args = {"plan": ["--tp", "2"], "shard": [str(tmp_path / "out"), "--tp", "2"], "export": [str(tmp_path / "out"),
            "--format", "bf16"]}[command]  # fmt: skip
    code, _, err = run_cli(monkeypatch, capsys, command, "acme/tiny@v1", *args)
    assert code == 2, err
    assert (
        "a Hub repo id as SRC under torchrun" in err
        and "`dsv41-convert download acme/tiny --revision v1 --local-dir DIR`" in err
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf").exists()


def test_ctrl_c_message_fits_the_command():
    """Only the commands that continue what an interrupted run left are told to (verify wrote nothing)."""
    from dsv41_convert.cli import interrupted_message

    assert interrupted_message(["shard"]).endswith("shard continues it with --resume")
    assert interrupted_message(["export"]).endswith("export continues it with --resume")
    assert interrupted_message(["verify"]) == "interrupted; nothing was written"
    assert "--resume" not in interrupted_message(["reference-logits"])


@pytest.mark.parametrize("command", [["shard", "--tp", "2"], ["export", "--format", "bf16"]])
def test_a_dry_run_stopped_says_nothing_was_written(tmp_path, command):
    """A `shard --dry-run` stopped (Ctrl-C while it planned the real checkpoint, a scheduler's SIGTERM) said
    "what is on disk is kept: shard continues it with --resume": a dry run writes nothing, OUT did not exist,
    and `--resume` was advice for a run that never started. It says "nothing was written", as plan does."""
    from cli_run import run_cli_with_a_signal_in_an_import
    from tiny_ckpt import make_tiny

    src = make_tiny(tmp_path / "src", vision=False)
    verb, *options = command
    run = run_cli_with_a_signal_in_an_import(
        "dsv41_convert.convert.plan", verb, str(src), str(tmp_path / "out"), *options, "--dry-run", "--json"
    )
    assert run.returncode == 143, run.stderr
    said = "terminated (SIGTERM); nothing was written"
    assert json.loads(run.stdout) == {"ok": False, "exit_code": 143, "error": said}
    assert f"error: {said}" in run.stderr and not (tmp_path / "out").exists()


def test_an_error_after_a_signal_ends_the_run_as_interrupted(tmp_path, monkeypatch, capsys):
    """A SIGINT at 0.5 s into reference-logits, landing inside numpy's import, ended in exit 1 with a traceback
    (`AttributeError: module 'numpy' has no attribute 'multiply'`; an audit, 2 tries in 5) and no --json
    document. After a signal, what fails is the signal's doing: exit 130 and its message."""
    from cli_run import run_cli
    from tiny_ckpt import make_tiny

    from dsv41_convert import interrupts

    src = make_tiny(tmp_path / "src", vision=False)

    def half_imported(*args, **kwargs):
        raise AttributeError("module 'numpy' has no attribute 'multiply'")

    monkeypatch.setattr("dsv41_convert.convert.plan.build_plan", half_imported)
    monkeypatch.setitem(interrupts._state, "interrupted", True)  # a signal came
    code, out, err = run_cli(monkeypatch, capsys, "plan", str(src), "--tp", "2", "--json")
    assert code == 130 and err == "error: interrupted; nothing was written", err
    assert json.loads(out) == {"ok": False, "exit_code": 130, "error": "interrupted; nothing was written"}
    monkeypatch.setitem(interrupts._state, "interrupted", False)  # no signal: the error is a bug, its traceback kept
    with pytest.raises(AttributeError):
        run_cli(monkeypatch, capsys, "plan", str(src), "--tp", "2")


def test_a_signal_swallowed_by_an_import_still_ends_the_run_as_terminated(tmp_path):
    """`plan` makes no check of its own along the way: a SIGTERM swallowed inside an import let it finish
    and exit 0 as if no signal had come. Now its end says what stopped it: exit 143, and the --json document."""
    from cli_run import run_cli_with_a_signal_in_an_import
    from tiny_ckpt import make_tiny

    src = make_tiny(tmp_path / "src", vision=False)
    run = run_cli_with_a_signal_in_an_import("dsv41_convert.convert.plan", "plan", str(src), "--tp", "2", "--json")
    assert run.returncode == 143, run.stderr
    said = "terminated (SIGTERM); nothing was written"
    assert json.loads(run.stdout) == {"ok": False, "exit_code": 143, "error": said}  # one document, not plan's too


def test_a_reader_that_goes_away_is_exit_141_not_a_failed_check(tmp_path):
    """`plan --json | head -c 10`: Click turned the broken pipe into exit 1 ("a check ran and failed") with no
    word; a CI step with pipefail then reported a failed check. Now 141, as SIGPIPE ends a shell tool."""
    subprocess.run([entry_point(), "make-tiny", str(tmp_path / "t")], check=True, capture_output=True)
    proc = subprocess.Popen([entry_point(), "plan", str(tmp_path / "t"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout.read(10)
    proc.stdout.close()  # the reader goes away while most of the document is still to come
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err, err


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_reader_that_goes_away_from_a_table_or_the_progress_is_exit_141_too(tmp_path, closed):
    """`plan SRC | true` (the table on stdout) and `make-tiny OUT 2>&1 >/dev/null | true` (the progress on
    stderr): rich's own handler ended them with exit 1, "a check ran and failed" (an audit); now 141."""
    out = tmp_path / "t"
    if closed == "stdout":
        subprocess.run([entry_point(), "make-tiny", str(out)], check=True, capture_output=True)
        cmd = [entry_point(), "plan", str(out), "--tp", "2"]
    else:
        cmd = [entry_point(), "make-tiny", str(out)]
    r, w = os.pipe()
    os.close(r)  # a reader that is gone before the first byte
    other = subprocess.DEVNULL
    with os.fdopen(w, "wb") as gone:
        streams = {"stdout": gone, "stderr": other} if closed == "stdout" else {"stdout": other, "stderr": gone}
        code = subprocess.run(cmd, timeout=120, **streams).returncode
    assert code == 141


@pytest.mark.parametrize("args", [["plan", "SRC", "--tp", "0"], ["bogus"], ["plan"]])
def test_a_usage_error_into_a_reader_gone_exits_141(tmp_path, args):
    """`plan SRC --tp 0 2>&1 | head -c1`: click's usage message met the broken pipe and the run ended in a
    traceback nobody could read, exit 1, "a check ran and failed" (an audit); now 141 as every other output."""
    r, w = os.pipe()
    os.close(r)
    args = [str(tmp_path) if a == "SRC" else a for a in args]
    with os.fdopen(w, "wb") as gone:
        code = subprocess.run([entry_point(), *args], stdout=subprocess.DEVNULL, stderr=gone, timeout=60).returncode
    assert code == 141


def test_tables_in_a_pipe_keep_their_rows_whole(tmp_path):
    """`plan --tp 8 > plan.txt` (and verify's table in a CI log): rich assumed 80 columns where stdout is no
    terminal, so the rule column wrapped mid-pattern and verify's prompt labels were cut to `defaul…`."""
    subprocess.run([entry_point(), "make-tiny", str(tmp_path / "t")], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    res = subprocess.run([entry_point(), "plan", str(tmp_path / "t"), "--tp", "8"],
                         capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [line for line in res.stdout.splitlines() if "[copy]" in line or "[as_fp4]" in line]
    assert any(r"(layers|mtp)\.\d+\.(attn_norm|ffn_norm)\.weight [copy]" in line for line in rows), res.stdout
    assert all(line.count("│") == 10 for line in rows)  # one line per rule, 8 rank columns
    assert "…" not in res.stdout


def test_help_into_a_reader_gone_exits_141():
    """`dsv41-convert --help | head -1`: Typer's own console ended the run with exit 1 ("a check failed")."""
    for args in (["--help"], ["plan", "--help"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first byte
        proc = subprocess.run([entry_point(), *args], stdout=write_end, stderr=subprocess.PIPE, timeout=60)
        os.close(write_end)
        assert proc.returncode == 141, (args, proc.returncode, proc.stderr)


def test_help_into_a_full_stdout_names_stdout():
    """`dsv41-convert --help > /dev/full` said "error: No space left on device", naming nothing; the README
    promises `error: stdout: ...` (exit 2) for a stdout that cannot be written, as every result has."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    for args in (["--help"], ["plan", "--help"]):
        with open("/dev/full", "w") as full:
            proc = subprocess.run([entry_point(), *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr)
        assert proc.stderr == "error: stdout: No space left on device\n", (args, proc.stderr)


@pytest.mark.parametrize("case", ["unknown option", "bad option value", "missing argument"])
def test_a_usage_error_with_stderr_closed_is_one_document_on_stdout(case):
    """`... --json 2>&-`: click writes its usage text to stdout where stderr is closed, so stdout held the usage
    lines and then the error's document: no JSON for the pipeline that reads it."""
    args, message = USAGE_ERRORS[case]
    proc = subprocess.run([entry_point(), *args, "--json"], stdout=subprocess.PIPE, text=True, timeout=60,
                          preexec_fn=lambda: os.close(2))  # fmt: skip
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and message in doc["error"], doc


@pytest.mark.parametrize("json_flag", [["--json"], []])
@pytest.mark.parametrize("stdout", ["full", "closed"])
@pytest.mark.parametrize("tp", ["2", "3"])  # a result, and an input error
def test_a_stdout_that_cannot_be_written_is_an_error_naming_it(tmp_path, json_flag, stdout, tp):
    """`plan --json > /dev/full` ended in two tracebacks and exit 1, "a check failed" (its error document failed
    as the result had); with stdout closed (`>&-`) the same, and without --json the plan went nowhere with
    exit 0 (an audit). Now exit 2 with `error: stdout: ...` (or the input error itself) on stderr."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    src = tmp_path / "t"
    subprocess.run([entry_point(), "make-tiny", str(src)], check=True, capture_output=True)
    cmd = [entry_point(), "plan", str(src), "--tp", tp, *json_flag]
    if stdout == "full":
        with open("/dev/full", "w") as full:
            proc = subprocess.run(cmd, stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    else:
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, timeout=60,
                              preexec_fn=lambda: os.close(1))  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, (
        proc.returncode, proc.stderr)  # fmt: skip
    if stdout == "closed":  # said before any work (a conversion of hours reported an input error at its end)
        assert "error: stdout: closed, so the results cannot be written" in proc.stderr
    elif tp == "3":
        assert "cannot run at tp 3" in proc.stderr
    else:
        assert "error: stdout: No space left on device" in proc.stderr


@pytest.mark.parametrize("command", ["download", "check"])
def test_a_stderr_that_cannot_be_written_is_an_error_naming_it(tmp_path, command):
    """`download --json 2>/dev/full` (progress into a log on a full disk): the first progress line failed, then
    the error saying so, on the same stderr: a traceback nobody saw, exit 1 ("a check failed") and no --json
    document; an input error's own line failed the same way (`check` of a folder without a manifest). As for
    stdout: exit 2, the document on stdout naming stderr, or the input error where that came first."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    src = tmp_path / "t"
    subprocess.run([entry_point(), "make-tiny", str(src)], check=True, capture_output=True)
    args = {"download": ["acme/tiny", "--local-dir", str(src), "--verify-only"], "check": [str(src)]}[command]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([entry_point(), command, *args, "--json"], stdout=subprocess.PIPE, stderr=full,
                              text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, (proc.returncode, proc.stdout)
    said = json.loads(proc.stdout)
    assert said["ok"] is False and said["exit_code"] == 2
    if command == "download":  # its progress, the first line on stderr
        assert said["error"] == "stderr: No space left on device"
    else:  # the input error itself, naming the file
        assert said["error"].startswith(f"{src / 'manifest.json'}: ")


def test_a_path_that_is_not_utf8_is_written_to_a_utf8_stdout_as_its_bytes(tmp_path):
    """Under a UTF-8 locale Python's stdout is strict: `check` of a folder named b"out\\xff" passed its check
    and then ended in a UnicodeEncodeError traceback, exit 1 ("a check failed"), as did make-tiny's result line.
    PYTHONIOENCODING=utf-8:strict is that locale's stdout on a machine that has one installed."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    folder = tmp_path / os.fsdecode(b"src\xff")
    made = subprocess.run([entry_point(), "make-tiny", str(folder)], capture_output=True, timeout=60, env=env)
    assert made.returncode == 0, made.stderr
    assert made.stdout == bytes(tmp_path) + b"/src\xff\n"
    out = tmp_path / os.fsdecode(b"out\xff")
    subprocess.run([entry_point(), "shard", str(folder), str(out), "--tp", "2"], check=True, capture_output=True)
    proc = subprocess.run([entry_point(), "check", str(out)], capture_output=True, timeout=60, env=env)
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == b"ok: " + bytes(tmp_path) + b"/out\xff\n"


@pytest.mark.parametrize("debug", [[], ["--debug"]])
def test_a_signal_while_the_document_waits_on_a_full_pipe_leaves_it_whole(tmp_path, debug):
    """`plan --json | slow-reader`, SIGTERM while the document waits on the full pipe: the document was cut and
    the error's appended (two, and no JSON), or (signal handled without raising) Python's buffered stream
    dropped what the interrupted write had not taken, 117 KB from its middle. Now the document is whole, the
    run exits 143 with its reason on stderr, and no second document (README: a signal after the result's
    document). With --debug too: the signal, held off while the document was written, raised nothing, and the
    run that took it exited 0."""
    if not os.path.exists("/proc/self/wchan"):
        pytest.skip("no /proc/PID/wchan to see the writer wait on the pipe")
    src = tmp_path / "t"
    subprocess.run([entry_point(), "make-tiny", str(src)], check=True, capture_output=True)
    cmd = [entry_point(), "plan", str(src), "--tp", "2", "--json"]
    whole = subprocess.run(cmd, capture_output=True, check=True, timeout=60).stdout
    assert len(whole) > 4 * 65536  # more than a pipe holds
    proc = subprocess.Popen([cmd[0], *debug, *cmd[1:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while "pipe_write" not in Path(f"/proc/{proc.pid}/wchan").read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "plan never waited on the full pipe"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert out == whole, (len(out), len(whole))
    assert err.decode().endswith("error: terminated (SIGTERM); nothing was written\n"), err


def test_a_stderr_that_cannot_be_written_is_an_input_error_not_a_failed_check(tmp_path):
    """`2>>log` on a full disk: the first progress line's OSError went uncaught (its error line failed too), so
    every command ended in exit 1, "a check ran and failed": `check` of sound files, an input error, a usage
    error. Now exit 2 (an input error naming stderr, as stdout's), and with --json the document on stdout."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    src, out = tmp_path / "t", tmp_path / "mp2"
    subprocess.run([entry_point(), "make-tiny", str(src)], check=True, capture_output=True)
    subprocess.run([entry_point(), "shard", str(src), str(out), "--tp", "2"], check=True, capture_output=True)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        with open("/dev/full", "w") as full:
            return subprocess.run([entry_point(), *args], stdout=subprocess.PIPE, stderr=full, text=True, timeout=60)

    assert run("check", str(out)).returncode == 2
    assert run("plan", str(src), "--bogus").returncode == 2
    proc = run("plan", str(src), "--tp", "3", "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 2 and doc["exit_code"] == 2 and "cannot run at tp 3" in doc["error"], proc.stdout
    proc = run("check", str(out), "--json")  # writes nothing on stderr: the check's own verdict
    assert proc.returncode == 0 and json.loads(proc.stdout)["ok"] is True


def test_columns_of_zero_prints_results_and_errors(tmp_path):
    """COLUMNS=0 (`COLUMNS=$(tput cols)` without a terminal): rich printed every line at width 0, so make-tiny's
    result (the folder, for a script to read), check's verdict, an input error and --help were all nothing."""
    env = {**os.environ, "COLUMNS": "0"}
    src = tmp_path / "t"
    made = subprocess.run([entry_point(), "make-tiny", str(src)], capture_output=True, text=True, timeout=60, env=env)
    assert made.returncode == 0 and made.stdout == f"{src}\n", made.stdout
    proc = subprocess.run([entry_point(), "check", str(src)], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and f"error: {src / 'manifest.json'}: not found" in proc.stderr, proc.stderr
    proc = subprocess.run([entry_point(), "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and "make-tiny" in proc.stdout, proc.stdout


def test_a_closed_stdout_is_refused_before_any_work(tmp_path):
    """`shard SRC OUT >&-`: said at the start, OUT not made."""
    src = tmp_path / "t"
    subprocess.run([entry_point(), "make-tiny", str(src)], check=True, capture_output=True)
    proc = subprocess.run([entry_point(), "shard", str(src), str(tmp_path / "out"), "--tp", "2"],
                          stderr=subprocess.PIPE, text=True, timeout=60, preexec_fn=lambda: os.close(1))  # fmt: skip
    assert proc.returncode == 2 and "error: stdout: closed" in proc.stderr and not (tmp_path / "out").exists()


def test_shard_writes_the_folder_it_wrote_on_stdout(tmp_path, monkeypatch, capsys):
    """README: results go to stdout. `shard` said its result only on stderr ("wrote 2 file(s) ... manifest: PATH")
    and left stdout empty, while export, make-tiny, manifest and reference-logits print what they wrote (an audit):
    `MP=$(dsv41-convert shard SRC OUT --tp 2)` got nothing. Now the folder, absolute, as export prints it; also
    from a share (--ranks) and a run that resumes a finished folder."""
    from cli_run import run_cli
    from tiny_ckpt import make_tiny

    src = make_tiny(tmp_path / "src", vision=False)
    out = tmp_path / "mp2"
    for args in ([], ["--resume"]):
        code, stdout, err = run_cli(monkeypatch, capsys, "shard", str(src), str(out), "--tp", "2", *args)
        assert code == 0 and stdout == f"{out.resolve()}\n", (stdout, err)
    share = tmp_path / "share"
    code, stdout, err = run_cli(monkeypatch, capsys, "shard", str(src), str(share), "--tp", "2", "--ranks", "1")
    assert code == 0 and stdout == f"{share.resolve()}\n", (stdout, err)


DRIVER = """
import atexit, os, signal, sys
from dsv41_convert import cli, interrupts
from dsv41_convert.app import report
when = sys.argv.pop(1)
if when == "after the document":  # the flag a signal sets, right after the result is on stdout
    real = report.write
    def write(*args, **kw):
        real(*args, **kw)
        interrupts._state["interrupted"] = True
    report.write = write
else:  # a signal while the process ends (atexit runs before Python resets its handlers)
    atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))
cli.main()
"""


@pytest.mark.parametrize("when", ["after the document", "while ending"])
def test_a_signal_after_the_result_never_exits_0_nor_writes_a_second_document(tmp_path, when):
    """A Ctrl-C in the ~0.4 s after the result's document (torch and multiprocessing shutting down) exited 0, or
    130 with a second document on stdout, the error's after the result's (an audit). Now 130 with the one
    document and the reason on stderr."""
    src = tmp_path / "t"
    subprocess.run([entry_point(), "make-tiny", str(src)], check=True, capture_output=True)
    proc = subprocess.run([sys.executable, "-c", DRIVER, when, "plan", str(src), "--tp", "2", "--json"],
                          capture_output=True, text=True, timeout=120, preexec_fn=default_sigint)  # fmt: skip
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-500:])
    assert json.loads(proc.stdout)["src"] == str(src)  # one document: the result's
    assert "interrupted" in proc.stderr and "Traceback" not in proc.stderr


SIGNAL_AT_THE_EXIT = """
import atexit, os, signal, sys
from dsv41_convert import cli
sig = signal.Signals[sys.argv.pop(1)]
real = cli._main
def _main(*args):  # an exit handler after _late_signals_exit_at_once's (registered at the end of _main)
    atexit.register(lambda: os.kill(os.getpid(), sig))
    real(*args)
cli._main = _main
cli.entry()
"""


@pytest.mark.parametrize("stderr", ["full", "closed"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_at_the_exit_with_stderr_unwritable_does_not_exit_0(tmp_path, stderr, sig):
    """A SIGTERM in the process's last moments, after the result, ends it with 143 and a line on stderr; where
    that line could not be written (`2>/dev/full`, `2>&-`) the OSError left the handler before its exit, and the
    process ended with the run's 0, as if no signal had come (README: a run that took one never exits 0)."""
    if stderr == "full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    src = tmp_path / "t"
    subprocess.run([entry_point(), "make-tiny", str(src)], check=True, capture_output=True)
    cmd = [sys.executable, "-c", SIGNAL_AT_THE_EXIT, sig, "plan", str(src), "--tp", "2", "--json"]

    def start() -> None:
        default_sigint()
        if stderr == "closed":
            os.close(2)

    with open(os.devnull if stderr == "closed" else "/dev/full", "wb") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, timeout=120, preexec_fn=start)
    assert proc.returncode == (143 if sig == "SIGTERM" else 130), proc.returncode
    assert json.loads(proc.stdout)["src"] == str(src)  # the one document: the result's


SIGNAL_IN_THE_TEARDOWN = """
import os, runpy, signal, sys, time
how, sig = sys.argv.pop(1), signal.Signals[sys.argv.pop(1)]

class SignalInTheTeardown:  # the interpreter's teardown deletes it, after putting the default handlers back
    def __del__(self):
        os.write(2, b"teardown reached\\n")
        os.kill(os.getpid(), sig)
        time.sleep(1)

keep = SignalInTheTeardown()
sys.argv[0] = "dsv41-convert"
if how == "python -m":
    runpy.run_module("dsv41_convert.cli", run_name="__main__", alter_sys=True)
else:
    runpy.run_path(how, run_name="__main__")
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("how", ["python -m", "console script"])
def test_a_finished_run_ends_before_the_interpreters_teardown(tmp_path, how, sig):
    """The interpreter's teardown (its last collection, every module's, torch's destructors) runs with the
    default signal handlers back: a SIGTERM there ended a finished `export --workers 2` by the signal itself
    (-15, no line; CI, once in about four runs). The process now ends with its exit code after the exit
    handlers, before any teardown: a signal planted there is never reached."""
    how = how if how == "python -m" else entry_point()
    cmd = [sys.executable, "-c", SIGNAL_IN_THE_TEARDOWN, how, sig, "make-tiny", str(tmp_path / "t"), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=default_sigint)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-500:])
    assert "teardown reached" not in proc.stderr
    assert json.loads(proc.stdout)["out"] == str(tmp_path / "t")  # flushed before the process ended


SLOW_TYPER = """
import os, time
open(os.environ["LOADING_MARK"], "w").close()
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["console script", "python -m"])
@pytest.mark.parametrize("ignored", [False, True])
def test_ctrl_c_while_the_command_line_loads_ends_it_by_the_signal_without_a_traceback(tmp_path, ignored, how):
    """README: a signal in the first fraction of a second, while the command line's own modules load, ends the
    process by the signal itself. A SIGINT there printed Python's KeyboardInterrupt traceback first (found by a
    helper's crash-consistency hunt). The console script now loads them with SIGINT at its default: the process
    ends by the signal, nothing on stderr; a SIGINT the shell ignored (a background job) stays ignored there.
    typer's import is made to wait here (a `typer` package first on PYTHONPATH), so the signal lands in it.
    `python -m dsv41_convert.cli` (torchrun's form, one traceback per rank) printed the traceback still (a helper's
    interrupt hunt): it now loads the command line the same way."""
    assert "from dsv41_convert.console import entry" in Path(entry_point()).read_text()  # what pip installed
    (tmp_path / "typer").mkdir()
    (tmp_path / "typer" / "__init__.py").write_text(SLOW_TYPER)
    mark = tmp_path / "loading"
    tree = str(Path(__file__).resolve().parents[2])  # the package under test, as the console script imports it
    env = dict(os.environ, LOADING_MARK=str(mark), PYTHONPATH=os.pathsep.join([str(tmp_path), tree]))
    script = "import sys; sys.argv[0] = 'dsv41-convert'; from dsv41_convert.console import entry; entry()"
    command = ["-c", script] if how == "console script" else ["-m", "dsv41_convert.cli"]

    def start() -> None:
        default_sigint()
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, *command, "--help"], env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=start)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mark.exists(), proc.communicate(timeout=5)
        proc.send_signal(signal.SIGINT)
        if ignored:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
            return
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGINT and err == "", (proc.returncode, err[-500:])
    finally:
        proc.kill()
        proc.communicate()


def test_a_narrow_terminal_keeps_every_number_and_name_whole(tmp_path):
    """`plan` in a terminal under ~60 columns cut its byte counts and file names to `67,162,215,6…` and
    `model0-mp8.safe…` (a number that reads as another): numbers now keep their width, names fold onto lines."""
    cli = [sys.executable, "-m", "dsv41_convert.cli"]
    subprocess.run([*cli, "make-tiny", str(tmp_path / "t")], check=True, capture_output=True)
    plan = [*cli, "plan", str(tmp_path / "t"), "--tp", "8"]
    ranks = json.loads(subprocess.run([*plan, "--json"], capture_output=True, text=True, timeout=60).stdout)["files"]
    res = subprocess.run(plan, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "40"})
    assert res.returncode == 0, res.stderr
    files_table = res.stdout.split("tensors per rule")[0]
    assert "…" not in files_table, files_table
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in files_table.splitlines() if "│" in line]
    for r in ranks:
        row = next(i for i, c in enumerate(cells) if c[0] == str(r["rank"]))
        assert cells[row][3] == f"{r['bytes']:,}", files_table
        folded = cells[row][1] + "".join(c[1] for c in cells[row + 1 :] if not c[0])  # the name's further lines
        assert folded.startswith(r["file"]), files_table


def test_tables_narrower_than_their_numbers_cut_none(tmp_path):
    """`plan` in a narrow terminal (or COLUMNS=20 in a script): rich cut the no_wrap cells to fit, each rank's
    bytes to `7,527…` (the real layout's memory total at 50 columns: `63.…`), and gave the file column a width of
    0, so neither the numbers nor the rank files' names could be read. The table is printed at the width its
    numbers need (the terminal wraps its lines); the folding columns (file, rule) still fold."""
    src = tmp_path / "t"
    subprocess.run([entry_point(), "make-tiny", str(src)], check=True, capture_output=True)
    planned = subprocess.run([entry_point(), "plan", str(src), "--tp", "2", "--json"],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    files = json.loads(planned.stdout)["files"]
    for columns in ("20", "50"):
        res = subprocess.run([entry_point(), "plan", str(src), "--tp", "2"], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "COLUMNS": columns, "NO_COLOR": "1"})  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert "…" not in res.stdout, (columns, res.stdout)
        rows = res.stdout.split("\u2521")[1].split("\u2514")[0].splitlines()  # the rank table's body
        cells = [line.split("\u2502") for line in rows if "\u2502" in line]
        assert "".join(cell[2].strip() for cell in cells) == "".join(f["file"] for f in files) + "total", res.stdout
        for f in files:
            assert any(cell[4].strip() == f"{f['bytes']:,}" for cell in cells), (f, res.stdout)


def test_a_path_of_bytes_that_are_not_utf8_comes_back_from_the_json(tmp_path):
    """README: a path of other bytes is written in JSON with Python's surrogate escapes, which os.fsencode turns back
    into the path's bytes; the JSON stays ASCII (a strict parser reads it), the error document names it so too,
    stderr spells it alike, and a plain result line on stdout is the path's own bytes."""
    src = tmp_path / os.fsdecode(b"src\xff")
    made = subprocess.run([entry_point(), "make-tiny", str(src), "--preset", "tiny"], capture_output=True, timeout=60)
    assert made.returncode == 0 and made.stdout == os.fsencode(src) + b"\n", made.stderr  # the path's own bytes
    assert b"src\\udcff" in made.stderr and b"src\xff" not in made.stderr
    planned = run_entry_point("plan", str(src), "--tp", "2", "--json")
    assert planned.returncode == 0, planned.stderr
    assert planned.stdout.isascii() and "\\udcff" in planned.stdout
    assert os.fsencode(json.loads(planned.stdout)["src"]) == os.fsencode(src)
    missing = run_entry_point("plan", str(tmp_path / os.fsdecode(b"nope\xfe")), "--json")
    error = json.loads(missing.stdout)["error"]
    assert missing.returncode == 2 and os.fsencode(error.split(": ")[0]).endswith(b"nope\xfe"), missing.stdout
