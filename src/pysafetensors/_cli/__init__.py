"""The ``pysafetensors`` command line: one entry point, one module per subcommand.

Each subcommand lives in ``_cmd_<name>.py`` and exposes ``register(subparsers)``, which adds its
parser and sets ``func`` to a callable ``(args) -> int``. Library code never prints or exits; only
this package does, and errors become one line on stderr with a non-zero exit code (the full
traceback with ``--debug``).

Exit codes: 0 success; 1 a negative result (``validate`` found problems, ``diff`` found
differences) or a malformed file; 2 a usage error or a file that cannot be read; 130 interrupted.
``--debug`` adds tracebacks, never another exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Final, TextIO

from .._errors import RemotePermissionError, SafetensorError, UnsafePickleError
from ._common import HEADER_LIMIT_HINT, sanitize

__all__ = ["COMMANDS", "build_parser", "main"]

#: Subcommand modules, in the order ``--help`` lists them. A missing module is skipped.
COMMANDS: Final = (
    "inspect",
    "validate",
    "diff",
    "stats",
    "hash",
    "cast",
    "metadata",
    "convert",
    "scan",
    "reshard",
    "merge",
    "extract",
)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every available subcommand."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="pysafetensors",
        description=(
            "Inspect, validate, compare, convert and edit safetensors files. TARGET is a "
            ".safetensors file, a model folder or *.safetensors.index.json (sharded), or an "
            "http(s):// or s3:// URL of a file, an index or a folder (ending with /; only the "
            "bytes needed are fetched)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"pysafetensors {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars or informational output"
    )
    parser.add_argument(
        "--no-color", action="store_true", help="plain output even on a terminal (also NO_COLOR)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"._cmd_{name}", __package__)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.endswith(f"_cmd_{name}"):
                continue
            raise
        module.register(sub)
    return parser


def _fail(args: argparse.Namespace, exc: BaseException, code: int) -> int:
    """Report a failure and return ``code``: one line, or with ``--debug`` the traceback first
    (the exit code is the same either way: scripts may run with ``--debug`` on)."""
    if getattr(args, "debug", False):
        _print_traceback(exc)
    # Messages may quote names from a hostile file: escape them like everything else we print.
    print(f"error: {sanitize(str(exc) or type(exc).__name__)}", file=sys.stderr)
    return code


def _unsafe_pickle_hint(exc: UnsafePickleError, skipping: bool) -> None:
    """Say what ``--skip-unknown`` would do about a refused checkpoint."""
    if exc.skippable and not skipping:
        hint = (
            # Only the first refusal is known here: a dangerous global later in the file, or
            # a file that is this one object and nothing else, still fails with the flag.
            "--skip-unknown leaves out objects of unknown classes like this one (nothing of "
            "them is run; tensors inside them are left out, except an nn.Module's: a whole "
            "pickled model converts as its state_dict()) and converts the rest, unless "
            "something else in the file is refused in any case"
        )
    elif not exc.skippable:
        hint = (
            "this is refused even with --skip-unknown (it could run code or reach files); "
            "'pysafetensors scan' lists everything the file imports"
        )
    else:  # pragma: no cover - a skippable global is skipped with --skip-unknown
        return
    print(f"hint: {hint}", file=sys.stderr)


def _print_traceback(exc: BaseException) -> None:
    """``exc``'s traceback on stderr, each line escaped as every message is (its texts may
    quote names from a hostile file)."""
    for chunk in traceback.format_exception(exc):
        for line in chunk.splitlines():
            print(sanitize(line), file=sys.stderr)


def _print_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Show a warning as the commands' own ``warning:`` lines are (not Python's source line)."""
    print(f"warning: {sanitize(str(message))}", file=sys.stderr)


def _warning_error(exc: Warning) -> Warning:
    """A warning raised as an error, as ``error:`` shows it: the commands' own warnings
    (UserWarning and its kinds) by their text, as their ``warning:`` lines; any other (a
    library's DeprecationWarning, say) with its category, which says where it came from.
    Its traceback stays, for ``--debug``."""
    if isinstance(exc, UserWarning):
        return exc
    name = type(exc).__name__
    return Warning(f"{name}: {exc}" if str(exc) else name).with_traceback(exc.__traceback__)


def _stand_in_for_closed_streams() -> None:
    """Give a closed stdout or stderr a stand-in that discards what is written.

    Python sets ``sys.stdout``/``sys.stderr`` to None when the process starts with that
    descriptor closed (``>&-``). Output is then discarded, as intended, but ``flush`` raised
    AttributeError after the command had run (a traceback and exit 1: "problems" for a valid
    file), and ``print(..., file=None)`` writes to stdout: with stderr closed, ``warning:``
    lines went into ``--json`` output. Opening the null device also takes the free descriptor,
    so no file opened later gets number 1 or 2 (where stray writes of other code would land).
    """
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code."""
    _stand_in_for_closed_streams()
    stream = sys.stdout
    errors = _escape_what_stdout_cannot_encode()
    try:
        return _main(argv)
    finally:
        if errors is not None:
            with contextlib.suppress(Exception):  # closed meanwhile: nothing to restore
                getattr(stream, "reconfigure")(errors=errors)  # noqa: B009 - typed as IO


def _escape_what_stdout_cannot_encode() -> str | None:
    """Make stdout write what its encoding cannot hold as backslash escapes; the error
    handler it had, to restore (None: unchanged).

    With an encoding other than UTF-8 (``PYTHONIOENCODING=ascii``, a Windows code page, a
    redirect under a legacy locale), a name or value outside it stopped the output halfway
    with ``error: 'ascii' codec can't encode characters...``, naming nothing. Names and values
    are escaped (and so quoted) before this (``sanitize``); this catches the rest. stderr
    escapes already (Python's default there). JSON output is ASCII whatever the encoding.
    """
    stream = sys.stdout
    errors: str | None = getattr(stream, "errors", None)
    if errors != "strict" or not hasattr(stream, "reconfigure"):
        return None
    try:
        stream.reconfigure(errors="backslashreplace")
    except Exception:  # noqa: BLE001 - a stream that cannot change: left as it is
        return None
    return errors


def _main(argv: Sequence[str] | None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        # Ctrl-C while the options are read (building the parser imports the commands): the
        # exit code of an interrupted command, not a traceback.
        return 130
    except Warning as exc:  # raised by the user's filters while the commands are imported
        return _fail(argparse.Namespace(), _warning_error(exc), 1)
    # Commands whose 1 means "a negative answer" (validate, diff) report failures as 2.
    trouble = getattr(args, "trouble_code", None)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _print_warning
            code = args.func(args)
        sys.stdout.flush()
        return int(code or 0)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, without a second error at exit, and
        # exit as a process killed by SIGPIPE would (128 + 13), not with 1 ("problems").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)  # the copy on stdout's number stays
        return 141
    except OSError as exc:  # includes RemoteError: the target cannot be read
        code = _fail(args, exc, 2)
        if (
            isinstance(exc, RemotePermissionError)
            and hasattr(args, "headers")
            and str(exc).lower().startswith(("http://", "https://"))
        ):
            # The library's message names its own `headers=` option (S3 credentials come from
            # the AWS chain instead).
            print(
                "hint: on the command line, give credentials with -H 'Authorization: Bearer "
                "TOKEN', or -H @FILE to keep the token off the command line",
                file=sys.stderr,
            )
        return code
    except SafetensorError as exc:
        # A folder holding several checkpoints: the user must name one (a usage error, as for
        # an empty folder), whichever command met it. An output that would overwrite the
        # source is an output that cannot be written.
        code = 2 if exc.kind in ("AmbiguousFolder", "OutputIsSource") else exc.exit_code
        code = _fail(args, exc, trouble or code)
        if isinstance(exc, UnsafePickleError) and hasattr(args, "skip_unknown"):
            _unsafe_pickle_hint(exc, args.skip_unknown)
        if exc.kind == "HeaderTooLarge" and hasattr(args, "max_header_size"):
            print(HEADER_LIMIT_HINT, file=sys.stderr)  # the library's message names its keyword
        return code
    except (ValueError, TypeError, KeyError) as exc:
        return _fail(args, exc, trouble or 1)
    except MemoryError:
        # Inputs are bounded where the library can tell; this is the machine running out (a
        # process limit, say): one line, as for every other failure.
        return _fail(args, MemoryError("out of memory"), trouble or 1)
    except KeyboardInterrupt:
        return 130
    except Warning as exc:
        # A warning the user's filters turn into an error (PYTHONWARNINGS=error, -W error):
        # one line, as the warning itself would have been, not a traceback.
        return _fail(args, _warning_error(exc), trouble or 1)
    except Exception as exc:
        # A failure no check foresaw (a bug): its traceback, to report it, and the exit code
        # of a failure to run (for validate and diff, 1 means problems found, never this).
        _print_traceback(exc)
        return trouble or 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
