"""``pysafetensors merge``: merge a sharded checkpoint into one ``.safetensors`` file.

Tensor bytes are copied file to file, never decoded; the output is byte-identical to saving the
same tensors in one ``save_file`` call with the model's metadata (what every shard agrees on,
then the index's; the source's ``format``, else ``"pt"``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._cmd_reshard import add_fsync_arg, progress_for
from ._common import (
    OutputFolders,
    Ui,
    add_header_limit_arg,
    check_source,
    human_bytes,
    make_parent,
    sanitize,
    warn_beside_index,
)
from ._remote_args import add_remote_args, remote_options


def register(subparsers: Any) -> None:
    """Add the ``merge`` subcommand."""
    p = subparsers.add_parser(
        "merge",
        help="merge a sharded checkpoint into one file (no decoding, bounded memory)",
        description="Merge the shards of a model folder or *.index.json into one .safetensors "
        "file; the index's metadata (without total_size) goes into the file's header.",
    )
    p.add_argument("source", metavar="SOURCE", help="model folder or *.index.json")
    p.add_argument("output", metavar="OUTPUT", help="output .safetensors file")
    add_fsync_arg(p)
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``merge``; returns the exit code."""
    from .._reshard import merge

    options = remote_options(args)
    check_source(args.source, options, args.max_header_size)
    ui = Ui(args)
    with OutputFolders() as folders, progress_for(ui, "merging") as report:
        make_parent(args.output, folders)
        merge(
            args.source,
            args.output,
            fsync=args.fsync,
            progress=report,
            storage_options=options,
            max_header_size=args.max_header_size,
        )
    warn_beside_index(args.output)
    ui.note(f"wrote {sanitize(args.output)} ({human_bytes(os.path.getsize(args.output))})")
    return 0
