"""``pysafetensors extract``: copy the tensors whose names match into a new file or folder.

Patterns are shell globs matched against whole names (``'model.layers.0.*'``), or regular
expressions searched anywhere in the name with ``--regex``. Bytes are copied file to file.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from .._sharding import DEFAULT_FILENAME_PATTERN
from ._cmd_reshard import (
    add_fsync_arg,
    add_shard_args,
    check_pattern,
    parse_size_arg,
    progress_for,
)
from ._common import (
    OutputFolders,
    Ui,
    UsageError,
    add_header_limit_arg,
    check_output_folder,
    check_source,
    make_parent,
    plural,
    quoted,
    sanitize,
    warn_beside_index,
)
from ._remote_args import add_remote_args, remote_options


def register(subparsers: Any) -> None:
    """Add the ``extract`` subcommand."""
    p = subparsers.add_parser(
        "extract",
        help="copy tensors matching name patterns into a new file (no decoding)",
        description="Copy the tensors of SOURCE whose names match any PATTERN into OUTPUT: one "
        ".safetensors file, or a sharded folder with --max-shard-size.",
    )
    p.add_argument("source", metavar="SOURCE", help="model folder, *.index.json or .safetensors")
    p.add_argument("output", metavar="OUTPUT", help="output file (a folder with -s)")
    p.add_argument("patterns", metavar="PATTERN", nargs="+", help="glob (or regex with -E)")
    p.add_argument(
        "-E", "--regex", action="store_true", help="patterns are regular expressions (re.search)"
    )
    add_shard_args(p, default=None)
    p.add_argument("--list", action="store_true", help="print the names extracted, one a line")
    add_fsync_arg(p)
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``extract``; returns the exit code."""
    from .._reshard import extract

    if args.regex:
        for pattern in args.patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UsageError(f"invalid --regex {pattern!r}: {exc}") from None
    if args.max_shard_size is None and args.filename_pattern is not None:
        # One output file is named by OUTPUT; a pattern would be silently ignored.
        raise UsageError("--filename-pattern names shards: it needs -s/--max-shard-size")
    pattern = args.filename_pattern or DEFAULT_FILENAME_PATTERN
    options = remote_options(args)
    # Folders created for the output are removed again (when still empty) if extract fails.
    with OutputFolders() as folders:
        if args.max_shard_size is not None:
            check_pattern(pattern)
            check_output_folder(
                args.output, "extract -s writes a folder", "; without -s, one file is written"
            )
            folders.expect(args.output)  # created by extract()
        else:
            make_parent(args.output, folders)
        check_source(args.source, options, args.max_header_size)
        ui = Ui(args)
        with progress_for(ui, "extracting") as report:
            names = extract(
                args.source,
                args.output,
                args.patterns,
                regex=args.regex,
                max_shard_size=parse_size_arg(args.max_shard_size),
                filename_pattern=pattern,
                fsync=args.fsync,
                progress=report,
                storage_options=options,
                max_header_size=args.max_header_size,
            )
    if args.max_shard_size is None:
        warn_beside_index(args.output)
    if args.list:
        for name in names:
            print(quoted(name))
    ui.note(f"extracted {plural(len(names), 'tensor')} to {sanitize(args.output)}")
    return 0
