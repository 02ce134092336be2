"""cli.main's last resort: what reaches it outside a command's own handling becomes an exit code and a
message (and a --json document), not a traceback or another cause's exit code (an audit's cases)."""

from __future__ import annotations

import json
import signal
import sys

import pytest
import typer

from dsv41_convert import cli, interrupts


def _main_with(monkeypatch, capsys, raised: BaseException) -> tuple[int, str, str]:
    def app(standalone_mode=False):
        raise raised

    monkeypatch.setattr(cli, "app", app)
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", "shard", "--json"])
    monkeypatch.setitem(interrupts._state, "interrupted", False)
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_a_signal_before_the_command_runs_is_an_interrupt_not_a_traceback(monkeypatch, capsys):
    """SIGTERM 60-70 ms in, while Typer built the command: the KeyboardInterrupt escaped main (a traceback,
    the process ended by SIGINT)."""
    code, out, err = _main_with(monkeypatch, capsys, KeyboardInterrupt())
    assert code == 130 and "interrupted" in err and "Traceback" not in err
    assert json.loads(out)["exit_code"] == 130


def _abort_from(cause: BaseException) -> typer.Abort:
    """The Abort click raises for an EOFError or a KeyboardInterrupt in a command, `cause` its context."""
    try:
        try:
            raise cause
        except BaseException as exc:
            raise typer.Abort() from exc
    except typer.Abort as abort:
        return abort


def test_an_abort_from_a_closed_pipe_is_a_failed_run_not_a_ctrl_c(monkeypatch, capsys):
    """click turns an EOFError into Abort: a killed fork server said "aborted", exit 130."""
    code, out, err = _main_with(monkeypatch, capsys, _abort_from(EOFError()))
    assert code == 1 and "stopped: EOFError from a process the run depends on" in err and "aborted" not in err
    assert json.loads(out)["exit_code"] == 1
    assert _main_with(monkeypatch, capsys, _abort_from(KeyboardInterrupt()))[0] == 130  # a Ctrl-C stays one


def test_a_usage_error_under_torchrun_says_which_process(monkeypatch, capsys):
    """Processes of a torchrun launch share stderr: click's "Error: No such option" said no rank."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", "check", "--bogus", "--json"])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and err.startswith("error: rank 1: No such option: --bogus"), err
    assert json.loads(out) == {"rank": 1, "ok": False, "exit_code": 2, "error": "No such option: --bogus"}


@pytest.mark.parametrize(
    ("handler", "said", "code"),
    [(cli._sigint_as_interrupt, "interrupted", 130), (cli._sigterm_as_interrupt, "terminated (SIGTERM)", 143)],
)
def test_ctrl_c_and_sigterm_stop_the_run_where_they_land(monkeypatch, handler, said, code):
    """Both handlers raise at once outside a deferred section (README: SIGTERM stops the run as Ctrl-C does),
    are postponed inside one to its end, and leave the code and words of their own signal. A handler that only
    recorded SIGTERM let a run whose main thread makes no check (make-tiny's shards, a model run) go on to
    its end before exiting 143."""
    monkeypatch.setitem(interrupts._state, "interrupted", False)
    monkeypatch.setitem(interrupts._state, "depth", 0)
    monkeypatch.setattr(cli, "_stopped_by", [])
    monkeypatch.setattr(cli, "_arm_stop_watchdog", lambda seconds=None: None)  # no SIGALRM in the test process
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", "verify", "x"])
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGINT, sys._getframe())
    assert cli._how_stopped() == (f"{said}; nothing was written", code)
    monkeypatch.setitem(interrupts._state, "interrupted", False)
    ran_on = []
    with pytest.raises(KeyboardInterrupt), interrupts.deferred():
        handler(signal.SIGINT, sys._getframe())
        ran_on.append("the rest of the section")
    assert ran_on == ["the rest of the section"]


@pytest.mark.parametrize(("raised", "code"), [(SystemExit("a message"), 1), (SystemExit(None), 0), (SystemExit(3), 3)])
def test_the_process_ends_with_the_code_the_interpreter_would_give(monkeypatch, raised, code):
    """entry() ends the process itself (os._exit, before the teardown) with main's exit code: sys.exit with a
    message is 1, as the interpreter makes it, never 0."""
    registered = []
    monkeypatch.setattr(cli.atexit, "register", lambda fn, *args: registered.append(fn))
    monkeypatch.setitem(cli._exit_code, "code", 0)

    def main():
        raise raised

    monkeypatch.setattr(cli, "main", main)
    with pytest.raises(SystemExit):
        cli.entry()
    assert registered == [cli._end_before_the_teardown]
    assert cli._exit_code["code"] == code


def _sigterm_when_called(monkeypatch, module, name: str) -> None:
    """`module.name` takes a SIGTERM (cli's own handler, as the signal would run it) on its first call, then
    runs as before."""
    original = getattr(module, name)
    calls = []

    def with_a_signal(*args, **kwargs):
        if not calls:
            calls.append(name)
            cli._sigterm_as_interrupt(signal.SIGTERM, sys._getframe())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, with_a_signal)


@pytest.fixture
def no_signal_yet(monkeypatch):
    monkeypatch.setitem(interrupts._state, "interrupted", False)
    monkeypatch.setitem(interrupts._state, "depth", 0)
    monkeypatch.setattr(cli, "_stopped_by", [])
    monkeypatch.setattr(cli, "_arm_stop_watchdog", lambda seconds=None: None)  # no SIGALRM in the test process


def test_a_signal_while_the_run_says_its_error_leaves_the_error_and_its_document(monkeypatch, capsys, no_signal_yet):
    """CI: torchrun stopped rank 1 (SIGTERM) while it said the refusal rank 0 had just said and exited with; the
    KeyboardInterrupt ended it mid-line, exit 130 and no document. The decided ending is said whole."""
    from dsv41_convert.app import report
    from dsv41_convert.errors import VerifyInputError

    def app(standalone_mode=False):
        raise VerifyInputError("--stream-layers runs in one process: run it without torchrun")

    monkeypatch.setattr(cli, "app", app)
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", "verify", "x", "--json"])
    _sigterm_when_called(monkeypatch, report, "error")
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and "runs in one process" in err and "terminated" not in err, err
    assert json.loads(out) == {"ok": False, "exit_code": 2, "error": "--stream-layers runs in one process: "
                               "run it without torchrun"}  # fmt: skip


def test_a_signal_before_the_command_is_parsed_is_said_with_its_own_code(monkeypatch, capsys, no_signal_yet):
    """A SIGTERM in main's first steps (the torchrun agent's watch set up, before Typer runs) escaped as a bare
    KeyboardInterrupt: exit 130, no message, no document."""
    monkeypatch.setattr(cli, "app", lambda standalone_mode=False: pytest.fail("the command ran"))
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", "verify", "x", "--json"])
    _sigterm_when_called(monkeypatch, cli, "_end_with_the_torchrun_agent")
    with pytest.raises(SystemExit) as exc:
        cli.main()
    out, err = capsys.readouterr()
    assert exc.value.code == 143 and "terminated (SIGTERM); nothing was written" in err, err
    assert json.loads(out)["exit_code"] == 143
