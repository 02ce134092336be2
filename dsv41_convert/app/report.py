"""Terminal output for cli.py: rich progress and tables on stderr, results and JSON on stdout.

Library code never prints; it takes a `progress(event)` callback. This module makes such callbacks.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import itertools
import json
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import IO, TYPE_CHECKING, Any, NoReturn

from dsv41_convert import interrupts, torchrun
from dsv41_convert.progress import Progress as ProgressFn

if TYPE_CHECKING:
    from rich.console import Console

    stdout: Console  # results: tables, paths
    stderr: Console  # progress, logs, warnings


def __getattr__(name: str) -> Console:
    """`report.stdout` / `report.stderr`, the rich consoles, made on first use: a command that writes only
    JSON (`plan --json`) never imports rich (~50 ms of its start)."""
    if name in ("stdout", "stderr"):
        return _console(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _console(name: str) -> Console:
    from rich.console import Console

    if name == "stdout":
        _require_stdout()
    # emoji=False: a path with `:100:` or `:a:` in it was printed with an emoji in their place (an audit)
    console = Console(file=_Named(name), stderr=name == "stderr", soft_wrap=True, emoji=False)
    # rich's own ends the run with exit 1 ("a check ran and failed"), and points stdout at /dev/null even
    # when stderr's reader went away (`cmd 2>&1 | head`)
    console.on_broken_pipe = functools.partial(reader_gone, console.file)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH  # a table in a log or a pipe at its own width, not cut to 80 columns
    return console


PIPE_WIDTH = 200  # columns of output that goes to a file or a pipe (rich assumes 80 there)


def print_json(data: Any, compact: bool = False, after_a_signal: bool = False) -> None:
    """One JSON document on stdout, for pipelines. `compact`: no indentation, for large documents (the
    indenting encoder is pure Python, ~10x slower than the compact one), and no check for cycles, which
    costs a third of the encoding of a plan's 400k containers (JSON data has none: one would recurse
    until RecursionError instead of a ValueError). `after_a_signal`: as `write`'s.

    Under a torchrun launch of several processes, which share one stdout, each process's document is one
    line (JSON Lines) written whole (_write_whole), its `rank` first: indented documents of two ranks
    interleaved."""
    data, rank = _ranked(data), torchrun.shared_rank()
    layout = {"separators": (",", ":"), "check_circular": False} if compact or rank is not None else {"indent": 2}
    dump = functools.partial(json.dumps, default=str, allow_nan=False, **layout)
    try:
        text = dump(data)
    except ValueError:  # NaN or an infinity (a metric of a NaN logit): JSON has neither (an audit)
        text = dump(finite_json(data))
    write(text, after_a_signal=after_a_signal)


def finite_json(data: Any) -> Any:
    """`data` with every float that JSON cannot hold (NaN, an infinity) as the string "nan", "inf" or "-inf"
    (Python's json wrote NaN and Infinity, which JSON parsers other than Python's refuse)."""
    if isinstance(data, float) and not math.isfinite(data):
        return "nan" if math.isnan(data) else "inf" if data > 0 else "-inf"
    if isinstance(data, dict):
        return {k: finite_json(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [finite_json(v) for v in data]
    return data


def write_json_pieces(pieces: Iterator[str]) -> None:
    """A JSON object given in pieces (the first begins with "{"), as print_json writes a document: under a
    torchrun launch its `rank` first (`plan --json` had none: an audit)."""
    rank = torchrun.shared_rank()
    if rank is not None:
        first = next(pieces)
        pieces = itertools.chain([f'{{"rank":{rank},' + first[1:]], pieces)
    write(*pieces)


def _ranked(data: Any) -> Any:
    """`data` as the document of one process of a torchrun launch: its `rank` first (else as it is)."""
    rank = torchrun.shared_rank()
    if rank is None:
        return data
    return {"rank": rank} | data if isinstance(data, dict) else {"rank": rank, "result": data}


def error_document(message: str, code: int) -> dict[str, Any]:
    """The --json document of a command that ended in an error: {"ok": false, "exit_code": code, "error": ...}"""
    return {"ok": False, "exit_code": code, "error": message}


BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


_documents = [0]  # documents `write` has put on stdout in this process


def documents_written() -> int:
    """How many documents (a result's, an error's) this process has written on stdout."""
    return _documents[0]


def write(*pieces: str, after_a_signal: bool = False) -> None:
    """A document already rendered (e.g. JSON), given whole or in pieces, on stdout with a final newline, as
    print_json ends it. A reader that went away (`... --json | head`) ends the command with exit 141, as
    SIGPIPE ends a shell tool (Click would make it exit 1: "a check failed"). A process that took Ctrl-C or
    SIGTERM raises KeyboardInterrupt instead (interrupts.py): its one document is the one that says so,
    written `after_a_signal`."""
    if not after_a_signal:
        interrupts.check()
    _require_stdout()
    try:
        # a signal waits for the document's end: one that cut it (SIGTERM while `plan --json` waited on a full
        # pipe) was followed by the error's document, two and no JSON; the run still stops, with its reason on
        # stderr alone (cli._json_error: one document per run)
        with interrupts.held():
            data = ("".join(pieces) + "\n").encode("utf-8", "surrogateescape")  # JSON: ASCII
            if torchrun.shared_rank() is not None:
                _write_whole(data)
            else:
                _write_all(data)
            _documents[0] += 1
    except BrokenPipeError:
        reader_gone(sys.stdout)
    except OSError as exc:  # a full disk (> /dev/full): an input error naming stdout, not a traceback (an audit)
        raise stream_failed("stdout", exc) from None


class _Named:
    """sys.stdout or sys.stderr (`name`) as it is at each write (pytest swaps them), for a rich console: a write
    that fails (a full disk) raises an OSError naming the stream, as `write` does (it said only "No space left
    on device"; on stderr, the progress of `download 2>/dev/full`, the error saying so failed too: a traceback
    nobody saw, exit 1, "a check failed", and no --json document)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def write(self, text: str) -> int:
        return self._named(self._stream().write, text)

    def flush(self) -> None:
        self._named(self._stream().flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream(), name)

    def _stream(self) -> IO[str] | _Nowhere:
        stream = getattr(sys, self._name)
        return stream if stream is not None else _NOWHERE  # stderr closed (`2>&-`): nothing to say it on

    def _named(self, call, *args):
        return named_call(self._name, call, *args)


def named_call(name: str, call, *args):
    """call(*args), a write to sys.stdout or sys.stderr (`name`): an OSError (a full disk) raised as one naming
    the stream (stream_failed); a BrokenPipeError as it is (a console's on_broken_pipe: exit 141)."""
    try:
        return call(*args)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise stream_failed(name, exc) from None


class _Nowhere:
    """A closed stream's stand-in: what is written is dropped."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


_NOWHERE = _Nowhere()


def stream_failed(name: str, exc: OSError) -> OSError:
    """The error for a write to sys.stdout or sys.stderr (`name`) that failed: `exc` naming it; the stream is
    pointed at /dev/null, so that nothing fails again at exit (nor the line on stderr that says so)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), getattr(sys, name).fileno())
    return OSError(exc.errno, exc.strerror, name)


def _require_stdout() -> None:
    """OSError naming stdout where this process has none (started with it closed: `cmd >&-`), whose results
    were dropped without a word, exit 0 (an audit)."""
    if sys.stdout is None:
        raise OSError(errno.EBADF, "closed, so the results cannot be written", "stdout")


def _write_whole(data: bytes) -> None:
    """`data` on stdout, not cut by another process's write to the same stream (the ranks of a torchrun
    launch): a pipe keeps a write whole only up to PIPE_BUF (4096 bytes), so every write is made under an
    exclusive lock on the stream (lockf; a pipe's and a file's are shared by the processes that write to them;
    one that takes no lock, such as a socket, is written as it is). Every one, short ones too: a short
    document written while a long one waited on a full pipe landed inside it (an audit)."""
    _write_all(data, locked=True)


def _write_all(data: bytes, locked: bool = False) -> None:
    """Every byte of `data` on stdout, by os.write on its descriptor, looped on the count written (`locked`:
    under _write_whole's lock). A signal that lands while a write waits on a full pipe ends that write with
    part of it written, and Python's buffered streams then dropped the rest of what they were given: `plan
    --json`, SIGTERM at 0.4 s, lost 117 KB from the middle of its document (an audit)."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (a capture in tests)
        sys.stdout.write(data.decode("utf-8", "surrogateescape"))
        sys.stdout.flush()
        return
    with _stream_locked(fd) if locked else nullcontext():
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]


@contextmanager
def _stream_locked(fd: int) -> Iterator[None]:
    """An exclusive lockf on the stream `fd` while inside (none where it takes none: a socket). Per process, so
    a signal handler that writes while this process holds it is not kept waiting."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)


def reader_gone(stream: IO[str]) -> NoReturn:
    """The reader of `stream` went away: end the command with exit 141, as SIGPIPE ends a shell tool, the
    stream pointed at /dev/null so that nothing more fails to flush at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    raise SystemExit(BROKEN_PIPE) from None


def plain(text: str) -> str:
    """`text` as rich prints it literally: square brackets in a path or a tensor name are not markup (a
    folder named `x[bold]y` was printed as `xy`, one with `[/]` in it ended in a MarkupError traceback);
    `:name:` emoji codes are left as they are by the consoles themselves (emoji=False)."""
    from rich.markup import escape

    return escape(text)


FOLD_MIN = 4  # columns a folding column (a file name, a rule) keeps where a table is wider than the terminal


def tables(*renderables: Any) -> None:
    """Each renderable on stdout (a rich Table, or a Group holding tables: verify's), every table no narrower than
    its no_wrap columns (the numbers) need, with FOLD_MIN columns for each folding one: where the terminal (or
    COLUMNS) is narrower, at that width, and the terminal wraps its lines. rich cut such cells to fit: `plan --tp 8`
    of the real layout in a 50-column terminal gave each rank's memory total as `63.…`, and at COLUMNS=20 the rank
    table's bytes as `7,527…` and its file column a width of 0 (an audit).

    Under a torchrun launch of several processes (one stdout), all of them in one write under the stream's
    lock, as `write` writes a document: each share's `--dry-run` tables came out interleaved with the others'
    (four titles in a row, then rules tables nobody could tell apart)."""
    from rich.console import Group
    from rich.measure import Measurement
    from rich.table import Table

    console = _console("stdout")
    wide = console.options.update_width(2**20)  # a cell's own width, not one cut to the terminal's

    def widest(column) -> int:
        return max(Measurement.get(console, wide, cell).maximum for cell in (column.header, *column.cells))

    for renderable in renderables:
        parts = renderable.renderables if isinstance(renderable, Group) else [renderable]
        for table in (part for part in parts if isinstance(part, Table)):
            _, right, _, left = table.padding
            cells = sum(widest(c) if c.no_wrap else min(widest(c), FOLD_MIN) for c in table.columns)
            borders = len(table.columns) - 1 + 2 * table.show_edge if table.box else 0
            need = cells + len(table.columns) * (left + right) + borders
            if need > console.width:
                table.width = need
    shared = torchrun.shared_rank() is not None
    with console.capture() if shared else nullcontext() as captured:
        for renderable in renderables:
            console.print(renderable)
    if shared:
        write(captured.get().removesuffix("\n"))  # `write` ends it with the newline again


def line(text: str) -> None:
    """One result line on stdout (a path, a verdict), written as it is, not rendered by rich: rich expanded a tab in
    a folder's name to spaces and dropped a carriage return or a bell, so the line a script reads named a folder
    that does not exist (an audit). A reader gone: exit 141; a write that fails: an error naming stdout."""
    _require_stdout()
    _write_line("stdout", text)


def _write_line(name: str, text: str) -> None:
    """`text` and a newline on sys.stdout or sys.stderr (`name`) as it is: a reader gone, exit 141; a write that
    fails, an OSError naming the stream."""
    stream = getattr(sys, name)
    if stream is None:  # stderr closed (`2>&-`): nothing to say it on
        return
    try:
        named_call(name, stream.write, text + "\n")
        named_call(name, stream.flush)
    except BrokenPipeError:
        reader_gone(stream)


def error(message: str) -> None:
    _say("error:", "bold red", message)


def warn(message: str) -> None:
    _say("warning:", "yellow", message)


def info(message: str) -> None:
    _say("", "", message)


def _say(label: str, style: str, message: str) -> None:
    """`label message` on stderr. Into a file or a pipe (a log, a script's capture) the message is written as it
    is, as `line` writes a result: rich expanded a tab in a path to spaces and dropped a carriage return or a bell,
    so `error: <path>: ...` named a path that does not exist (an audit). In a terminal rich prints it, `label` in
    `style`, beside a live progress display (a raw carriage return would send the cursor back over the line)."""
    console = _console("stderr")
    message = torchrun.by_rank(message)
    if console.is_terminal:
        console.print(f"[{style}]{label}[/] " if label else "", plain(message), sep="", highlight=False)
    else:
        _write_line("stderr", f"{label} {message}" if label else message)


def error_at_once(message: str, code: int, as_json: bool) -> None:
    """`error: message` on stderr, and with `as_json` its document ({"ok": false, "exit_code": code, ...},
    one line) on stdout, each in one write(2) that takes no lock: for a process about to end with os._exit
    from a signal handler, whose main thread may hold the consoles' locks."""
    say_at_once(f"error: {torchrun.by_rank(message)}\n")
    if as_json:
        document = (json.dumps(_ranked(error_document(message, code))) + "\n").encode()
        shared = torchrun.shared_rank() is not None
        with _stream_locked(1) if shared else nullcontext():  # not inside another rank's (_write_whole)
            os.write(1, document)


def say_at_once(text: str) -> None:
    """`text` on stderr in one write(2) that takes no lock (error_at_once), or nothing where it cannot be said:
    a stderr closed when the process started (`2>&-`), whose descriptor 2 may since be a file of the run's
    (OUT's lock file), or one that fails (a full disk)."""
    if sys.stderr is None:
        return
    with suppress(OSError):
        os.write(2, text.encode("utf-8", "backslashreplace"))


@contextmanager
def byte_progress(title: str, quiet: bool = False) -> Iterator[ProgressFn]:
    """A rich progress display with one bar per label, bytes (or items: progress.counting), speed
    (app/speed_column.py) and ETA, on stderr."""
    if quiet:
        yield lambda label, done, total: None
        return
    from rich.progress import BarColumn, Progress, TaskID, TextColumn

    from dsv41_convert.app.speed_column import AmountColumn, MeanSpeedColumn, StallAwareTimeRemaining, Stalls
    from dsv41_convert.progress import counted

    stalls = Stalls()
    columns = (
        # no markup: its emoji codes showed a file `a:100:b` as `a\U0001f4afb` (the consoles' emoji=False is not
        # the markup's own)
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        AmountColumn(),
        MeanSpeedColumn(stalls),
        StallAwareTimeRemaining(stalls),
    )
    tasks: dict[str, TaskID] = {}
    info(title)
    with Progress(*columns, console=_console("stderr"), transient=False) as progress:

        def update(label: str, done: int, total: int) -> None:
            if label not in tasks:
                shown, noun = counted(label)
                tasks[label] = progress.add_task(shown, total=total, noun=noun)
            progress.update(tasks[label], completed=done, total=total)

        yield update
