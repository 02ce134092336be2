"""Run the dsv41-convert CLI in this process, as a user would from the shell, and capture its output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsv41_convert.cli import main
from dsv41_convert.store.manifest import DONE_DIR
from dsv41_convert.store.source_stamps import PREFIX as STAMPS_PREFIX


def default_sigint() -> None:
    """In the child before exec: SIGINT unblocked and at its default, as a shell starts a command. A child
    of the test process inherits an ignored or blocked SIGINT from it, and in the whole suite (not in one
    file alone) the runs these tests interrupt ignored the signal and ran to the end."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """-> (exit code, stdout, stderr with rich's line wrapping undone)"""
    monkeypatch.setattr(sys, "argv", ["dsv41-convert", *args])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


_SIGNAL_IN_AN_IMPORT = """
import os, signal, sys
from dsv41_convert import cli

MODULE = sys.argv[1]

class SignalDuringTheImport:
    def find_spec(self, name, path=None, target=None):
        if name == MODULE:
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except KeyboardInterrupt:  # swallowed by the import (as a KeyboardInterrupt in importlib's
                pass  # module-lock callback is dropped)

sys.meta_path.insert(0, SignalDuringTheImport())
sys.argv = ["dsv41-convert", *sys.argv[2:]]
cli.main()
"""


def run_cli_with_a_signal_in_an_import(module: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a child process that sends itself SIGTERM when `module` is first imported, inside that
    import, which swallows any KeyboardInterrupt raised there."""
    return subprocess.run([sys.executable, "-c", _SIGNAL_IN_AN_IMPORT, module, *args], capture_output=True, text=True)


_FILE_SIZE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv.pop(1))
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = ["dsv41-convert"] + sys.argv[1:]
from dsv41_convert.cli import main
main()
"""


def run_cli_with_file_size_limit(limit_bytes: int, *args: str) -> subprocess.CompletedProcess:
    """The CLI in a subprocess whose files cannot grow past `limit_bytes`: write() fails with EFBIG
    mid-file, as on a full disk. -> the finished process (text stdout/stderr)"""
    return subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMITED, str(limit_bytes), *args],
                          capture_output=True, text=True)  # fmt: skip


def run_records(out: Path) -> list[str]:
    """What a run left in OUT/.dsv41-convert besides the source it read (store/source_stamps.py)."""
    return sorted(p.name for p in (out / DONE_DIR).glob("*") if not p.name.startswith(STAMPS_PREFIX))


def done_records(out: Path) -> set[str]:
    """The files of `out` that have a done record (what --resume skips, once their size and sha256 check)."""
    return {p.name.removesuffix(".done.json") for p in (out / DONE_DIR).glob("*.done.json")}


def partial_sizes(out: Path, pattern: str = "*.partial") -> list[int]:
    """The sizes of the partial files in `out` matching `pattern`; one renamed into place between the listing
    and its stat (its writer finishing it) is passed over."""
    sizes = []
    for p in out.glob(pattern) if out.exists() else []:
        try:
            sizes.append(p.stat().st_size)
        except FileNotFoundError:
            pass
    return sizes


def kill_9_with_a_done_file_and_a_partial(
    proc: subprocess.Popen, out: Path, partial_bytes: int = 20_000, timeout: float = 120
) -> None:
    """kill -9 a running conversion into `out` (started with process_group=0: its workers in its group) at a
    moment when one file is done (its done record) and a partial file holds more than `partial_bytes`
    (partial_bytes=-1: any partial file); raises AssertionError after `timeout` s. The group is stopped
    (SIGSTOP) before the state is read and killed while stopped, so the state read is the state killed: a
    poll that saw it and then killed let a partial finish in between under load (CI, once). Its workers die
    with it (PR_SET_PDEATHSIG's SIGKILL ends a stopped process too). Written with O_DIRECT, a partial file
    grows one staging piece (8 MiB) at a time, at a checkpoint or at its end."""

    def wanted() -> bool:
        sizes = partial_sizes(out)
        return bool(done_records(out) and sizes and max(sizes) > partial_bytes)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if wanted():
            os.killpg(proc.pid, signal.SIGSTOP)
            if wanted():
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                os.killpg(proc.pid, signal.SIGCONT)  # any process left stopped in the group goes on to its end
                return
            os.killpg(proc.pid, signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError(f"{out}: no done file beside a partial one over {partial_bytes} bytes in {timeout} s")


def processes_with_open(path: Path) -> set[int]:
    """The processes (other than this one) that have `path` open (Linux /proc)."""
    found = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == str(path) for fd in fd_dir.iterdir()):
                found.add(int(fd_dir.parent.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found - {os.getpid()}


def convert_and_reference(monkeypatch, capsys, folder: Path, seed: int, tp: int, *reference: str) -> tuple[Path, Path]:
    """make-tiny (`seed`) into folder/src, `shard --tp tp` into folder/mp{tp}, `reference-logits` of the source
    (its options `reference`) into folder/ref.safetensors, each asserted to succeed. -> (rank files, reference)"""
    src, conv, ref = folder / "src", folder / f"mp{tp}", folder / "ref.safetensors"
    for args in (
        ("make-tiny", str(src), "--seed", str(seed)),
        ("shard", str(src), str(conv), "--tp", str(tp)),
        ("reference-logits", str(src), str(ref), *reference),
    ):
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 0, err
    return conv, ref
