"""The error types a user can meet. Each message names the file and tensor, what was found,
what was expected, and a next step. `cli.main` turns them into `error: ...` and exit code 2."""

import re

CHECK_FAILED = 1  # the exit code of a check that ran and failed (check, download; verify's FAIL); an input error: 2

# every way json.loads fails on a file's text: bad syntax, bytes that are not UTF-8 (both ValueErrors, as is an
# integer of more than 4300 digits, past Python's int-string limit: an audit's traceback), and nesting deeper
# than Python's recursion limit (`[[[[...` 1500 deep in a 3 KB safetensors header: a RecursionError)
NOT_JSON = (ValueError, RecursionError)


class ConvertError(Exception):
    """Base of every input problem: bad config, bad checkpoint, bad option."""


class ConfigError(ConvertError):
    """config.json is missing a key, has an unknown one, or has a value the model cannot take."""


class HeaderError(ConvertError):
    """A safetensors header is unreadable, corrupt, oversized, or points outside its file."""


class FormatError(ConvertError):
    """Tensor data is not what its dtype promises (NaN/Inf to quantize, a lossy cast, bad scale)."""


class PlanError(ConvertError):
    """The checkpoint's tensors do not fit the rules: missing, extra, wrong dtype or shape, bad tp."""


class OutputError(ConvertError):
    """The output folder is unsafe to write: not empty without --overwrite, inside the source, full."""


class DownloadError(ConvertError):
    """The Hub refused or lost a file: auth, 404, network, disk, checksum."""


class VerifyInputError(ConvertError):
    """verify was given inputs it cannot compare (prompts, reference logits, shard set)."""


class LockedError(OutputError):
    """Another process is writing into the same folder or file (store/lock.py); the message names it."""


class ShardConsistencyError(ConvertError):
    """The rank files of one conversion disagree: a replicated tensor differs between ranks, an expert
    is held by the wrong rank, split pieces differ in shape, Engram padding is missing or not the fill.
    verify reports it as a failed check (exit 1); elsewhere it is an input error."""


def first_few(names: list[str], shown: int = 3) -> str:
    """The first `shown` of `names` for a message, "a, b, c, ..." when there are more."""
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")


def names_a_rank(message: str) -> bool:
    """Whether `message` begins by naming the rank it is about ("rank 1: ...", "rank 1 of 2: ..."): an error a
    rank raised itself, or one gathered from every rank, which another prefix would misattribute."""
    return re.match(r"rank \d+( of \d+)?: ", message) is not None


class RankFailedError(ConvertError):
    """A process of the run died (a rank or a writer worker: a signal, out of memory) or a rank lost its
    peers: the run failed, not its input. The CLI exits 1 with the message (and its --json document)."""


def first_words(exc: BaseException, limit: int = 300) -> str:
    """The first sentence of `exc`'s first line (gloo adds advice after it), at most `limit` characters."""
    first = (str(exc).splitlines() or [""])[0]
    return first.split(". ")[0][:limit]


def crash_line(exc: BaseException) -> str:
    """A failure that is not an input error (a crash), as one line for its message and document; its
    traceback goes to stderr first. Call it where `exc` is being handled."""
    import traceback

    traceback.print_exc()
    return f"{type(exc).__name__}: {first_words(exc)}"
