"""``pysafetensors validate``: every problem in a file or model, each with tensor and offset."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Final

from .._validate import Problem, locate_model, validate
from ._common import (
    HEADER_LIMIT_HINT,
    Ui,
    add_header_limit_arg,
    plural,
    print_json,
    quoted,
    sanitize,
    shown,
    url_argument_errors,
)
from ._remote_args import add_remote_args, remote_options

SCHEMA: Final = "pysafetensors.validate/1"


def register(sub: Any) -> None:
    """Add the ``validate`` subcommand."""
    p = sub.add_parser(
        "validate",
        help="report every problem in a file, folder or index (exit 0 valid, 1 problems)",
        description="Check a file or sharded model against the format rules and report every "
        "problem, not just the first. Exit code: 0 valid, 1 problems found, 2 usage error or "
        "unreadable target.",
    )
    p.add_argument("target", metavar="TARGET", help="file, model folder, index or URL")
    p.add_argument(
        "--strict",
        action="store_true",
        help="also warn about NaN/Inf values, unaligned tensors, missing `format` metadata, ... "
        "(reads all tensor data); warnings then count as problems",
    )
    p.add_argument("--json", action="store_true", help=f"machine-readable output ({SCHEMA})")
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run, trouble_code=2)


def _line(p: Problem) -> str:
    where = []
    if p.tensor is not None:
        where.append(f"tensor {sanitize(repr(p.tensor))}")
    if p.offset is not None:
        where.append(f"offset {p.offset}")
    loc = f" ({', '.join(where)})" if where else ""
    file = f"{quoted(p.file)}: " if p.file else ""
    return f"{file}{p.severity} [{p.code}]{loc}: {sanitize(p.message)}"


def run(args: argparse.Namespace) -> int:
    """Run ``validate``."""
    ui = Ui(args)
    options = remote_options(args)
    with url_argument_errors():
        located = locate_model(args.target, storage_options=options)
    # Only --strict reads tensor data; the bar counts local bytes (URL sizes are not known yet).
    total = 0
    if args.strict:
        total = sum(
            os.path.getsize(p) for p in located.files if "://" not in p and os.path.isfile(p)
        )
    with ui.progress(total, "validate") as update, url_argument_errors():
        problems = validate(
            args.target,
            strict=args.strict,
            progress=update,
            storage_options=options,
            max_header_size=args.max_header_size,
        )
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    if args.json:
        print_json(
            {
                "schema": SCHEMA,
                "target": shown(args.target),
                "strict": args.strict,
                "valid": not problems,
                "errors": errors,
                "warnings": warnings,
                "problems": [p.as_dict() for p in problems],
            }
        )
        return 1 if problems else 0
    for p in problems:
        ui.line(_line(p), style="red" if p.severity == "error" else "yellow")
    if problems:
        ui.line(
            f"{sanitize(shown(args.target))}: {errors} error{'s' * (errors != 1)}, "
            f"{warnings} warning{'s' * (warnings != 1)}",
            style="bold",
        )
        if any(p.code == "HeaderTooLarge" for p in problems):
            print(HEADER_LIMIT_HINT, file=sys.stderr)
        return 1
    what = plural(len(located.files), "file") if located.sharded else "file"
    ui.line(
        f"{sanitize(shown(args.target))}: OK ({what} valid{', strict' if args.strict else ''})",
        "green",
    )
    return 0
