"""``pysafetensors scan PATH...``: list and grade the globals pickles would import.

Exit codes: 0 every file is safe, 1 at least one is suspicious (or could not be fully
analysed), 2 at least one is dangerous.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Final

from ._common import plural, quoted, sanitize

__all__ = ["register"]

SCHEMA: Final = "pysafetensors.scan/1"


def register(subparsers: Any) -> None:
    """Add the ``scan`` subcommand."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "scan",
        help="list the globals a pickle or PyTorch checkpoint imports, without running it",
        description=(
            "Scan pickles and PyTorch checkpoints (zip, legacy, tar; any member or stream) "
            "for the globals they import, graded safe / suspicious / dangerous. Nothing is "
            "executed. Exit codes: 0 all safe, 1 suspicious or not fully analysable, "
            "2 dangerous."
        ),
    )
    p.add_argument("paths", metavar="PATH", nargs="+", help="files to scan")
    p.add_argument("--json", action="store_true", help=f"print the reports as JSON ({SCHEMA})")
    p.add_argument("-v", "--verbose", action="store_true", help="list safe globals too")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``scan``; returns 0, 1 or 2."""
    from ..scan import GRADES, scan_files

    # Each file gets its verdict even when another cannot be read or scanned: a traceback on
    # the first bad path would hide a dangerous file listed after it.
    reports = scan_files(args.paths)
    if args.json:
        worst = max((r.exit_code for r in reports), default=0)
        doc = {
            "schema": SCHEMA,
            "grade": GRADES[worst],
            "files": [r.to_dict() for r in reports],
        }
        print(json.dumps(doc, indent=2, ensure_ascii=True))
    else:
        for r in reports:
            streams = plural(r.streams, "pickle stream")
            print(f"{sanitize(r.path)}: {r.grade} ({r.format}, {streams})")
            if args.quiet:
                continue
            seen: set[tuple[str, str]] = set()
            for g in r.globals:
                if (g.grade == "safe" and not args.verbose) or (g.qualname, g.grade) in seen:
                    continue
                seen.add((g.qualname, g.grade))
                print(f"  {g.grade:10} {quoted(g.qualname)}  [{quoted(g.where)} @{g.offset}]")
            for f in r.findings:
                print(f"  {f.grade:10} {sanitize(f.message)}  [{quoted(f.where)}]")
    return max((r.exit_code for r in reports), default=0)
