"""``pysafetensors reshard``: re-split a checkpoint into shards of a new size.

Tensor bytes are copied file to file (``copy_file_range`` where the kernel has it), never
decoded; the output is byte-identical to saving the same tensors directly with the hub's
splitter, and memory stays bounded whatever the model's size.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ._common import (
    OutputFolders,
    Ui,
    UsageError,
    add_header_limit_arg,
    check_output_folder,
    check_source,
    human_bytes,
    plural,
    sanitize,
)
from ._remote_args import add_remote_args, remote_options


def register(subparsers: Any) -> None:
    """Add the ``reshard`` subcommand."""
    p = subparsers.add_parser(
        "reshard",
        help="re-split a checkpoint into shards of a new size (no decoding, bounded memory)",
        description="Re-split a model folder, index or file into shards of at most "
        "--max-shard-size, named and indexed as the Hugging Face hub does "
        "(model-00001-of-00003.safetensors + model.safetensors.index.json; a single "
        "model.safetensors when everything fits). OUTPUT may be the source folder itself.",
    )
    p.add_argument("source", metavar="SOURCE", help="model folder, *.index.json or .safetensors")
    p.add_argument("output", metavar="OUTPUT", help="output folder")
    add_shard_args(p, default="5GB")
    add_fsync_arg(p, reshard=True)
    add_remote_args(p)
    add_header_limit_arg(p)
    p.set_defaults(func=run)


def add_fsync_arg(p: argparse.ArgumentParser, *, reshard: bool = False) -> None:
    """``--fsync``, shared with ``merge`` and ``extract`` (``reshard``: its own case said)."""
    always = " (a reshard into the source's folder always does: it deletes the old files)"
    p.add_argument(
        "--fsync",
        action="store_true",
        help="flush the output to disk before returning" + (always if reshard else ""),
    )


def add_shard_args(p: argparse.ArgumentParser, *, default: str | None) -> None:
    """``--max-shard-size`` and ``--filename-pattern``, shared with ``extract``."""
    p.add_argument(
        "-s",
        "--max-shard-size",
        type=shard_size,
        default=default,
        metavar="SIZE",
        help="limit per shard: bytes or decimal units TB/GB/MB/KB, e.g. 5GB, 500MB"
        + (f" (default {default})" if default else ""),
    )
    p.add_argument(
        "--filename-pattern",
        default=None,
        metavar="PATTERN",
        help="output file names: a plain *.safetensors name with a {suffix} field, which "
        "becomes -00001-of-00003 (default model{suffix}.safetensors; reshard into the "
        "source's folder: the source's own names)",
    )


def shard_size(text: str) -> str:
    """``argparse`` type for ``--max-shard-size``: bytes or ``5GB``-style, more than 0."""
    from .._sharding import SIZE_UNITS, parse_size

    number = text.strip().lstrip("+-").isdigit()
    if not number and text.strip()[-2:].upper() not in SIZE_UNITS:
        # The library keeps the hub's text ("Unit 'NF' not supported" for "inf"), which reads
        # oddly for "inf", "1e400" or "12.5": say what a size may be.
        raise argparse.ArgumentTypeError(
            f"not a whole number of bytes or a size in TB, GB, MB or KB: {text!r}"
        )
    try:
        n = parse_size(int(text) if number else text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n <= 0:
        # 0 would give every tensor a file of its own (and empty tensors none); a negative
        # limit has no meaning.
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, not {text!r}")
    # A byte count as plain digits ("+5", " 5" -> "5"): what parse_size_arg reads as a number
    # (the library's parse_size takes a string only with a unit).
    return str(n) if number else text


def parse_size_arg(text: str | None) -> int | str | None:
    """A size given on the command line: a plain number means bytes."""
    if text is None:
        return None
    return int(text) if text.strip().isdigit() else text


def check_pattern(pattern: str) -> None:
    """Refuse a ``--filename-pattern`` before anything is read or written (exit 2)."""
    from .._errors import SerializeError
    from .._sharding import check_filename_pattern

    try:
        # Checked as if sharded: whether one file results is only known after planning.
        check_filename_pattern(pattern, shards=2)
    except SerializeError as exc:
        raise UsageError(f"--filename-pattern: {exc}") from None


@contextlib.contextmanager
def progress_for(ui: Ui, desc: str) -> Iterator[Callable[[int, int], None]]:
    """Adapt the library's ``progress(done, total)`` callback to the CLI's progress bar."""
    with contextlib.ExitStack() as stack:
        state: dict[str, Any] = {"update": None, "done": 0}

        def report(done: int, total: int) -> None:
            if state["update"] is None:
                state["update"] = stack.enter_context(ui.progress(total, desc))
            state["update"](done - state["done"])
            state["done"] = done

        yield report


def run(args: argparse.Namespace) -> int:
    """Run ``reshard``; returns the exit code."""
    from .._reshard import reshard

    if args.filename_pattern is not None:
        check_pattern(args.filename_pattern)
    check_output_folder(args.output, "reshard writes a folder", "; `merge` writes one file")
    options = remote_options(args)
    check_source(args.source, options, args.max_header_size)
    ui = Ui(args)
    with OutputFolders() as folders, progress_for(ui, "resharding") as report:
        folders.expect(args.output)  # created by reshard(); removed again if it fails
        plan = reshard(
            args.source,
            args.output,
            parse_size_arg(args.max_shard_size) or "5GB",
            filename_pattern=args.filename_pattern,
            fsync=args.fsync,
            progress=report,
            storage_options=options,
            max_header_size=args.max_header_size,
        )
    files = len(plan.filename_to_tensors)
    ui.note(
        f"wrote {plural(len(plan.tensor_to_filename), 'tensor')} ({human_bytes(plan.total_size)})"
        f" in {plural(files, 'file')} to {sanitize(args.output)}"
    )
    return 0
