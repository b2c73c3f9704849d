"""The ``pysafetensors`` command line: one entry point, one module per subcommand.

Each subcommand lives in ``_cmd_<name>.py`` and exposes ``register(subparsers)``, which adds its
parser and sets ``func`` to a callable ``(args) -> int``. Library code never prints or exits; only
this package does, and errors become one line on stderr with a non-zero exit code (the full
traceback with ``--debug``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Final

from .._errors import SafetensorError

__all__ = ["main"]

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
    parser = argparse.ArgumentParser(
        prog="pysafetensors",
        description="Inspect, validate, compare, convert and edit safetensors files.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars or informational output"
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        return int(code or 0)
    except SafetensorError as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except (OSError, ValueError, TypeError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
